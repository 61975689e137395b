"""The frontend's handle on an engine-core process: spawn it, feed it requests over
ZeroMQ, and fan its outputs back out to one asyncio queue per request.

Detokenization and stop strings run here, in the frontend, so the core never sees text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from kvbaton.config import EngineConfig
from kvbaton.engine.errors import EngineDeadError
from kvbaton.engine.info import EngineInfo, EngineStats, validate_request
from kvbaton.engine.messages import (
    AbortRequests,
    AddRequest,
    Codec,
    CoreOutputs,
    CoreReady,
    CoreRequestError,
    FromCore,
    Shutdown,
    ToCore,
)
from kvbaton.engine.output_processor import OutputProcessor
from kvbaton.engine.request_output import RequestOutput
from kvbaton.engine.sampling_params import InvalidRequestError, SamplingParams
from kvbaton.engine.streams import stream_outputs
from kvbaton.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, name: str = "kvbaton-engine-0") -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.name = name
        self.outputs = OutputProcessor(tokenizer)
        self.info: EngineInfo | None = None
        self.stats = EngineStats()
        self.proc: subprocess.Popen | None = None
        self.dead_reason: str | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._to_core = Codec(ToCore)
        self._from_core = Codec(FromCore)
        self._tmpdir = tempfile.TemporaryDirectory(prefix="kvbaton-ipc-")
        self._ctx = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task] = []
        self._stats_listeners: list = []

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self, timeout_s: float = 600.0) -> None:
        inputs_addr = f"ipc://{Path(self._tmpdir.name) / 'inputs'}"
        outputs_addr = f"ipc://{Path(self._tmpdir.name) / 'outputs'}"
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(inputs_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(outputs_addr)
        config_json = msgspec.json.encode(self.config).decode()
        cmd = [sys.executable, "-m", "kvbaton.engine.core_proc", "--config-json", config_json,
               "--inputs", inputs_addr, "--outputs", outputs_addr, "--name", self.name]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        await self._wait_ready(timeout_s)
        self._tasks = [asyncio.create_task(self._output_loop()), asyncio.create_task(self._watchdog())]

    async def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineDeadError(f"engine core exited during start-up (exit code {self.proc.returncode})")
            if await self._pull.poll(200):
                msg = self._from_core.decode(await self._pull.recv())
                if isinstance(msg, CoreReady):
                    self.info = msg.info
                    return
        raise EngineDeadError(f"engine core not ready after {timeout_s:.0f} s")

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        for task in self._tasks:
            task.cancel()
        if self.proc is not None and self.proc.poll() is None:
            await self._push.send(self._to_core.encode(Shutdown()))
            try:
                await asyncio.to_thread(self.proc.wait, timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        self._tmpdir.cleanup()

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self.proc is not None and self.proc.poll() is None

    # ---- requests ------------------------------------------------------------------------------

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        validate_request(self.info, token_ids, params)

    async def generate(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step; aborts it in the core if the consumer
        stops early (client gone, task cancelled)."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "engine core is not running")
        self.validate(token_ids, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        arrival = time.monotonic()
        self.outputs.add_request(request_id, prompt, token_ids, params, arrival)
        await self._push.send(self._to_core.encode(AddRequest(request_id, token_ids, params, priority, arrival)))
        try:
            # NOTE: aclosing: if our consumer stops early, the inner stream must run its abort now.
            async with contextlib.aclosing(stream_outputs(queue, lambda: self.abort(request_id))) as stream:
                async for out in stream:
                    yield out
        finally:
            self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self.outputs.abort(request_id)
        self._streams.pop(request_id, None)
        if self.is_alive:
            await self._push.send(self._to_core.encode(AbortRequests([request_id])))

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def add_stats_listener(self, callback) -> None:
        self._stats_listeners.append(callback)

    # ---- background tasks ----------------------------------------------------------------------

    async def _output_loop(self) -> None:
        while True:
            msg = self._from_core.decode(await self._pull.recv())
            if isinstance(msg, CoreOutputs):
                self.stats = msg.stats
                for callback in self._stats_listeners:
                    callback(msg.stats)
                for core_output in msg.outputs:
                    await self._route(core_output)
            elif isinstance(msg, CoreRequestError):
                self._fail(msg.request_id, InvalidRequestError(msg.message))

    async def _route(self, core_output) -> None:
        queue = self._streams.get(core_output.request_id)
        if queue is None:
            return  # aborted meanwhile
        out, stop_string = self.outputs.process(core_output)
        if stop_string is not None and core_output.finish_reason is None:
            await self._push.send(self._to_core.encode(AbortRequests([core_output.request_id], reason="stop")))
        queue.put_nowait(out)

    def _fail(self, request_id: str, exc: Exception) -> None:
        self.outputs.abort(request_id)
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(exc)

    async def _watchdog(self) -> None:
        while self.proc.poll() is None:
            await asyncio.sleep(0.5)
        self.dead_reason = f"engine core exited with code {self.proc.returncode}"
        logger.error(self.dead_reason)
        for request_id in list(self._streams):
            self._fail(request_id, EngineDeadError(self.dead_reason))
