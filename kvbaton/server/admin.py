"""`GET /workers` (topology and load), `GET /experts` (MoE load and placement) and the elastic-pool admin
endpoints (`/admin/workers`).

Who may call them is `guards.AdminAccess`'s decision, made before a request gets here.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from kvbaton.server.engine_client import PoolClient
from kvbaton.server.errors import ApiError
from kvbaton.server.protocol import AddWorkerRequest


class PoolAdmin:
    """Adds and drains workers, never beyond `max_workers` in all (those starting included)."""

    def __init__(self, client: PoolClient, max_workers: int) -> None:
        self.client = client
        self.max_workers = max_workers
        self.num_starting = 0

    async def add(self, req: AddWorkerRequest) -> str:
        total = len(self.client.workers_view()) + self.num_starting
        if total >= self.max_workers:
            raise ApiError(409, f"the pool has {total} workers, the most this server may run (--max-workers "
                                f"{self.max_workers})", "ConflictError")
        self.num_starting += 1
        try:
            name = await self.client.add_worker(req.role)
            try:
                await self.client.wait_for_workers([name], req.timeout_s)
            except Exception as exc:
                raise ApiError(500, f"{name} did not start: {exc}", "InternalServerError") from exc
        finally:
            self.num_starting -= 1
        return name

    async def drain(self, name: str) -> None:
        try:
            await self.client.drain_worker(name)
        except KeyError:
            raise ApiError(404, f"no live worker named {name[:100]!r}", "NotFoundError", "name") from None
        except ValueError as exc:
            raise ApiError(409, str(exc), "ConflictError") from exc


def add_worker_routes(app: FastAPI, client: PoolClient, max_workers: int) -> None:
    admin = PoolAdmin(client, max_workers)

    @app.get("/workers")
    async def workers() -> dict[str, Any]:
        return {"workers": client.workers_view()}

    @app.get("/experts")
    async def experts() -> dict[str, Any]:
        view = client.expert_view()
        if view is None:
            raise ApiError(404, "this model has no sparse-expert (MoE) layers", "NotFoundError")
        return view

    @app.post("/admin/workers")
    async def add_worker(req: AddWorkerRequest) -> dict[str, str]:
        return {"added": await admin.add(req)}

    @app.post("/admin/workers/{name}/drain")
    async def drain_worker(name: str) -> dict[str, str]:
        await admin.drain(name)
        return {"draining": name}
