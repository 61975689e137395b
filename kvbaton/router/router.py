"""The router: the frontend's `EngineClient` over a pool of workers, for every deployment (colocated
is one worker of role `both`). Per request:

    images (E/P/D): encoder worker <- EncodeImages    (its embeddings come back; then as below, the
                                     embeddings instead of the pixels going to the prefill and decode workers)
    long prompt:   decode worker  <- PrepareReceive   (reserve blocks, report its prefix hit)
                   prefill worker <- AddRequest(remote_decode=...)   (prompt only; KV goes to D
                                     layer by layer; first token streams to the client at once)
                   decode worker  <- StartDecode(first token)        (decodes once the KV is in)
    short prompt, or a large decode-side hit, or no prefill pool:
                   decode worker  <- AddRequest                      (prefilled locally)

Failures never lose a request: a worker that stops heartbeating (or whose process exits) is
dropped by the pool and each of its requests starts a new attempt elsewhere from prompt + the
tokens the client already has; a transfer that fails or times out falls back to a local prefill; an encoder
worker that dies has the images encoded by another, or by the language worker when none is left.
Detokenization and stop strings run here, so workers never see text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from kvbaton.kv.store.session import StoreTarget
from kvbaton.messages.router_worker import (
    PROBE_REPLIES,
    AbortRequests,
    AddRequest,
    CancelReceive,
    EncodeImages,
    ImagePixels,
    ImagesEncoded,
    IntegrityReport,
    PrepareReceive,
    ReceiveReady,
    ReceiveRefused,
    RequestFailed,
    StartDecode,
    TransferFailed,
    WorkerOutputs,
)
from kvbaton.messages.worker_spec import WorkerRole
from kvbaton.mm.embedding_bound import embeddings_refusal
from kvbaton.mm.placeholders import image_spans
from kvbaton.router.diagnostics import PoolDiagnostics
from kvbaton.router.errors import EngineDeadError, EngineOverloadedError, RequestFailedError, RequestTimeoutError
from kvbaton.router.flight import Flight, Phase
from kvbaton.router.policies import make_policy
from kvbaton.router.streams import stream_outputs
from kvbaton.router.worker_pool import WorkerHandle, WorkerPool
from kvbaton.sched.info import EngineInfo, EngineStats, validate_request
from kvbaton.sched.outputs import EngineCoreOutput, FinishReason, RemoteDecode
from kvbaton.sched.sampling_params import InvalidRequestError, SamplingParams
from kvbaton.text.output_processor import OutputProcessor
from kvbaton.text.request_output import RequestOutput
from kvbaton.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
ENCODED_AT_ENTRIES = 4096  # images whose encoder worker the router remembers (to send them there again)


@dataclass(frozen=True)
class RouterConfig:
    prefill_policy: str = "least_loaded"  # see kvbaton.router.policies.POLICIES
    decode_policy: str = "least_loaded"
    # Prompts with fewer uncached tokens than this are prefilled on the decode worker itself.
    local_prefill_threshold: int = 64
    transfer_deadline_s: float = 30.0
    # An attempt that fails for what may be the request's own fault (a step raised on it, its worker died)
    # is tried again elsewhere; after this many such failures the client gets an error instead: a request
    # that crashes workers must not walk through the whole pool. Three, not two: in PD one request can
    # meet two unrelated deaths (its prefill worker's, then its decode worker's) and should survive them.
    max_failed_attempts: int = 3
    # A request with no output for this long (queued, stalled) is aborted with an error; 0: no limit.
    request_timeout_s: float = 600.0


class Router:
    def __init__(self, pool: WorkerPool, tokenizer: Tokenizer, config: RouterConfig = RouterConfig()) -> None:
        self.pool, self.tokenizer, self.config = pool, tokenizer, config
        pool.listener = self
        self.outputs = OutputProcessor(tokenizer)
        self.flights: dict[str, Flight] = {}
        self.dead_reason: str | None = None
        block_size = pool.engine_config.cache.block_size
        self._prefill_policy = make_policy(config.prefill_policy, block_size)
        self._decode_policy = make_policy(config.decode_policy, block_size)
        # How requests went: through a prefill worker, prefilled on the decode worker, or
        # re-dispatched after a failure (a transfer, or a worker, that did not make it); and how many were
        # aborted before their end (their consumer gone: a client that left, a request cancelled).
        self.counters = {"disaggregated": 0, "local": 0, "fallbacks": 0, "workers_lost": 0, "timeouts": 0,
                         "resumed": 0, "resumed_tokens_restored": 0, "resumed_tokens_recomputed": 0, "aborted": 0,
                         "encode_refused_images": 0}
        self._deadlines: asyncio.Task | None = None
        self._encoded_at: OrderedDict[str, str] = OrderedDict()  # image digest -> the encoder worker that encoded it
        # the probes behind /admin/diagnostics/* (`kvbaton doctor`)
        self.diagnostics = PoolDiagnostics(pool, self._routing_settings, self.counters)

    # ---- lifecycle and pool administration ---------------------------------------------------

    async def start(self, num_prefill: int, num_decode: int) -> None:
        await self.started(self.pool.start(num_prefill, num_decode))

    async def started(self, pool_start: Awaitable[None]) -> None:
        """Serve once `pool_start` is done: the pool's start, begun before this router was built (the workers
        load their model while the frontend loads its tokenizer)."""
        await pool_start
        if self.config.request_timeout_s > 0:
            self._deadlines = asyncio.create_task(self._enforce_deadlines())

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._deadlines is not None:
            self._deadlines.cancel()
        await self.pool.shutdown(timeout_s)

    async def add_worker(self, role: WorkerRole | str) -> str:
        """One more worker. A `decode` worker in a pool without prefill workers is a colocated replica."""
        role = WorkerRole(role)
        if role == WorkerRole.DECODE and not any(w.role == WorkerRole.PREFILL for w in self.pool.workers.values()):
            role = WorkerRole.BOTH
        return await self.pool.add_worker(role)

    async def wait_for_workers(self, names: list[str], timeout_s: float) -> None:
        await self.pool.wait_for_workers(names, timeout_s)

    async def drain_worker(self, name: str) -> None:
        await self.pool.drain_worker(name)

    def workers_view(self) -> list[dict[str, Any]]:
        return self.pool.view()

    def expert_view(self) -> dict[str, Any] | None:
        return self.pool.expert_view()

    def kv_store_target(self) -> StoreTarget | None:
        """The KV store the decode workers share (None without one, or before one has joined)."""
        engine = self.pool.engine_config
        layouts = [w.kv_layout for w in self.pool.workers.values() if w.role.decodes]
        if not engine.kv_store.enabled or not layouts:
            return None
        return StoreTarget(engine.kv_store, layouts[0], engine.model)

    async def check_workers(self, timeout_s: float = 10.0) -> dict[str, IntegrityReport]:
        return await self.pool.check_integrity(timeout_s)

    # ---- the engine-client interface -------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        if self.pool.info is None:
            raise EngineDeadError("no worker has joined yet")
        return self.pool.info

    @property
    def stats(self) -> EngineStats:
        return self.pool.stats

    @property
    def is_alive(self) -> bool:
        """False while no worker can decode (one may be restarting) or the pool is down for good;
        `dead_reason` then says why (the pool keeps it current, see `on_pool_health`)."""
        return self.pool.down_reason is None

    @property
    def num_in_flight(self) -> int:
        return len(self.flights)

    def validate(self, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        validate_request(self.info, token_ids, params, priority)
        vision = self.info.vision
        if vision is not None and self.pool.routable(WorkerRole.ENCODE):  # E/P/D: the embeddings will travel
            rows = sum(t == vision.image_token_id for t in token_ids)
            refusal = embeddings_refusal(rows * self.info.embedding_row_bytes) if rows else None
            if refusal is not None:
                raise InvalidRequestError(refusal, "messages")

    async def generate(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                       priority: int = 0, images: Sequence[ImagePixels] = ()) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs step by step; aborts it wherever it runs if the consumer
        stops early (client gone, task cancelled). `images`: those whose placeholders `token_ids` holds."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "no decode worker is running")
        self.validate(token_ids, params, priority)
        spans = image_spans(self.info.vision, token_ids, [im.digest for im in images],
                            [(im.width, im.height) for im in images])
        refusal = self.encode_refusal(len(images)) if images else None
        if refusal is not None:
            raise EngineOverloadedError(refusal)
        flight = Flight(request_id=request_id, prompt_token_ids=token_ids, params=params, priority=priority,
                        queue=asyncio.Queue(), images=tuple(images), image_spans=spans)
        self.flights[request_id] = flight
        self.outputs.add_request(request_id, prompt, token_ids, params, time.monotonic())
        try:
            try:
                await self._dispatch(flight)
            except Exception:
                # e.g. a frame that cannot be encoded: nothing of this request may stay behind
                await self.abort(request_id)
                raise
            # NOTE: aclosing: if our consumer stops early, the inner stream must run its abort now.
            async with contextlib.aclosing(stream_outputs(flight.queue, lambda: self.abort(request_id))) as stream:
                async for out in stream:
                    yield out
        finally:
            self.flights.pop(request_id, None)
            self.outputs.abort(request_id)  # a no-op once finished; else its detokenizer state would stay
            self._release(flight)

    async def abort(self, request_id: str) -> None:
        self.outputs.abort(request_id)
        flight = self.flights.pop(request_id, None)
        if flight is not None:
            self.counters["aborted"] += 1
            await self._stop_attempt(flight, FinishReason.ABORT)

    def set_local_prefill_threshold(self, tokens: int) -> None:
        """From now on, prompts with fewer uncached tokens prefill on their decode worker (the autoscaler's
        lever against prefill interference); requests already dispatched keep their route."""
        if tokens < 0:
            raise ValueError(f"the local-prefill threshold must be >= 0, got {tokens}")
        self.config = replace(self.config, local_prefill_threshold=tokens)

    def _routing_settings(self) -> dict[str, Any]:
        c = self.config
        return {"local_prefill_threshold": c.local_prefill_threshold, "prefill_policy": c.prefill_policy,
                "decode_policy": c.decode_policy, "transfer_deadline_s": c.transfer_deadline_s,
                "block_size": self.pool.engine_config.cache.block_size}

    # ---- dispatch --------------------------------------------------------------------------

    def encode_refusal(self, num_images: int) -> str | None:
        """E/P/D admission: why `num_images` more images cannot wait for the encoder pool now (past
        `PoolConfig.encode_queue` images per encoder worker), None if they can. A refusal counts as demand (the
        autoscaler's `encode_refused_images`). The server asks before a response starts (a stream's 503);
        `generate` asks again, and raises: a burst is refused, never silently dropped."""
        encoders = self.pool.routable(WorkerRole.ENCODE)
        if not encoders:
            return None  # --encode 0, or none left: the language workers encode (their admission is the server's)
        bound = self.pool.config.encode_queue * len(encoders)
        queued = sum(self.images_encoding().values())
        if queued + num_images <= bound:
            return None
        self.counters["encode_refused_images"] += num_images
        return (f"the encoder pool's queue is full ({queued} images waiting, at most {bound} for {len(encoders)} "
                "encoder worker(s)); retry later")

    def images_encoding(self) -> dict[str, int]:
        """Per encoder worker, the images of the requests it encodes now or has queued (what admission bounds)."""
        queued: dict[str, int] = {}
        for f in self.flights.values():
            if f.phase == Phase.ENCODING and f.encoder is not None:
                queued[f.encoder] = queued.get(f.encoder, 0) + len(f.images)
        return queued

    async def _dispatch(self, flight: Flight) -> None:
        """Start the flight's current attempt: its images to an encoder worker first (E/P/D) unless encoded
        already; then disaggregated if it pays, else locally on a decode worker."""
        if flight.images and not flight.embeddings:  # (none yet, or let go of once the prompt was computed)
            encoders = self.pool.routable(WorkerRole.ENCODE)
            if encoders:
                await self._encode(flight, encoders)
                return
        decoders = self.pool.routable(WorkerRole.DECODE)
        if not decoders:
            self._fail(flight, EngineDeadError(self.dead_reason or "no decode worker is running"))
            return
        prompt, _ = flight.continuation()
        salt = flight.params.cache_salt
        decode = self._decode_policy.pick(decoders, prompt, salt, flight.image_spans)
        self._decode_policy.note_routed(decode.name, prompt, salt, flight.image_spans)
        flight.decode = decode.name
        decode.attempts.add(flight.attempt_id)
        # NOTE: a request with images goes through a prefill worker only with their embeddings (E/P/D): the decode
        # worker takes them too (a preempted request computes its prompt again there); pixels alone (no encoder
        # pool) prefill where they decode, rather than have two workers encode them
        if (self.pool.routable(WorkerRole.PREFILL) and len(prompt) >= self.config.local_prefill_threshold
                and not flight.tokens and len(flight.embeddings) == len(flight.images)):
            flight.phase = Phase.PREPARING
            await self.pool.send(decode, PrepareReceive(
                request_id=flight.attempt_id, prompt_token_ids=prompt, params=flight.params, priority=flight.priority,
                deadline_s=self.config.transfer_deadline_s, embeddings=list(flight.embeddings)))
        else:
            await self._run_locally(flight, decode)

    async def _run_locally(self, flight: Flight, decode: WorkerHandle) -> None:
        self.counters["local"] += 1
        prompt, params = flight.continuation()
        flight.phase = Phase.DECODING
        await self.pool.send(decode, AddRequest(request_id=flight.attempt_id, prompt_token_ids=prompt, params=params,
                                                priority=flight.priority, **self._images_of(flight)))

    @staticmethod
    def _images_of(flight: Flight) -> dict[str, Any]:
        """What a language worker gets of the flight's images: their embeddings if encoded, else the pixels."""
        if flight.embeddings:
            return {"embeddings": list(flight.embeddings)}
        return {"images": list(flight.images)}

    async def _encode(self, flight: Flight, encoders: list[WorkerHandle]) -> None:
        """Send the flight's images to the encoder worker with the fewest queued, among those the one that
        encoded most of them already (its encoder cache holds them) when queues are equal."""
        digests = [im.digest for im in flight.images]
        queued = self.images_encoding()
        encoder = min(encoders, key=lambda w: (queued.get(w.name, 0), -sum(self._encoded_at.get(d) == w.name
                                                                            for d in digests)))
        flight.encoder, flight.phase = encoder.name, Phase.ENCODING
        encoder.attempts.add(flight.attempt_id)
        await self.pool.send(encoder, EncodeImages(request_id=flight.attempt_id, images=list(flight.images)))

    async def _on_images_encoded(self, flight: Flight, worker: WorkerHandle, msg: ImagesEncoded) -> None:
        if flight.phase != Phase.ENCODING or flight.encoder != worker.name:
            return
        worker.attempts.discard(flight.attempt_id)
        flight.encoder = None
        if [e.digest for e in msg.embeddings] != [im.digest for im in flight.images]:
            await self._charge_failure(flight, f"{worker.name} sent embeddings of other images")
            return
        flight.embeddings = tuple(msg.embeddings)
        flight.last_progress = time.monotonic()
        for e in msg.embeddings:
            self._encoded_at[e.digest] = worker.name
            self._encoded_at.move_to_end(e.digest)
        while len(self._encoded_at) > ENCODED_AT_ENTRIES:
            self._encoded_at.popitem(last=False)
        await self._dispatch(flight)

    async def _on_receive_ready(self, flight: Flight, msg: ReceiveReady) -> None:
        decode = self.pool.get(flight.decode)
        if decode is None:
            return  # it died meanwhile; its death re-dispatches this flight
        uncached = len(flight.prompt_token_ids) - msg.num_cached_tokens
        prefillers = self.pool.routable(WorkerRole.PREFILL)
        if uncached < self.config.local_prefill_threshold or not prefillers:
            # NOTE: the decode worker already holds most of this prompt: prefilling there is cheaper than a transfer.
            await self.pool.send(decode, CancelReceive([flight.attempt_id]))
            await self._run_locally(flight, decode)
            return
        self.counters["disaggregated"] += 1
        salt = flight.params.cache_salt
        prefill = self._prefill_policy.pick(prefillers, flight.prompt_token_ids, salt, flight.image_spans)
        self._prefill_policy.note_routed(prefill.name, flight.prompt_token_ids, salt, flight.image_spans)
        flight.prefill, flight.phase = prefill.name, Phase.PREFILLING
        prefill.attempts.add(flight.attempt_id)
        assert decode.receiver is not None, "a decode worker always has a KV receiver"
        skip_blocks = msg.num_cached_tokens // decode.engine_info.block_size
        remote = RemoteDecode(receiver=decode.receiver, dst_block_ids=msg.dst_block_ids, skip_blocks=skip_blocks,
                              layout=decode.kv_layout, deadline_s=self.config.transfer_deadline_s)
        await self.pool.send(prefill, AddRequest(request_id=flight.attempt_id, prompt_token_ids=flight.prompt_token_ids,
                                                 params=flight.params, priority=flight.priority, remote_decode=remote,
                                                 embeddings=list(flight.embeddings)))

    async def _fall_back(self, flight: Flight, reason: str) -> None:
        """The transfer path failed (the decode worker prefills this attempt itself), or its encoder worker did
        (another encodes its images, or the language worker)."""
        encoding = flight.phase == Phase.ENCODING
        then = "encoding its images again" if encoding else "prefilling on the decode worker instead"
        logger.warning("request %s: %s; %s", flight.request_id, reason, then)
        self.counters["fallbacks"] += 1
        prefill = self.pool.get(flight.prefill)
        if prefill is not None:
            prefill.attempts.discard(flight.attempt_id)
            if prefill.alive:
                await self.pool.send(prefill, AbortRequests([flight.attempt_id]))
        decode = self.pool.get(flight.decode)
        if decode is not None and decode.alive and decode.role == WorkerRole.DECODE:  # only it reserves receives
            await self.pool.send(decode, CancelReceive([flight.attempt_id]))
        await self._retry(flight)

    async def _retry(self, flight: Flight) -> None:
        """A new attempt from prompt + the tokens the client already has."""
        self._release(flight)
        flight.next_attempt()
        await self._dispatch(flight)

    async def _stop_attempt(self, flight: Flight, reason: FinishReason) -> None:
        for worker in self._release(flight):
            if worker.alive:
                await self.pool.send(worker, AbortRequests([flight.attempt_id], reason=reason))

    def _release(self, flight: Flight) -> list[WorkerHandle]:
        """The current attempt no longer counts towards its workers' load; returns those still in the pool."""
        workers = [w for w in map(self.pool.get, (flight.encoder, flight.prefill, flight.decode)) if w is not None]
        for worker in workers:
            worker.attempts.discard(flight.attempt_id)
        return workers

    # ---- what the pool tells us ------------------------------------------------------------------

    async def on_worker_message(self, worker: WorkerHandle, msg: msgspec.Struct) -> None:
        if isinstance(msg, WorkerOutputs):
            for output in msg.outputs:
                await self._on_output(worker, output)
            return
        if isinstance(msg, PROBE_REPLIES):
            self.diagnostics.on_reply(worker.name, msg)
            return
        assert isinstance(msg, (ReceiveReady, ReceiveRefused, TransferFailed, RequestFailed, ImagesEncoded))
        flight = self._flight_of(msg.request_id)
        if flight is None:
            if isinstance(msg, ReceiveReady):  # the client left meanwhile: give the blocks back
                await self.pool.send(worker, CancelReceive([msg.request_id]))
            return
        if isinstance(msg, ImagesEncoded):
            await self._on_images_encoded(flight, worker, msg)
        elif isinstance(msg, ReceiveReady):
            await self._on_receive_ready(flight, msg)
        elif isinstance(msg, ReceiveRefused):
            await self._fall_back(flight, f"{worker.name} refused the transfer ({msg.reason})")
        elif isinstance(msg, TransferFailed):
            if flight.phase != Phase.DECODING or worker.name == flight.decode:
                await self._fall_back(flight, f"KV transfer failed on {worker.name}: {msg.reason}")
        elif msg.in_step:
            await self._charge_failure(flight, f"{worker.name}: {msg.message}")
        else:
            # NOTE: the attempt's other worker may hold blocks for it (a decode reservation): free them too
            await self._stop_attempt(flight, FinishReason.ABORT)
            self._fail(flight, InvalidRequestError(msg.message))

    async def _charge_failure(self, flight: Flight, reason: str) -> None:
        """The attempt failed in a way the request itself may cause: try once more elsewhere, up to
        `max_failed_attempts`, then end it with an error."""
        flight.failures += 1
        if flight.failures < self.config.max_failed_attempts:
            await self._fall_back(flight, reason)
            return
        logger.error("request %s failed %d times, giving up: %s", flight.request_id, flight.failures, reason)
        await self._stop_attempt(flight, FinishReason.ABORT)
        self._fail(flight, RequestFailedError(f"the request failed on {flight.failures} attempts; last: {reason}"))

    async def _enforce_deadlines(self) -> None:
        """Abort requests that made no progress for `request_timeout_s`: nothing hangs forever."""
        timeout_s = self.config.request_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout_s / 4))
            now = time.monotonic()
            for flight in [f for f in self.flights.values() if not f.finished and now - f.last_progress > timeout_s]:
                try:
                    self.counters["timeouts"] += 1
                    logger.warning("request %s: no progress for %.0f s; aborting it", flight.request_id, timeout_s)
                    await self._stop_attempt(flight, FinishReason.ABORT)
                    self._fail(flight, RequestTimeoutError(
                        f"the request made no progress for {timeout_s:.0f} s (--request-timeout) and was aborted"))
                except Exception:  # one flight must not end the enforcement for every other
                    logger.exception("request %s: could not enforce its deadline", flight.request_id)

    async def on_worker_lost(self, worker: WorkerHandle, reason: str) -> None:
        self.counters["workers_lost"] += 1
        self._forget_worker(worker)
        # NOTE: the pool has already told us (`on_pool_health`) if no worker can decode now: a flight
        # re-dispatched below then fails with that reason (EngineDeadError, a 503).
        for flight in [f for f in self.flights.values() if f.attempt_id in worker.attempts]:
            if worker.name == flight.prefill and flight.phase == Phase.DECODING:
                continue  # its part was done
            await self._charge_failure(flight, f"{worker.name} died")

    def on_worker_retired(self, worker: WorkerHandle) -> None:
        self._forget_worker(worker)

    def on_pool_health(self, reason: str | None) -> None:
        self.dead_reason = reason

    def _forget_worker(self, worker: WorkerHandle) -> None:
        self._prefill_policy.forget_worker(worker.name)
        self._decode_policy.forget_worker(worker.name)

    def _flight_of(self, attempt_id: str) -> Flight | None:
        request_id, _, attempt = attempt_id.rpartition("#")
        flight = self.flights.get(request_id)
        if flight is None or flight.finished or str(flight.attempt) != attempt:
            return None  # finished, aborted, or an abandoned attempt
        return flight

    async def _on_output(self, worker: WorkerHandle, output: EngineCoreOutput) -> None:
        flight = self._flight_of(output.request_id)
        if flight is None:
            return
        if flight.num_cached_tokens is None:
            flight.num_cached_tokens = output.num_cached_tokens
        if flight.resuming:  # its context came back from the KV store (or this worker's cache), or was recomputed
            flight.resuming = False
            restored, recomputed = flight.resume_costs(output.num_cached_tokens)
            self.counters["resumed"] += 1
            self.counters["resumed_tokens_restored"] += restored
            self.counters["resumed_tokens_recomputed"] += recomputed
        handed_off = output.finish_reason == FinishReason.TRANSFER
        client_output = replace(output, request_id=flight.request_id, num_cached_tokens=flight.num_cached_tokens,
                                finish_reason=None if handed_off else output.finish_reason)
        flight.tokens.extend(output.new_token_ids)
        flight.last_progress = time.monotonic()
        # NOTE: its prompt is computed: the workers hold the embeddings now. The frontend lets go of them (the
        # requests in flight would hold ~MBs each for a large model), and an attempt after a failure encodes its
        # images again (or finds them in the encoder caches)
        flight.embeddings = ()
        out, stop_string = self.outputs.process(client_output)
        flight.finished = out.finished
        # NOTE: to the client first: `flight.tokens` (what a re-dispatch continues from) and the
        # stream must never disagree, even if a send below meets a worker that just died.
        flight.queue.put_nowait(out)
        decode = self.pool.get(flight.decode)
        if handed_off:
            worker.attempts.discard(flight.attempt_id)
            flight.phase = Phase.DECODING
            if decode is not None and out.finished:
                # NOTE: its first token already completed a stop string: the decode side must never start
                # (it would generate, unread, until EOS or max_tokens, holding KV).
                await self.pool.send(decode, CancelReceive([flight.attempt_id]))
            elif decode is not None:
                await self.pool.send(decode, StartDecode(flight.attempt_id, output.new_token_ids[-1]))
        elif output.finish_reason is not None and flight.phase != Phase.DECODING and decode is not None:
            await self.pool.send(decode, CancelReceive([flight.attempt_id]))  # ended at its first token
        if stop_string is not None and output.finish_reason is None:
            await self._stop_attempt(flight, FinishReason.STOP)
        elif out.finished:
            self._release(flight)

    def _fail(self, flight: Flight, exc: Exception) -> None:
        self.outputs.abort(flight.request_id)
        flight.finished = True
        flight.queue.put_nowait(exc)
