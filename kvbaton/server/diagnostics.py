"""`/admin/diagnostics/*`: measurements of a running deployment, for `kvbaton doctor` (and operators).

    GET  /admin/diagnostics/routing       how the router splits prompts between the pools, and its counters
    POST /admin/diagnostics/kv-transfer   per (prefill -> decode) pair: scratch KV transfers over the deployment's
                                          transport, small (latency) and large (bandwidth)
    POST /admin/diagnostics/all-reduce    a gloo all-reduce among the workers, small and large
    POST /admin/diagnostics/profile       each worker's compute path and a torch.profiler capture of its next steps

They are admin routes (`guards.AdminAccess` decides who may call them). Every probe is bounded here, in bytes,
repetitions and seconds (a body out of range is a 400), runs between scratch buffers of the workers (never their
KV pools), and one runs at a time (409 otherwise). A deployment that offers no diagnostics answers 404.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from kvbaton.server.engine_client import EngineClient
from kvbaton.server.errors import ApiError

MB = 2**20


class KVTransferProbeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    small_bytes: int = Field(default=4096, ge=1, le=MB)  # rounded up to whole blocks: at least one
    large_mb: float = Field(default=16.0, gt=0.0, le=128.0)
    repeats: int = Field(default=5, ge=1, le=20)
    timeout_s: float = Field(default=30.0, gt=0.0, le=120.0)


class AllReduceProbeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    small_bytes: int = Field(default=4096, ge=4, le=MB)
    large_mb: float = Field(default=8.0, gt=0.0, le=64.0)
    iters: int = Field(default=10, ge=1, le=100)
    timeout_s: float = Field(default=30.0, gt=0.0, le=120.0)


class ProfileProbeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    workers: list[str] | None = Field(default=None, min_length=1, max_length=64)  # None: every routable worker
    num_steps: int = Field(default=8, ge=1, le=64)
    max_duration_s: float = Field(default=10.0, gt=0.0, le=60.0)


class Diagnostics(Protocol):
    """What the routes need of a deployment's diagnostics (the router's `diagnostics`, see
    `kvbaton.router.diagnostics`). The probes raise an `EngineError` whose status is 409 while another runs,
    and KeyError naming the workers asked for that are not in the pool."""

    def routing(self) -> dict[str, Any]: ...

    async def kv_transfer(self, *, small_bytes: int, large_bytes: int, repeats: int, timeout_s: float) -> dict: ...

    async def all_reduce(self, *, sizes: list[int], iters: int, timeout_s: float) -> dict: ...

    async def profile(self, *, names: list[str] | None, num_steps: int, max_duration_s: float) -> dict: ...


def add_diagnostic_routes(app: FastAPI, client: EngineClient) -> None:
    def diagnostics() -> Diagnostics:
        found: Diagnostics | None = getattr(client, "diagnostics", None)
        if found is None:
            raise ApiError(404, "this deployment offers no diagnostics", "NotFoundError")
        return found

    @app.get("/admin/diagnostics/routing")
    async def routing() -> dict[str, Any]:
        return diagnostics().routing()

    @app.post("/admin/diagnostics/kv-transfer")
    async def kv_transfer(req: KVTransferProbeRequest) -> dict:
        return await diagnostics().kv_transfer(small_bytes=req.small_bytes, large_bytes=int(req.large_mb * MB),
                                               repeats=req.repeats, timeout_s=req.timeout_s)

    @app.post("/admin/diagnostics/all-reduce")
    async def all_reduce(req: AllReduceProbeRequest) -> dict:
        return await diagnostics().all_reduce(sizes=[req.small_bytes, int(req.large_mb * MB)], iters=req.iters,
                                              timeout_s=req.timeout_s)

    @app.post("/admin/diagnostics/profile")
    async def profile(req: ProfileProbeRequest) -> dict:
        try:
            return await diagnostics().profile(names=req.workers, num_steps=req.num_steps,
                                               max_duration_s=req.max_duration_s)
        except KeyError as exc:
            raise ApiError(404, f"no routable worker named {str(exc)[:200]}", "NotFoundError", "workers") from None
