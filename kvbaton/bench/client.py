"""One streamed request against an OpenAI-compatible endpoint, timed chunk by chunk.

NOTE: by default every request gets a fresh TCP connection (`Connection: close`, no pooled
keep-alive). Reusing keep-alive connections looks cheaper, but a server may close an idle
connection at the moment the client reuses it; vLLM's benchmark client lost 10-40% of its
requests against llama-server that way. A fresh connection costs well under a millisecond
on localhost and makes the completed count exact. With `--keepalive`, a request whose
connection dies before any response byte arrived is retried once on a new connection: the
server never answered it, so it cannot be counted twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TypedDict

import httpx

from kvbaton.client.sse import SSEDecoder, StreamEvent, asse_lines, parse_event
from kvbaton.workload.datasets import BenchRequest
from kvbaton.workload.errors import WorkloadError
from kvbaton.workload.records import REJECT_HTTP_STATUSES, RequestRecord

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
_STALE_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectError)


@dataclass(frozen=True)
class Target:
    """The server under test and how every request to it is built."""

    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    keepalive: bool = False
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 600.0  # the longest silence allowed while waiting for the next byte

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise WorkloadError(f"unsupported --endpoint {self.endpoint!r}; choose one of {', '.join(ENDPOINTS)}")
        if not self.base_url.startswith(("http://", "https://")):
            raise WorkloadError(f"--base-url must start with http:// or https://, got {self.base_url!r}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    def headers(self) -> dict[str, str]:
        headers = {} if self.keepalive else {"Connection": "close"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def payload(self, req: BenchRequest) -> dict:
        body: dict = {"model": self.model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.endpoint == "/v1/chat/completions":
            system = [{"role": "system", "content": req.system}] if req.system is not None else []
            body["messages"] = [*system, {"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.completion_text()
        if self.ignore_eos:
            body["ignore_eos"] = True
        return {**body, **self.extra_body}


def make_client(target: Target) -> httpx.AsyncClient:
    """An unbounded pool (open loop: the client must never queue requests itself)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None if target.keepalive else 0)
    # NOTE: trust_env=False so an HTTP(S)_PROXY in the environment cannot reroute or slow the traffic.
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(target.timeout_s, connect=30.0), trust_env=False)


def fetch_model_name(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at GET /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0, trust_env=False)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise WorkloadError(f"cannot ask {base_url}/v1/models for a model name ({exc}); pass --model") from exc


class _RecordBase(TypedDict):
    """The fields every record of one request starts from, however the request ends."""

    request_id: int
    prompt_len: int
    output_len: int
    scheduled_s: float
    send_s: float


class _StreamTimer:
    """Accumulates one response stream: first-chunk time, inter-chunk gaps, usage."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.ttft: float | None = None
        self.last = start
        self.itl: list[float] = []
        self.chunks = 0
        self.usage: dict | None = None
        self.finished = False
        self.error = ""
        self.end: float | None = None  # when [DONE] or an error event arrived

    def on_event(self, event: StreamEvent, now: float) -> bool:
        """Record one event; True once the stream has said all it will."""
        if event.error:
            self.error = event.error
            return True
        if event.text:
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                self.itl.append(now - self.last)
            self.last, self.chunks = now, self.chunks + 1
        self.usage = event.usage or self.usage
        self.finished = self.finished or event.done or event.finish_reason is not None
        return event.done


async def send_request(client: httpx.AsyncClient, target: Target, req: BenchRequest, run_start: float,
                       scheduled_s: float) -> RequestRecord:
    """Send `req`, stream its answer, and time it; never raises except on cancellation."""
    start = time.perf_counter()
    base = _RecordBase(request_id=req.request_id, prompt_len=req.prompt_len, output_len=req.output_len,
                       scheduled_s=scheduled_s, send_s=start - run_start)
    attempts = 0
    while True:
        attempts += 1
        timer = _StreamTimer(start)
        try:
            return await _stream_once(client, target, req, timer, base, attempts)
        except _NoResponseError as exc:
            if target.keepalive and attempts < 2:
                continue
            return RequestRecord(**base, status="error", error=_describe(exc.__cause__), attempts=attempts)
        except httpx.HTTPError as exc:
            return RequestRecord(**base, status="error", ttft_s=timer.ttft, error=_describe(exc), attempts=attempts)


class _NoResponseError(Exception):
    """The connection failed before the server sent a single response byte."""


async def _stream_once(client: httpx.AsyncClient, target: Target, req: BenchRequest, timer: _StreamTimer,
                       base: _RecordBase, attempts: int) -> RequestRecord:
    request = client.build_request("POST", target.url, json=target.payload(req), headers=target.headers())
    try:
        resp = await client.send(request, stream=True)
    except _STALE_CONNECTION_ERRORS as exc:
        raise _NoResponseError from exc
    try:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")[:300]
            status = "rejected" if resp.status_code in REJECT_HTTP_STATUSES else "error"
            return RequestRecord(**base, status=status, http_status=resp.status_code, error=body, attempts=attempts)
        await _read_stream(resp, timer)
    finally:
        await resp.aclose()
    return _finish(timer, req, base, attempts)


async def _read_stream(resp: httpx.Response, timer: _StreamTimer) -> None:
    decoder = SSEDecoder()
    async for line in asse_lines(resp.aiter_text()):
        data = decoder.feed(line)
        # NOTE: after [DONE] (or an error) read on to the end of the body rather than return:
        # a connection with unread bytes cannot go back to the keep-alive pool.
        if data is not None and timer.end is None and timer.on_event(parse_event(data), time.perf_counter()):
            timer.end = time.perf_counter()
    tail = decoder.flush()
    if tail is not None and timer.end is None:
        timer.on_event(parse_event(tail), time.perf_counter())


def _finish(timer: _StreamTimer, req: BenchRequest, base: _RecordBase, attempts: int) -> RequestRecord:
    e2e = (timer.end or time.perf_counter()) - timer.start
    usage = timer.usage or {}
    error = timer.error or ("" if timer.finished else "stream ended before a finish_reason or [DONE]")
    fields: _RecordBase = {**base, "prompt_len": usage.get("prompt_tokens") or req.prompt_len}
    return RequestRecord(**fields, status="error" if error else "ok", ttft_s=timer.ttft, e2e_s=e2e,
                         itl_s=tuple(timer.itl), output_tokens=usage.get("completion_tokens") or timer.chunks,
                         http_status=200, error=error, attempts=attempts)


def _describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"
