"""An engine core as its own process, driven over ZeroMQ (PULL inputs, PUSH outputs).

    python -m kvbaton.engine.core_proc --config-json '{...}' --inputs ipc://... --outputs ipc://...

The loop drains every pending input, runs one step if any request is unfinished, and
pushes that step's outputs with the current stats. When idle it blocks on the input socket,
so an idle worker costs no CPU.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import msgspec
import zmq

from kvbaton.config import EngineConfig, ModelConfig
from kvbaton.engine.core import EngineCore
from kvbaton.engine.messages import (
    MAX_MESSAGE_BYTES,
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
from kvbaton.engine.request import Request, RequestStatus
from kvbaton.engine.sampling_params import InvalidRequestError
from kvbaton.engine.tokenizer import Tokenizer, eos_token_ids
from kvbaton.models.registry import resolve_model

logger = logging.getLogger("kvbaton.engine_core")
IDLE_POLL_MS = 1000


class EngineCoreProc:
    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.to_core = Codec(ToCore)
        self.from_core = Codec(FromCore)
        self.running = True
        self._parent_pid = os.getppid()

    def run(self) -> None:
        self._send(CoreReady(self.core.info, os.getpid()))
        while self.running:
            if os.getppid() != self._parent_pid:
                logger.error("frontend process is gone; exiting")
                return
            busy = self.core.has_unfinished_requests()
            handled = self._drain_inputs(block_ms=0 if busy else IDLE_POLL_MS)
            if self.core.has_unfinished_requests():
                self._send(CoreOutputs(self.core.step(), self.core.stats()))
            elif handled:  # e.g. an abort while idle: let the frontend see the freed KV
                self._send(CoreOutputs([], self.core.stats()))

    def _drain_inputs(self, block_ms: int) -> bool:
        handled = False
        while self.inputs.poll(block_ms):
            block_ms = 0
            frame = self.inputs.recv(copy=False)
            try:
                msg = self.to_core.decode(frame.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("refused a malformed message (%d bytes): %s", len(frame.buffer), exc)
                continue
            self._handle(msg)
            handled = True
        return handled

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            req = Request(msg.request_id, msg.prompt_token_ids, msg.params, self.core.info.eos_token_ids,
                          msg.priority, msg.arrival_time or time.monotonic())
            try:
                self.core.add_request(req)
            except (InvalidRequestError, ValueError) as exc:
                self._send(CoreRequestError(msg.request_id, str(exc)))
        elif isinstance(msg, AbortRequests):
            status = RequestStatus.FINISHED_STOPPED if msg.reason == "stop" else RequestStatus.FINISHED_ABORTED
            self.core.abort_requests(msg.request_ids, status)
        elif isinstance(msg, Shutdown):
            self.running = False

    def _send(self, msg) -> None:
        self.outputs.send(self.from_core.encode(msg), copy=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="kvbaton engine core worker")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--outputs", required=True)
    parser.add_argument("--name", default="kvbaton-engine-0")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(levelname)s %(message)s")
    try:
        import setproctitle

        setproctitle.setproctitle(args.name)
    except ImportError:
        pass
    config = msgspec.json.decode(args.config_json.encode(), type=EngineConfig)
    model_dir = resolve_model(config.model)
    eos = eos_token_ids(ModelConfig.from_dir(model_dir), Tokenizer(model_dir))
    core = EngineCore(config, model_dir, eos)
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    inputs.connect(args.inputs)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(args.outputs)
    try:
        EngineCoreProc(core, inputs, outputs).run()
    finally:
        inputs.close(linger=0)
        outputs.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    main()
