"""The encode role (E/P/D): a worker without an engine core that runs requests' images through the checkpoint's
image processor, vision tower and projector, and answers with their embeddings, which the router hands to the
language worker that computes the prompt. So encoding, the heaviest part of an image request's prefill, never
runs between the decode steps of the requests beside it.

Its queue is first come, first served, one request's images a round, so an abort or a drain is seen between two
requests. It keeps an encoder cache of its own (by pixel digest, LRU within `--encoder-cache-mb`): the router
sends a request to the encoder that encoded its images last when loads are equal.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

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
from kvbaton.mm.embeddings import to_bytes
from kvbaton.mm.encoder_cache import EncoderCache
from kvbaton.mm.images import DecodedImage
from kvbaton.mm.vision import ImageEncoder, load_image_encoder
from kvbaton.models.registry import resolve_model
from kvbaton.platform.startup import StartupClock
from kvbaton.sched.info import EngineStats
from kvbaton.worker.roles.base import Handler, Role, WorkerContext

logger = logging.getLogger("kvbaton.worker")
IDLE_POLL_MS = 500  # nothing queued: wake up now and then (to notice a dead launcher)


class EncodeRole(Role):
    role = WorkerRole.ENCODE

    def start(self, spec: WorkerSpec, secret: bytes, startup: StartupClock) -> None:
        engine = spec.engine
        encoder = load_image_encoder(resolve_model(engine.model), resolve_dtype(engine.dtype))
        if encoder is None:
            raise ConfigError(f"{engine.model} takes no images: an encoder worker would have nothing to encode")
        self.encoder: ImageEncoder = encoder
        self.cache: EncoderCache[torch.Tensor] = EncoderCache(int(engine.cache.encoder_cache_mb * 2**20))
        self.queue: deque[EncodeImages] = deque()
        self.encoded, self.busy_s, self.started = 0, 0.0, time.monotonic()
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
        else:
            worker.send(ImagesEncoded(name=worker.name, request_id=msg.request_id, embeddings=embeddings))
        worker.report_load()

    def _encode(self, msg: EncodeImages) -> list[ImageEmbedding]:
        """Each image's embeddings, the cached ones from the cache; the entries are held only while this runs."""
        images = [DecodedImage(p.digest, p.width, p.height, p.rgb) for p in msg.images]
        try:
            found = [self.cache.acquire(msg.request_id, im.digest) for im in images]
            missing = [i for i, e in enumerate(found) if e is None]
            if missing:
                start = time.perf_counter()
                encoded = self.encoder.encode([images[i] for i in missing])
                self.busy_s += time.perf_counter() - start
                self.encoded += len(missing)
                for i, e in zip(missing, encoded):
                    self.cache.put(msg.request_id, images[i].digest, e, e.nbytes)
                    found[i] = e
            sent = [to_bytes(e) for e in found if e is not None]
        finally:
            self.cache.release(msg.request_id)
        return [ImageEmbedding(digest=im.digest, dtype=e.dtype, rows=e.rows, cols=e.cols, data=e.data)
                for im, e in zip(images, sent)]

    def _abort(self, msg: AbortRequests) -> None:
        aborted = set(msg.request_ids)
        self.queue = deque(m for m in self.queue if m.request_id not in aborted)

    def wait_ms(self) -> int:
        return 0 if self.queue else IDLE_POLL_MS

    def idle(self) -> bool:
        return not self.queue

    def load(self, seq: int) -> WorkerLoad:
        encode = EncodeLoad(queued_images=sum(len(m.images) for m in self.queue), encoded=self.encoded,
                            busy_s=self.busy_s, alive_s=time.monotonic() - self.started)
        return WorkerLoad(EngineStats(num_waiting=len(self.queue), encoder_cache=self.cache.stats()), 0, 0, seq,
                          encode=encode)

    def close(self) -> None:
        pass
