"""The encode role (E/P/D): a worker without an engine core that runs requests' images through the checkpoint's
image processor, vision tower and projector, and answers with their embeddings, which the router hands to the
language worker that computes the prompt. So encoding, the heaviest part of an image request's prefill, never
runs between the decode steps of the requests beside it.

Its queue is first come, first served, one request's images a round, so an abort or a drain is seen between two
requests. It keeps an encoder cache of its own (by pixel digest, LRU within `--encoder-cache-mb`; the router sends
a request to the encoder that encoded its images last when loads are equal) over the deployment's shared tier, if
it has one (`--kv-store shm` or redis: another encoder worker's encodings count too).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from kvbaton.config import ConfigError
from kvbaton.engine.core import resolve_dtype
from kvbaton.messages.router_worker import (
    AbortRequests,
    CheckIntegrity,
    EncodeImages,
    EncodeLoad,
    ImageEmbedding,
    ImagesEncoded,
    IntegrityReport,
    RequestFailed,
    WorkerHello,
    WorkerLoad,
)
from kvbaton.messages.worker_spec import WorkerRole, WorkerSpec
from kvbaton.mm.cached_encoder import CachedEncoder
from kvbaton.mm.embedding_bound import MAX_EMBEDDING_BYTES, embeddings_refusal
from kvbaton.mm.embeddings import to_bytes
from kvbaton.mm.images import DecodedImage
from kvbaton.models.registry import resolve_model
from kvbaton.platform.startup import StartupClock
from kvbaton.sched.info import EngineStats
from kvbaton.worker.roles.base import Handler, Role, WorkerContext

logger = logging.getLogger("kvbaton.worker")
IDLE_POLL_MS = 500  # nothing queued: wake up now and then (to notice a dead launcher)
def oversized(embeddings: list[ImageEmbedding], limit: int = MAX_EMBEDDING_BYTES) -> str | None:
    """Why a request's embeddings cannot travel (over `limit` bytes in all), None if they can: the router
    refused such a request at admission while this worker was up; one admitted before it was is refused here."""
    return embeddings_refusal(sum(len(e.data) for e in embeddings), limit)


class EncodeRole(Role):
    role = WorkerRole.ENCODE

    def start(self, spec: WorkerSpec, secret: bytes, startup: StartupClock) -> None:
        engine = spec.engine
        encoder = CachedEncoder.load(resolve_model(engine.model), resolve_dtype(engine.dtype),
                                     engine.cache.encoder_cache_mb, engine.kv_store)
        if encoder is None:
            raise ConfigError(f"{engine.model} takes no images: an encoder worker would have nothing to encode")
        self.encoder = encoder
        self.queue: deque[EncodeImages] = deque()
        self.started = time.monotonic()
        startup.lap("encoder")
        self.startup = startup

    def hello(self, worker: WorkerContext, index: int, pid: int, address: str) -> WorkerHello:
        return WorkerHello(name=worker.name, role=self.role, index=index, pid=pid, address=address, info=None,
                           layout=None, receiver=None, load=worker.report_load(), startup=self.startup.phases)

    def commands(self, worker: WorkerContext) -> dict[type, Handler]:
        return {EncodeImages: self.queue.append, AbortRequests: self._abort,
                CheckIntegrity: lambda msg: worker.send(IntegrityReport(worker.name, None, 0.0, len(self.queue)))}

    def run_round(self, worker: WorkerContext) -> None:
        if not self.queue:
            return
        msg = self.queue.popleft()
        try:
            embeddings = self._encode(msg)
        except (ValueError, RuntimeError, OSError) as exc:  # what the processor or the tower raise on an image
            logger.warning("refused the images of %s: %s", msg.request_id, exc)
            worker.send(RequestFailed(worker.name, msg.request_id, f"the image encoder refused an image: {exc}"))
            worker.report_load()
            return
        refusal = oversized(embeddings)
        if refusal is not None:
            worker.send(RequestFailed(worker.name, msg.request_id, refusal))
        else:
            worker.send(ImagesEncoded(name=worker.name, request_id=msg.request_id, embeddings=embeddings))
        worker.report_load()

    def _encode(self, msg: EncodeImages) -> list[ImageEmbedding]:
        """Each image's embeddings, the cached ones from the caches; held only while this runs."""
        images = [DecodedImage(p.digest, p.width, p.height, p.rgb) for p in msg.images]
        try:
            sent = [to_bytes(e) for e in self.encoder.encode(msg.request_id, images)]
        finally:
            self.encoder.release(msg.request_id)
        return [ImageEmbedding(digest=im.digest, dtype=e.dtype, rows=e.rows, cols=e.cols, data=e.data,
                               width=im.width, height=im.height) for im, e in zip(images, sent)]

    def _abort(self, msg: AbortRequests) -> None:
        aborted = set(msg.request_ids)
        self.queue = deque(m for m in self.queue if m.request_id not in aborted)

    def wait_ms(self) -> int:
        return 0 if self.queue else IDLE_POLL_MS

    def idle(self) -> bool:
        return not self.queue

    def load(self, seq: int) -> WorkerLoad:
        encoder = self.encoder
        encode = EncodeLoad(queued_images=sum(len(m.images) for m in self.queue), encoded=encoder.encoded,
                            busy_s=encoder.busy_s, alive_s=time.monotonic() - self.started)
        return WorkerLoad(EngineStats(num_waiting=len(self.queue), encoder_cache=encoder.stats()), 0, 0, seq,
                          encode=encode)

    def close(self) -> None:
        self.encoder.close()
