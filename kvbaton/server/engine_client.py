"""What the HTTP server needs of the engines behind it: the one interface every deployment offers, in two parts.

- `RequestClient`: requests in, outputs out (`/v1/*`, `/health`, `/metrics`, the KV sessions' prefills);
- `PoolClient`: the pool behind it (`GET /workers`, `/experts`, the admin endpoints).

`EngineClient` is both. `kvbaton.router.router.Router` implements it for every deployment (colocated is a router
over one worker of role `both`), so the server has one code path; a test can implement either part. Each route
module takes the part it uses. The server imports these protocols, never the router.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any, Protocol

from kvbaton.kv.store.session import StoreTarget
from kvbaton.messages.router_worker import ImagePixels
from kvbaton.sched.info import EngineInfo, EngineStats
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.text.request_output import RequestOutput
from kvbaton.text.tokenizer import Tokenizer


class RequestClient(Protocol):
    """Contract:
    - `validate` raises InvalidRequestError (its `param` naming the field) for a request no engine could run.
    - `generate` validates first (InvalidRequestError, nothing sent), then yields the request's
      outputs until the finished one; an unfinished consumer that stops (client gone, task
      cancelled) aborts the request wherever it runs, so its KV blocks are freed. When no engine
      can serve, it raises (or ends the stream with) an `EngineError` (`EngineDeadError`, `RequestFailedError`,
      `RequestTimeoutError`), whose message says why and whose class says the HTTP status.
    - `info` is valid once the client is started; `stats` are the last reported, summed over the
      engines that decode.
    """

    tokenizer: Tokenizer
    dead_reason: str | None

    @property
    def info(self) -> EngineInfo: ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def is_alive(self) -> bool: ...

    @property
    def num_in_flight(self) -> int: ...

    @property
    def counters(self) -> dict[str, int]:
        """How requests went: dispatch paths, fallbacks, workers lost, and failover resumes (the tokens a
        resumed attempt restored from the KV store and the ones it recomputed)."""
        ...

    def validate(self, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None: ...

    def encode_refusal(self, num_images: int) -> str | None:
        """Why `num_images` more images cannot be queued for encoding now (an encoder pool at its bound: a 503),
        None if they can. Asked before a response starts; `generate` enforces the bound again."""
        ...

    def generate(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                 priority: int = 0, images: Sequence[ImagePixels] = ()) -> AsyncGenerator[RequestOutput, None]: ...

    async def abort(self, request_id: str) -> None: ...


class PoolClient(Protocol):
    """The pool behind the requests. Its methods raise KeyError for an unknown worker and ValueError for a refused
    change (e.g. draining the last worker of a role)."""

    def workers_view(self) -> list[dict[str, Any]]: ...

    def expert_view(self) -> dict[str, Any] | None:
        """MoE models: routed tokens per layer and expert, and each expert-parallel group's placement and
        balance (`GET /experts`); None for a dense model."""
        ...

    async def add_worker(self, role: str) -> str: ...

    async def wait_for_workers(self, names: list[str], timeout_s: float) -> None: ...

    async def drain_worker(self, name: str) -> None: ...

    def kv_store_target(self) -> StoreTarget | None:
        """The KV store the workers share, for the session endpoints (`/admin/kv/*`); None without one."""
        ...

    async def shutdown(self, timeout_s: float = 10.0) -> None: ...


class EngineClient(RequestClient, PoolClient, Protocol):
    """Both parts: what the app is built over (`server/api.py:build_app`)."""
