"""OpenAI-compatible HTTP API (FastAPI) in front of an `EngineClient` (the router over the workers).

The event loop only tokenizes, routes and streams; model compute happens in worker processes,
so a long prefill never blocks the loop. The same app serves colocated and disaggregated
deployments: it knows the engines only through the `EngineClient` protocol.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvbaton.config import ConfigError
from kvbaton.engine.errors import EngineDeadError
from kvbaton.engine.request_output import RequestOutput
from kvbaton.engine.sampling_params import InvalidRequestError, SamplingParams
from kvbaton.server.admission import AdmissionController, AdmissionLimits
from kvbaton.server.engine_client import EngineClient
from kvbaton.server.metrics import ServerMetrics
from kvbaton.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from kvbaton.server.responses import ResponseBuilder, sse

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    admission: AdmissionLimits = AdmissionLimits()
    retry_after_s: int = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param


def _error(status: int, message: str, err_type: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, status, param), status_code=status, headers=headers)


class OpenAIServer:
    """Request handling, separate from route wiring so each piece stays small."""

    def __init__(self, client: EngineClient, settings: ServerSettings) -> None:
        self.client = client
        self.settings = settings
        self.metrics = ServerMetrics(settings.served_model_name)
        self.admission = AdmissionController(settings.admission, client.info.num_blocks * client.info.block_size)
        client.add_stats_listener(self.metrics.observe_stats)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.settings.served_model_name}`", "NotFoundError", "model")

    def completion_prompt(self, req: CompletionRequest) -> tuple[str | None, list[int]]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", "BadRequestError", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt, self.client.tokenizer.encode(prompt)
        return None, cast(list[int], list(prompt))  # neither str nor a batch: token ids (pydantic checked)

    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        text = self.client.tokenizer.apply_chat_template(req.plain_messages())
        return text, self.client.tokenizer.encode(text)

    async def handle(self, req: CompletionRequest | ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if isinstance(req, CompletionRequest):
            if req.echo:
                raise ApiError(400, "echo is not supported", "BadRequestError", "echo")
            kind, top_n = "completion", req.logprobs
            prompt, token_ids = self.completion_prompt(req)
        else:
            kind, top_n = "chat", req.top_logprobs
            prompt, token_ids = self.chat_prompt(req)
        params = req.sampling_params()
        try:
            self.client.validate(token_ids, params)
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), "BadRequestError", "prompt" if "prompt" in str(exc) else None) from exc
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:20]}"
        refusal = self.admission.try_admit(request_id, len(token_ids))
        if refusal is not None:
            self.metrics.rejected.labels(self.settings.served_model_name).inc()
            return _error(503, refusal, "ServiceUnavailableError",
                          headers={"Retry-After": str(self.settings.retry_after_s)})
        builder = ResponseBuilder(kind, request_id, self.settings.served_model_name, top_n)
        outputs = self._outputs(request_id, prompt, token_ids, params, req.priority)
        if req.stream:
            return StreamingResponse(self._stream(outputs, builder, kind, req.include_usage),
                                     media_type="text/event-stream")
        return await self._whole(outputs, builder, raw)

    async def _outputs(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                       priority: int) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs with metrics and admission bookkeeping attached."""
        last = None
        try:
            async for out in self.client.generate(request_id, prompt, token_ids, params, priority):
                now = time.monotonic()
                if last is None:
                    self.admission.started(request_id)
                self.metrics.observe_token(None if last is None else now - last)
                last = now
                if out.finished:
                    self.metrics.observe_finished(out)
                yield out
        finally:
            self.admission.started(request_id)

    async def _stream(self, outputs: AsyncGenerator[RequestOutput, None], builder: ResponseBuilder, kind: str,
                      include_usage: bool) -> AsyncIterator[str]:
        last = None
        try:
            if kind == "chat":
                yield sse(builder.chunk(None, first=True))
            async for out in outputs:
                last = out
                c = out.outputs[0]
                if c.delta_text or c.finish_reason or (c.logprobs and c.delta_token_ids):
                    yield sse(builder.chunk(out))
            if include_usage and last is not None:
                yield sse(builder.usage_chunk(last))
            yield sse("[DONE]")
        except EngineDeadError as exc:
            yield sse(error_body(str(exc), "InternalServerError", 500))
        finally:
            await outputs.aclose()

    async def _whole(self, outputs: AsyncGenerator[RequestOutput, None], builder: ResponseBuilder,
                     raw: Request) -> Response:
        async def collect() -> RequestOutput | None:
            last = None
            async for out in outputs:
                last = out
            return last

        task = asyncio.create_task(collect())
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await raw.is_disconnected():
                task.cancel()  # closes the generator, which aborts the request in the core
                return Response(status_code=499)
        try:
            out = task.result()
        except EngineDeadError as exc:
            return _error(500, str(exc), "InternalServerError")
        if out is None:  # the stream ended without an output: nothing to answer with
            return _error(500, "the engine returned no output", "InternalServerError")
        return JSONResponse(builder.full(out))


def build_app(client: EngineClient, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="kvbaton", docs_url=None, redoc_url=None)
    server = OpenAIServer(client, settings)
    app.state.server = server

    @app.middleware("http")
    async def require_api_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        key = settings.api_key
        if key and request.url.path.startswith(("/v1", "/admin")):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return _error(401, "invalid or missing API key", "AuthenticationError")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else first.get("msg", "invalid JSON")
        return _error(400, message, "BadRequestError", param)

    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.err_type, exc.param)

    @app.exception_handler(InvalidRequestError)
    @app.exception_handler(ConfigError)  # e.g. chat on a model whose tokenizer has no chat template
    async def on_invalid(_: Request, exc: Exception) -> JSONResponse:
        return _error(400, str(exc), "BadRequestError")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await server.handle(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await server.handle(req, raw)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": settings.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "kvbaton", "max_model_len": client.info.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if not client.is_alive:
            return _error(503, client.dead_reason or "no engine is running", "ServiceUnavailableError")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        s = client.stats
        return {"num_running": s.num_running, "num_waiting": s.num_waiting, "kv_cache_usage": s.kv_cache_usage,
                "prefix_cache_hit_rate": s.prefix_cache_hit_rate, "num_preemptions": s.num_preemptions,
                "num_in_flight": client.num_in_flight, "num_pending_admission": server.admission.num_pending}

    add_worker_routes(app, client)
    return app


def add_worker_routes(app: FastAPI, client: EngineClient) -> None:
    """`GET /workers` (topology and load) and the elastic-pool admin endpoints."""

    @app.get("/workers")
    async def workers() -> dict[str, Any]:
        return {"workers": client.workers_view()}

    @app.post("/admin/workers")
    async def add_worker(body: dict[str, Any]) -> dict[str, str]:
        role = body.get("role")
        if role not in ("prefill", "decode"):
            raise ApiError(400, "role must be 'prefill' or 'decode'", "BadRequestError", "role")
        name = await client.add_worker(role)
        try:
            await client.wait_for_workers([name], body.get("timeout_s", 600))
        except Exception as exc:
            raise ApiError(500, f"{name} did not start: {exc}", "InternalServerError") from exc
        return {"added": name}

    @app.post("/admin/workers/{name}/drain")
    async def drain_worker(name: str) -> dict[str, str]:
        try:
            await client.drain_worker(name)
        except KeyError:
            raise ApiError(404, f"no live worker named {name!r}", "NotFoundError", "name") from None
        except ValueError as exc:
            raise ApiError(409, str(exc), "ConflictError") from exc
        return {"draining": name}
