"""A small OpenAI-compatible streaming server on 127.0.0.1, run in a background thread.

It streams `max_tokens` chunks ("w0 ", "w1 ", ...) the way vLLM does (a role-only first chunk
on chat, a finish chunk, a usage chunk, `[DONE]`). A request body may carry a `fake` object
to misbehave on purpose:
    {"fake": {"reject": true}}        -> HTTP 429
    {"fake": {"fail": true}}          -> HTTP 500
    {"fake": {"drop_after": 3}}       -> connection cut after 3 tokens
    {"fake": {"no_usage": true}}      -> no usage chunk
    {"fake": {"delay_s": 0.05}}       -> per-token delay
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.support.wait import wait_until

MODEL = "fake-model"


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _chunk(chat: bool, text: str | None, finish: str | None = None) -> dict:
    choice = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {"role": "assistant", "content": ""} if text is None else {"content": text}
    else:
        choice["text"] = text or ""
    return {"id": "x", "model": MODEL, "choices": [choice]}


class FakeOpenAIServer:
    def __init__(self, token_delay_s: float = 0.001, keepalive_s: float = 5.0) -> None:
        self.token_delay_s = token_delay_s
        self.keepalive_s = keepalive_s
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI()
        app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        app.get("/health")(lambda: {"ok": True})
        app.post("/v1/completions")(self._handler(chat=False))
        app.post("/v1/chat/completions")(self._handler(chat=True))
        return app

    def _handler(self, chat: bool):
        async def handle(request: Request):
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            fake = body.get("fake", {})
            if fake.get("reject"):
                return JSONResponse({"error": {"message": "busy"}}, status_code=429)
            if fake.get("fail"):
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            return StreamingResponse(self._stream(body, chat, fake), media_type="text/event-stream")

        return handle

    async def _stream(self, body: dict, chat: bool, fake: dict):
        n = body["max_tokens"]
        if chat:
            yield _sse(_chunk(chat, None))
        for i in range(n):
            # the fake server's simulated per-token latency: pacing the stream is the behaviour under test
            await asyncio.sleep(fake.get("delay_s", self.token_delay_s))  # noqa: TID251 - simulated latency
            if i == fake.get("drop_after"):
                raise RuntimeError("fake server drops the connection")
            yield _sse(_chunk(chat, f"w{i} "))
        yield _sse(_chunk(chat, "", finish="length"))
        if not fake.get("no_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
            yield _sse({"id": "x", "model": MODEL, "choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    def __enter__(self) -> FakeOpenAIServer:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="critical", timeout_keep_alive=self.keepalive_s)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started, 10.0, interval_s=0.01, message="fake server did not start")
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
