"""OpenAI-compatible HTTP API (FastAPI) in front of an `EngineClient` (the router over the workers).

The event loop only routes and streams: model compute happens in worker processes, and chat
templating and tokenization in a thread pool (`prompts.PromptEncoder`), so neither a long prefill
nor a long prompt blocks the loop. The same app serves colocated and disaggregated deployments: it
knows the engines only through the `EngineClient` protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvbaton.config import ConfigError
from kvbaton.messages.router_worker import ImagePixels
from kvbaton.mm.images import DecodedImage, ImageDecoder, ImageHold
from kvbaton.mm.placeholders import Placeholders
from kvbaton.router.errors import EngineError
from kvbaton.sched.sampling_params import InvalidRequestError, SamplingParams
from kvbaton.server.admin import add_worker_routes
from kvbaton.server.admission import AdmissionController
from kvbaton.server.choices import merged, request_choices, tool_chunks
from kvbaton.server.closing_stream import ClosingStreamingResponse
from kvbaton.server.diagnostics import add_diagnostic_routes
from kvbaton.server.engine_client import EngineClient
from kvbaton.server.errors import ApiError, HttpError, decoded_images, http_error
from kvbaton.server.grammars import GrammarCheck
from kvbaton.server.guards import AccessCheck, AdminAccess, BodyLimit
from kvbaton.server.kv_sessions import KVSessions, add_kv_session_routes
from kvbaton.server.metrics import ServerMetrics
from kvbaton.server.output_budget import OutputBudget, default_max_output_units
from kvbaton.server.prompts import PromptEncoder
from kvbaton.server.protocol import ChatCompletionRequest, CompletionRequest
from kvbaton.server.responses import ResponseBuilder, sse
from kvbaton.server.settings import ServerSettings
from kvbaton.server.tokenize_routes import Tokenization, add_tokenize_routes
from kvbaton.server.tool_calling import ToolCalling, plan_tool_calling
from kvbaton.server.tool_schemas import ToolSchemaCheck
from kvbaton.server.tools import inspect_chat_template
from kvbaton.text.request_output import RequestOutput

DISCONNECT_POLL_S = 0.5
# A whole response rendering this many logprob entries and tokens or more is built off the event loop: rendering and
# serializing took 7-10 ms per thousand entries on an AMX Xeon core, so ~15 ms at the threshold (a smaller body
# costs the loop less than the hop to a thread). The before/after: benchmarks/results/hardening.md.
RENDER_OFF_LOOP_ENTRIES = 2_000


class OpenAIServer:
    """Request handling, separate from route wiring so each piece stays small."""

    def __init__(self, client: EngineClient, settings: ServerSettings) -> None:
        self.client = client
        self.settings = settings
        self.metrics = ServerMetrics(settings.served_model_name)
        self.admission = AdmissionController(settings.admission, client.info.num_blocks * client.info.block_size)
        self.prompts = PromptEncoder(client.tokenizer, client.info.max_model_len)
        self.images = ImageDecoder(settings.images)
        vision = client.info.vision
        self.placeholders = None if vision is None else Placeholders(
            vision, partial(client.tokenizer.encode, add_special_tokens=False))
        self.kv_sessions = KVSessions(client, self.prompts, settings.kv_session_secret)
        self.tool_schemas = ToolSchemaCheck()
        self.grammars = GrammarCheck(client.tokenizer, client.info.vocab_size, client.info.eos_token_ids)
        self.output_budget = OutputBudget(
            settings.max_request_output_tokens or default_max_output_units(settings.max_n, client.info.max_model_len),
            client.info.max_model_len)
        self.generation_defaults = settings.generation_defaults.overrides()
        # NOTE: a --generation-config PATH may name EOS ids the workers (which read the model's own files) do
        # not know: they stop a request as stop tokens, unless it asks to ignore EOS.
        self.extra_eos = [t for t in settings.generation_defaults.eos_token_ids
                          if t not in client.info.eos_token_ids and 0 <= t < client.info.vocab_size]
        self.chat_template = inspect_chat_template(client.tokenizer.hf.chat_template)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise ApiError(404, f"The model {model[:100]!r} does not exist; this server serves "
                                f"`{self.settings.served_model_name}`", "NotFoundError", "model")

    def check_priority(self, priority: int) -> None:
        limit = self.settings.priority_range
        if limit == 0 and priority != 0:
            raise ApiError(400, f"this server takes no client priorities (got {priority}): without an API key any "
                                f"client could jump the queue; its operator may allow them with "
                                f"--max-priority-range N (or set --api-key)", "BadRequestError", "priority")
        if abs(priority) > limit:
            raise ApiError(400, f"priority must be in [-{limit}, {limit}] on this server (--max-priority-range), "
                                f"got {priority}", "BadRequestError", "priority")

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        params = req.sampling_params(self.generation_defaults)
        if self.extra_eos and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + [
                t for t in self.extra_eos if t not in params.stop_token_ids])
        if params.n > self.settings.max_n:
            raise ApiError(400, f"n must be at most {self.settings.max_n} on this server (--max-n), got {params.n}",
                           "BadRequestError", "n")
        return params

    async def handle(self, req: CompletionRequest | ChatCompletionRequest, raw: Request) -> Response:
        hold = ImageHold(self.images)  # the request's decoded images, held until it ends (released on every path)
        try:
            return await self._handle(req, raw, hold)
        except BaseException:
            hold.release()
            raise

    async def _handle(self, req: CompletionRequest | ChatCompletionRequest, raw: Request, hold: ImageHold,
                      ) -> Response:
        self.check_model(req.model)
        self.check_priority(req.priority)
        params = self.sampling_params(req)  # cheap checks first: the prompt's costly ones come after
        if params.structured_output is not None:
            await self.grammars.check(params.structured_output,
                                      "structured_outputs" if req.structured_outputs else "response_format")
        echo: list[str] | None = None
        tool_calling: ToolCalling | None = None
        images: list[DecodedImage] = []
        if isinstance(req, CompletionRequest):
            kind, top_n = "completion", req.logprobs
            prompts = [await self.prompts.completion(p) for p in req.prompt]
        else:
            kind, top_n = "chat", req.top_logprobs
            if req.tools:
                await self.tool_schemas.check(req.tools)
            try:
                tool_calling, rendered = plan_tool_calling(req.plain_messages(), req.tools,
                                                           req.resolved_tool_choice(), req.parallel_tool_calls,
                                                           self.chat_template)
            except ValueError as exc:
                raise ApiError(400, str(exc), "BadRequestError", "messages") from None
            if tool_calling is not None and tool_calling.forced:
                if params.structured_output is not None:
                    raise ApiError(400, "tool_choice 'required' or a named function already fixes the output's "
                                        "format: give no response_format or structured_outputs with it",
                                   "BadRequestError", "tool_choice")
                spec = tool_calling.structured_output()
                if spec is not None:
                    await self.grammars.check(spec, "tools")
                    params = dataclasses.replace(params, structured_output=spec)
            images = await self._images(req.image_urls(), hold)  # before the template: the cheaper refusals first
            prompts = [await self.prompts.chat(rendered.messages, tools=rendered.tools)]
            if images:
                prompts = [(text, self._with_placeholders(ids, images)) for text, ids in prompts]
        for _, token_ids in prompts:
            try:
                self.client.validate(token_ids, dataclasses.replace(params, n=1), req.priority)
            except InvalidRequestError as exc:
                param = "messages" if kind == "chat" and exc.param == "prompt" else exc.param
                raise ApiError(400, str(exc), "BadRequestError", param) from exc
        self.output_budget.check([len(ids) for _, ids in prompts], params,
                                 "logprobs" if kind == "completion" else "top_logprobs")
        if isinstance(req, CompletionRequest) and req.echo:  # after the check: the token ids are in the vocabulary
            echo = [text if text is not None else await self.prompts.decode(ids) for text, ids in prompts]
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:20]}"
        choices = list(request_choices(request_id, prompts, params))
        # NOTE: before the response starts: a stream refused later could only say so in an error event
        refusal = self.client.encode_refusal(len(images) * len(choices)) if images else None
        if refusal is not None:
            self.metrics.rejected.labels(self.settings.served_model_name).inc()
            hold.release()
            return HttpError(503, refusal, "ServiceUnavailableError").response(
                headers={"Retry-After": str(self.settings.retry_after_s)})
        for i, choice in enumerate(choices):
            refusal = self.admission.try_admit(choice.request_id, len(choice.token_ids))
            if refusal is not None:
                for admitted in choices[:i]:
                    self.admission.started(admitted.request_id)
                self.metrics.rejected.labels(self.settings.served_model_name).inc()
                hold.release()
                return HttpError(503, refusal, "ServiceUnavailableError").response(
                    headers={"Retry-After": str(self.settings.retry_after_s)})

        def release() -> None:  # every choice's entry, on every path: a choice that never started included
            for c in choices:
                self.admission.started(c.request_id)
            hold.release()

        try:
            builder = ResponseBuilder(kind, request_id, self.settings.served_model_name, top_n,
                                      echo=None if echo is None else [echo[c.index // params.n] for c in choices],
                                      n=params.n)
            pixels = [ImagePixels(im.digest, im.width, im.height, im.rgb) for im in images]
            streams = {c.index: self._outputs(c.request_id, c.prompt, c.token_ids, c.params, req.priority, pixels)
                       for c in choices}
            if req.stream:
                return ClosingStreamingResponse(self._stream(streams, builder, kind, req.include_usage, tool_calling),
                                                on_close=release, media_type="text/event-stream")
        except BaseException:
            release()
            raise
        try:
            return await self._whole(streams, builder, raw, tool_calling)
        finally:
            release()

    async def _images(self, urls: list[str], hold: ImageHold) -> list[DecodedImage]:
        """A chat's images, decoded off the loop; ApiError naming why one is refused."""
        if not urls:
            return []
        if self.client.info.vision is None:
            raise ApiError(400, f"the model {self.settings.served_model_name!r} does not take images",
                           "BadRequestError", "messages")
        return await decoded_images(self.images, urls, hold)

    def _with_placeholders(self, token_ids: list[int], images: list[DecodedImage]) -> list[int]:
        assert self.placeholders is not None, "checked by _images"
        try:
            return self.placeholders.expand(token_ids, [(im.width, im.height) for im in images])
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), "BadRequestError", "messages") from None

    async def _outputs(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                       priority: int, images: list[ImagePixels]) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs with metrics and admission bookkeeping attached."""
        last = None
        try:
            async for out in self.client.generate(request_id, prompt, token_ids, params, priority, images):
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

    async def _stream(self, streams: dict[int, AsyncGenerator[RequestOutput, None]], builder: ResponseBuilder,
                      kind: str, include_usage: bool, tool_calling: ToolCalling | None = None,
                      ) -> AsyncGenerator[str, None]:
        last: dict[int, RequestOutput] = {}
        parsers = {index: tool_calling.stream() for index in streams} if tool_calling is not None else {}
        try:
            if kind == "chat":
                for index in streams:
                    yield sse(builder.role_chunk(index))
            # NOTE: aclosing: closed with this body (the client gone), `merged` aborts the choices now, not when
            # the garbage collector finalizes it
            async with contextlib.aclosing(merged(streams)) as outputs:
                async for index, out in outputs:
                    last[index] = out
                    c = out.outputs[0]
                    if index in parsers:
                        for chunk in tool_chunks(builder, index, out, parsers[index], tool_calling):
                            yield sse(chunk)
                    elif c.delta_text or c.finish_reason or (c.logprobs and c.delta_token_ids):
                        yield sse(builder.chunk(index, out))
            if include_usage and last:
                yield sse(builder.usage_chunk(list(last.items())))
            yield sse("[DONE]")
        except Exception as exc:  # the 200 is sent: the error goes in the stream, which still ends properly
            for event in http_error(exc).events():
                yield event

    async def _whole(self, streams: dict[int, AsyncGenerator[RequestOutput, None]], builder: ResponseBuilder,
                     raw: Request, tool_calling: ToolCalling | None = None) -> Response:
        async def collect(outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput | None:
            last = None
            async for out in outputs:
                last = out
            return last

        tasks = {index: asyncio.create_task(collect(gen)) for index, gen in streams.items()}
        try:
            pending = set(tasks.values())
            while pending:
                done, pending = await asyncio.wait(pending, timeout=DISCONNECT_POLL_S,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                if any(t.exception() is not None for t in done):
                    break
                if pending and await raw.is_disconnected():
                    return Response(status_code=499)  # the finally cancels the rest, which aborts them
            outs: list[tuple[int, RequestOutput]] = []
            for index, task in tasks.items():
                out = task.result() if task.done() else None
                if out is None:  # the stream ended without an output: nothing to answer with
                    return HttpError(500, "the engine returned no output", "InternalServerError").response()
                outs.append((index, out))
        except Exception as exc:
            return http_error(exc).response()
        finally:
            for task in tasks.values():
                task.cancel()  # closes a generator still running, which aborts its request in the core
        messages = None if tool_calling is None else {
            index: tool_calling.message(out.outputs[0].text, out.outputs[0].finish_reason) for index, out in outs}
        if builder.body_entries(outs) < RENDER_OFF_LOOP_ENTRIES:
            return JSONResponse(builder.full(outs, messages))
        # NOTE: a body of many logprobs takes seconds to render and serialize: in a thread, the loop keeps serving
        # (it still shares the GIL, but gets it back every switch interval instead of waiting out the build)
        return await asyncio.to_thread(lambda: JSONResponse(builder.full(outs, messages)))


def build_app(client: EngineClient, settings: ServerSettings) -> FastAPI:
    server = OpenAIServer(client, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await server.kv_sessions.close()
        server.prompts.close()
        await server.images.aclose()
        server.grammars.close()
        server.tool_schemas.close()

    app = FastAPI(title="kvbaton", docs_url=None, redoc_url=None, lifespan=lifespan)
    admin = AdminAccess(bind_host=settings.bind_host, admin_api_key=settings.admin_api_key, api_key=settings.api_key)
    app.state.server = server
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes,
                       path_limits={"/admin/kv/restore": (settings.max_kv_session_bytes, "--max-kv-session-bytes")})
    app.add_middleware(AccessCheck, admin=admin, api_key=settings.api_key)  # last, so outermost: before the body
    add_error_handlers(app)

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
            return HttpError(503, client.dead_reason or "no engine is running", "ServiceUnavailableError").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(raw: Request) -> Response:
        server.metrics.observe_stats(client.stats)  # on scrape: the pool sums its workers' loads when asked
        body = generate_latest(server.metrics.registry)
        if admin.refusal(raw.headers) is None:  # the per-expert series: for those who may read GET /experts
            server.metrics.observe_experts(client.expert_view())  # on scrape: a MoE pool's load is layers x experts
            body += generate_latest(server.metrics.expert_registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        s = client.stats
        try:  # the first engine's; each worker's own is in GET /workers
            compute_path = client.info.compute_path
        except EngineError:  # no engine has come up yet
            compute_path = None
        return {"num_running": s.num_running, "num_waiting": s.num_waiting, "kv_cache_usage": s.kv_cache_usage,
                "prefix_cache_hit_rate": s.prefix_cache_hit_rate, "num_preemptions": s.num_preemptions,
                "prefix_cache_queried_tokens": s.prefix_cache_queried_tokens,
                "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
                "kv_store_hit_tokens": s.kv_store_hit_tokens,
                "kv_store": [dataclasses.asdict(t) for t in s.kv_store],
                "num_in_flight": client.num_in_flight, "num_pending_admission": server.admission.num_pending,
                "compute_path": compute_path, "router": dict(client.counters)}

    add_worker_routes(app, client, settings.max_workers)
    add_diagnostic_routes(app, client)
    add_kv_session_routes(app, server.kv_sessions)
    add_tokenize_routes(app, Tokenization(server.prompts, server.check_model, server.placeholders, server.images),
                        settings.api_key)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error, wherever raised, answered as an OpenAI-style error body (`errors.http_error`)."""

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", "")
            return HttpError(400, f"invalid JSON: {reason}", "BadRequestError").response()
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return HttpError(400, f"{param}: {msg}" if param else msg, "BadRequestError", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_exception(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "BadRequestError")
        return HttpError(exc.status_code, str(exc.detail), err_type).response(headers=dict(exc.headers or {}))

    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        return http_error(exc).response()

    # NOTE: the known kinds by name: a handler for `Exception` alone runs outside the app, after the
    # exception was already reported as unhandled.
    for kind in (ApiError, InvalidRequestError, ConfigError, EngineError, Exception):
        app.add_exception_handler(kind, on_error)
