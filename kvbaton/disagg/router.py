"""The router: the frontend's handle on a pool of prefill and decode workers.

It offers the server the same interface as a single engine client (`generate`, `abort`,
`validate`, `info`, `stats`, ...), and behind it, per request:

    long prompt:   decode worker  <- PrepareReceive   (reserve blocks, report its prefix hit)
                   prefill worker <- AddRequest(remote_decode=...)   (prompt only; KV goes to D
                                     layer by layer; first token streams to the client at once)
                   decode worker  <- StartDecode(first token)        (decodes once the KV is in)
    short prompt, or a large decode-side hit, or no prefill pool:
                   decode worker  <- AddRequest                      (prefilled locally)

Failures never lose a request: a worker that stops heartbeating (or whose process exits) is
dropped and each of its requests starts a new attempt elsewhere from prompt + the tokens the
client already has; a transfer that fails or times out falls back to a local prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import zmq
import zmq.asyncio

from kvbaton.config import EngineConfig
from kvbaton.disagg.flight import Flight, Phase
from kvbaton.disagg.messages import (
    AbortRequests,
    AddRequest,
    CancelReceive,
    CheckIntegrity,
    Drain,
    Drained,
    FromWorker,
    Heartbeat,
    IntegrityReport,
    PrepareReceive,
    ReceiveReady,
    ReceiveRefused,
    RequestFailed,
    Shutdown,
    StartDecode,
    ToWorker,
    TransferFailed,
    WorkerHello,
    WorkerLoad,
    WorkerOutputs,
)
from kvbaton.disagg.policies import make_policy
from kvbaton.disagg.spec import ConnectorSpec, WorkerSpec
from kvbaton.engine.errors import EngineDeadError
from kvbaton.engine.info import EngineInfo, EngineStats, validate_request
from kvbaton.engine.output_processor import OutputProcessor
from kvbaton.engine.outputs import EngineCoreOutput, RemoteDecode
from kvbaton.engine.request_output import RequestOutput
from kvbaton.engine.sampling_params import InvalidRequestError, SamplingParams
from kvbaton.engine.streams import stream_outputs
from kvbaton.engine.tokenizer import Tokenizer
from kvbaton.kv.layout import KVLayout
from kvbaton.wire import MAX_CONTROL_FRAME_BYTES, SignedCodec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    prefill_policy: str = "least_loaded"  # see kvbaton.disagg.policies.POLICIES
    decode_policy: str = "least_loaded"
    # Prompts with fewer uncached tokens than this are prefilled on the decode worker itself.
    local_prefill_threshold: int = 64
    transfer_deadline_s: float = 30.0
    heartbeat_s: float = 0.5
    dead_after_s: float = 5.0  # no heartbeat for this long: the worker is gone
    start_timeout_s: float = 600.0


@dataclass
class WorkerHandle:
    name: str
    role: str
    index: int
    pid: int
    address: str
    info: EngineInfo
    layout: KVLayout
    receiver: str | None
    load: WorkerLoad
    socket: zmq.asyncio.Socket
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    draining: bool = False
    attempts: set[str] = field(default_factory=set)  # attempt ids it works on

    @property
    def load_score(self) -> float:
        s = self.load.stats
        return s.num_running + s.num_waiting + self.load.num_receiving + len(self.attempts) + s.kv_cache_usage

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "both")

    def view(self) -> dict:
        s = self.load.stats
        return {"name": self.name, "role": self.role, "index": self.index, "pid": self.pid, "address": self.address,
                "healthy": self.alive, "draining": self.draining, "num_running": s.num_running,
                "num_waiting": s.num_waiting, "num_receiving": self.load.num_receiving,
                "num_sending": self.load.num_sending, "kv_cache_usage": s.kv_cache_usage,
                "in_flight": len(self.attempts)}


class Router:
    def __init__(self, engine: EngineConfig, tokenizer: Tokenizer, launcher, secret: bytes,
                 config: RouterConfig = RouterConfig(), connector: ConnectorSpec | None = None,
                 host: str = "127.0.0.1") -> None:
        self.engine_config, self.tokenizer, self.launcher, self.config = engine, tokenizer, launcher, config
        self.connector, self.host = connector or ConnectorSpec(), host
        self.outputs = OutputProcessor(tokenizer)
        self.workers: dict[str, WorkerHandle] = {}
        self.flights: dict[str, Flight] = {}
        self.info: EngineInfo | None = None
        self.stats = EngineStats()
        self.dead_reason: str | None = None
        self._codec_out = SignedCodec(secret, ToWorker)
        self._codec_in = SignedCodec(secret, FromWorker)
        self._ctx = zmq.asyncio.Context()
        self._next_index = {"prefill": 0, "decode": 0, "both": 0}
        self._prefill_policy = make_policy(config.prefill_policy, engine.cache.block_size)
        self._decode_policy = make_policy(config.decode_policy, engine.cache.block_size)
        self._stats_listeners: list = []
        self._tasks: list[asyncio.Task] = []
        self._hello: asyncio.Event = asyncio.Event()
        self._integrity: dict[str, asyncio.Future] = {}
        # How requests went: through a prefill worker, prefilled on the decode worker, or
        # re-dispatched after a failure (a transfer, or a worker, that did not make it).
        self.counters = {"disaggregated": 0, "local": 0, "fallbacks": 0, "workers_lost": 0}

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self, num_prefill: int, num_decode: int) -> None:
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_FRAME_BYTES)
        port = self._events.bind_to_random_port(f"tcp://{self.host}")
        self.address = f"tcp://{self.host}:{port}"
        self._tasks = [asyncio.create_task(self._event_loop()), asyncio.create_task(self._watchdog())]
        decode_role = "decode" if num_prefill else "both"
        names = [await self.add_worker("prefill") for _ in range(num_prefill)]
        names += [await self.add_worker(decode_role) for _ in range(num_decode)]
        await self.wait_for_workers(names, self.config.start_timeout_s)

    async def add_worker(self, role: str) -> str:
        """Start one more worker in `role`; it joins the pool when it says hello."""
        spec = WorkerSpec(role, self._next_index[role], self.engine_config, self.address, self.host,
                          self.connector, self.config.heartbeat_s)
        self._next_index[role] += 1
        # NOTE: off the event loop: a Ray launch waits for its placement group.
        await asyncio.to_thread(self.launcher.launch, spec)
        return spec.name

    async def wait_for_workers(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(n in self.workers for n in names):
            dead = [n for n in names if n not in self.workers and not self.launcher.is_alive(n)]
            if dead:
                raise EngineDeadError(f"worker(s) {', '.join(dead)} exited during start-up")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"workers not ready after {timeout_s:.0f} s")
            self._hello.clear()
            try:
                await asyncio.wait_for(self._hello.wait(), 0.5)
            except TimeoutError:
                pass

    async def drain_worker(self, name: str) -> None:
        """Stop routing to `name`; it shuts down once its requests are done (`Drained`)."""
        worker = self.workers.get(name)
        if worker is None or not worker.alive:
            raise KeyError(name)
        if not any(w.alive and not w.draining and w.role == worker.role and w is not worker
                   for w in self.workers.values()):
            raise ValueError(f"{name} is the last {worker.role} worker; add another before draining it")
        worker.draining = True
        await self._send(worker, Drain())

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        for task in self._tasks:
            task.cancel()
        for worker in self.workers.values():
            if worker.alive:
                await self._send(worker, Shutdown())
        await asyncio.to_thread(self.launcher.stop_all, timeout_s)
        for worker in self.workers.values():
            worker.socket.close(linger=0)
        self._events.close(linger=0)
        self._ctx.term()

    @property
    def is_alive(self) -> bool:
        return any(w.alive and w.can_decode for w in self.workers.values())

    def workers_view(self) -> list[dict]:
        return [w.view() for w in self.workers.values()]

    async def check_workers(self, timeout_s: float = 10.0) -> dict[str, IntegrityReport]:
        """Every live worker's KV integrity report (for tests and operators)."""
        loop = asyncio.get_running_loop()
        live = [w for w in self.workers.values() if w.alive]
        futures = {w.name: self._integrity.setdefault(w.name, loop.create_future()) for w in live}
        for worker in live:
            await self._send(worker, CheckIntegrity())
        try:
            done = await asyncio.wait_for(asyncio.gather(*futures.values()), timeout_s)
        finally:
            for name in futures:
                self._integrity.pop(name, None)
        return dict(zip(futures, done))

    # ---- the engine-client interface -------------------------------------------------------

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        validate_request(self.info, token_ids, params)

    async def generate(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "no decode worker is running")
        self.validate(token_ids, params)
        flight = Flight(request_id, token_ids, params, priority, asyncio.Queue())
        self.flights[request_id] = flight
        self.outputs.add_request(request_id, prompt, token_ids, params, time.monotonic())
        try:
            await self._dispatch(flight)
            # NOTE: aclosing: if our consumer stops early, the inner stream must run its abort now.
            async with contextlib.aclosing(stream_outputs(flight.queue, lambda: self.abort(request_id))) as stream:
                async for out in stream:
                    yield out
        finally:
            self.flights.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self.outputs.abort(request_id)
        flight = self.flights.pop(request_id, None)
        if flight is not None:
            await self._stop_attempt(flight, "abort")

    @property
    def num_in_flight(self) -> int:
        return len(self.flights)

    def add_stats_listener(self, callback) -> None:
        self._stats_listeners.append(callback)

    # ---- dispatch --------------------------------------------------------------------------

    def _pool(self, role: str) -> list[WorkerHandle]:
        return [w for w in self.workers.values()
                if w.alive and not w.draining and (w.role == role or (role == "decode" and w.role == "both"))]

    async def _dispatch(self, flight: Flight) -> None:
        """Start the flight's current attempt: disaggregated if it pays, else locally on a decode worker."""
        decoders = self._pool("decode")
        if not decoders:
            self._fail(flight, EngineDeadError("no decode worker is running"))
            return
        prompt, _ = flight.continuation()
        decode = self._decode_policy.pick(decoders, prompt)
        self._decode_policy.note_routed(decode.name, prompt)
        flight.decode = decode.name
        decode.attempts.add(flight.attempt_id)
        if self._pool("prefill") and len(prompt) >= self.config.local_prefill_threshold and not flight.tokens:
            flight.phase = Phase.PREPARING
            await self._send(decode, PrepareReceive(flight.attempt_id, prompt, flight.params, flight.priority,
                                                    self.config.transfer_deadline_s))
        else:
            await self._run_locally(flight, decode)

    async def _run_locally(self, flight: Flight, decode: WorkerHandle) -> None:
        self.counters["local"] += 1
        prompt, params = flight.continuation()
        flight.phase = Phase.DECODING
        await self._send(decode, AddRequest(flight.attempt_id, prompt, params, flight.priority))

    async def _on_receive_ready(self, flight: Flight, msg: ReceiveReady) -> None:
        decode = self.workers.get(flight.decode)
        if decode is None:
            return  # it died meanwhile; its death re-dispatches this flight
        uncached = len(flight.prompt_token_ids) - msg.num_cached_tokens
        prefillers = self._pool("prefill")
        if uncached < self.config.local_prefill_threshold or not prefillers:
            # NOTE: the decode worker already holds most of this prompt: prefilling there is cheaper than a transfer.
            await self._send(decode, CancelReceive([flight.attempt_id]))
            await self._run_locally(flight, decode)
            return
        self.counters["disaggregated"] += 1
        prefill = self._prefill_policy.pick(prefillers, flight.prompt_token_ids)
        self._prefill_policy.note_routed(prefill.name, flight.prompt_token_ids)
        flight.prefill, flight.phase = prefill.name, Phase.PREFILLING
        prefill.attempts.add(flight.attempt_id)
        remote = RemoteDecode(decode.receiver, msg.dst_block_ids, msg.num_cached_tokens // decode.info.block_size,
                              decode.layout, self.config.transfer_deadline_s)
        await self._send(prefill, AddRequest(flight.attempt_id, flight.prompt_token_ids, flight.params,
                                             flight.priority, remote))

    async def _fall_back(self, flight: Flight, reason: str) -> None:
        """The transfer path failed: the decode worker prefills this attempt itself."""
        logger.warning("request %s: %s; prefilling on the decode worker instead", flight.request_id, reason)
        self.counters["fallbacks"] += 1
        decode = self.workers.get(flight.decode)
        if flight.prefill in self.workers:
            prefill = self.workers[flight.prefill]
            prefill.attempts.discard(flight.attempt_id)
            if prefill.alive:
                await self._send(prefill, AbortRequests([flight.attempt_id]))
        if decode is not None and decode.alive:
            await self._send(decode, CancelReceive([flight.attempt_id]))
        await self._retry(flight)

    async def _retry(self, flight: Flight) -> None:
        """A new attempt from prompt + the tokens the client already has."""
        for name in (flight.prefill, flight.decode):
            if name in self.workers:
                self.workers[name].attempts.discard(flight.attempt_id)
        flight.next_attempt()
        await self._dispatch(flight)

    async def _stop_attempt(self, flight: Flight, reason: str) -> None:
        for name in (flight.prefill, flight.decode):
            worker = self.workers.get(name)
            if worker is None:
                continue
            worker.attempts.discard(flight.attempt_id)
            if worker.alive:
                await self._send(worker, AbortRequests([flight.attempt_id], reason=reason))

    # ---- worker events ---------------------------------------------------------------------

    async def _event_loop(self) -> None:
        while True:
            frame = await self._events.recv(copy=False)
            msg = self._codec_in.try_decode(frame.buffer, "router")
            if msg is None:
                continue
            try:
                await self._on_event(msg)
            except Exception:  # one bad event must not stop routing for everyone
                logger.exception("router: failed to handle %s", type(msg).__name__)

    async def _on_event(self, msg) -> None:
        if isinstance(msg, WorkerHello):
            await self._register(msg)
            return
        worker = self.workers.get(msg.name)
        if worker is None or not worker.alive:
            return  # a worker declared dead: whatever it still says is ignored
        worker.last_seen = time.monotonic()
        if isinstance(msg, (Heartbeat, WorkerOutputs)):
            worker.load = msg.load
            self._publish_stats()
        if isinstance(msg, Heartbeat):
            return
        if isinstance(msg, IntegrityReport):
            future = self._integrity.get(msg.name)
            if future is not None and not future.done():
                future.set_result(msg)
            return
        if isinstance(msg, WorkerOutputs):
            for output in msg.outputs:
                await self._on_output(worker, output)
        elif isinstance(msg, Drained):
            await self._retire(worker)
        else:
            flight = self._flight_of(msg.request_id)
            if flight is None:
                if isinstance(msg, ReceiveReady):  # the client left meanwhile: give the blocks back
                    await self._send(worker, CancelReceive([msg.request_id]))
                return
            if isinstance(msg, ReceiveReady):
                await self._on_receive_ready(flight, msg)
            elif isinstance(msg, ReceiveRefused):
                await self._fall_back(flight, f"{worker.name} refused the transfer ({msg.reason})")
            elif isinstance(msg, TransferFailed):
                if flight.phase != Phase.DECODING or worker.name == flight.decode:
                    await self._fall_back(flight, f"KV transfer failed on {worker.name}: {msg.reason}")
            elif isinstance(msg, RequestFailed):
                self._fail(flight, InvalidRequestError(msg.message))

    def _flight_of(self, attempt_id: str) -> Flight | None:
        request_id, _, attempt = attempt_id.rpartition("#")
        flight = self.flights.get(request_id)
        if flight is None or str(flight.attempt) != attempt:
            return None  # finished, aborted, or an abandoned attempt
        return flight

    async def _on_output(self, worker: WorkerHandle, output: EngineCoreOutput) -> None:
        flight = self._flight_of(output.request_id)
        if flight is None:
            return
        if flight.num_cached_tokens is None:
            flight.num_cached_tokens = output.num_cached_tokens
        handed_off = output.finish_reason == "transfer"
        client_output = replace(output, request_id=flight.request_id, num_cached_tokens=flight.num_cached_tokens,
                                finish_reason=None if handed_off else output.finish_reason)
        flight.tokens.extend(output.new_token_ids)
        out, stop_string = self.outputs.process(client_output)
        # NOTE: to the client first: `flight.tokens` (what a re-dispatch continues from) and the
        # stream must never disagree, even if a send below meets a worker that just died.
        flight.queue.put_nowait(out)
        decode = self.workers.get(flight.decode)
        if handed_off:
            worker.attempts.discard(flight.attempt_id)
            flight.phase = Phase.DECODING
            if decode is not None:
                await self._send(decode, StartDecode(flight.attempt_id, output.new_token_ids[-1]))
        elif output.finish_reason is not None and flight.phase != Phase.DECODING and decode is not None:
            await self._send(decode, CancelReceive([flight.attempt_id]))  # ended at its first token
        if stop_string is not None and output.finish_reason is None:
            await self._stop_attempt(flight, "stop")
        elif out.finished:
            for name in (flight.prefill, flight.decode):
                if name in self.workers:
                    self.workers[name].attempts.discard(flight.attempt_id)

    def _fail(self, flight: Flight, exc: Exception) -> None:
        self.outputs.abort(flight.request_id)
        flight.queue.put_nowait(exc)

    async def _register(self, msg: WorkerHello) -> None:
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(msg.address)
        self.workers[msg.name] = WorkerHandle(msg.name, msg.role, msg.index, msg.pid, msg.address, msg.info,
                                              msg.layout, msg.receiver, msg.load, socket)
        if self.info is None:
            self.info = msg.info
        logger.info("%s joined (pid %d, %s)", msg.name, msg.pid, msg.address)
        self._publish_stats()
        self._hello.set()

    async def _retire(self, worker: WorkerHandle) -> None:
        await self._send(worker, Shutdown())
        worker.alive = False
        await asyncio.to_thread(self.launcher.stop, worker.name)
        self._forget(worker)
        logger.info("%s drained and stopped", worker.name)

    def _forget(self, worker: WorkerHandle) -> None:
        worker.socket.close(linger=0)
        del self.workers[worker.name]
        self._prefill_policy.forget_worker(worker.name)
        self._decode_policy.forget_worker(worker.name)
        self._publish_stats()

    # ---- failure detection -----------------------------------------------------------------

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(0.2, self.config.heartbeat_s))
            now = time.monotonic()
            for worker in list(self.workers.values()):
                if not worker.alive:
                    continue
                if not self.launcher.is_alive(worker.name):
                    await self._on_worker_dead(worker, "its process exited")
                elif now - worker.last_seen > self.config.dead_after_s:
                    await self._on_worker_dead(worker, f"no heartbeat for {now - worker.last_seen:.1f} s")

    async def _on_worker_dead(self, worker: WorkerHandle, reason: str) -> None:
        logger.error("%s is gone (%s); re-dispatching its %d request(s)", worker.name, reason, len(worker.attempts))
        worker.alive = False
        self.counters["workers_lost"] += 1
        # NOTE: fence it: a worker that was only stalled must not come back and act on old requests.
        await asyncio.to_thread(self.launcher.kill, worker.name)
        affected = [f for f in self.flights.values() if f.attempt_id in worker.attempts]
        self._forget(worker)
        for flight in affected:
            if worker.name == flight.prefill and flight.phase == Phase.DECODING:
                continue  # its part was done
            await self._fall_back(flight, f"{worker.name} died")
        if not self.is_alive:
            self.dead_reason = f"every decode worker is gone (last: {worker.name}, {reason})"

    # ---- plumbing --------------------------------------------------------------------------

    async def _send(self, worker: WorkerHandle, msg) -> None:
        await worker.socket.send(self._codec_out.encode(msg), copy=False)

    def _publish_stats(self) -> None:
        loads = [w.load.stats for w in self.workers.values() if w.alive and w.can_decode]
        if not loads:
            return
        self.stats = EngineStats.total(loads)
        for callback in self._stats_listeners:
            callback(self.stats)
