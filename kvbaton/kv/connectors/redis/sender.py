"""The redis transport's prefill side: save_layer copies the rows out; a writer thread stores them."""

from __future__ import annotations

import hashlib
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch

from kvbaton.kv.connectors.base import ConnectorConfig, KVSender, PollResult, TransferSpec
from kvbaton.kv.connectors.redis import LayerStored, Notice, TransferAborted, client, codec, data_key, dst_digest
from kvbaton.kv.pools import KVPools

logger = logging.getLogger(__name__)

MAX_WRITES = 64  # layers (or cleanups) sent to the store per round trip


@dataclass
class _Outgoing:
    spec: TransferSpec
    transfer_id: str
    dst_digest: bytes
    src_index: torch.Tensor  # [n] long: rows of pools.blocks(layer)
    deadline: float
    stored: set[int] = field(default_factory=set)


# Work for the writer thread, which reads only the fields of `t` that never change after begin().


@dataclass(frozen=True)
class _Write:
    t: _Outgoing
    layer: int
    rows: torch.Tensor  # [n, block_numel], a copy taken in save_layer


@dataclass(frozen=True)
class _Cleanup:
    t: _Outgoing
    reason: str


class Sender(KVSender):
    def __init__(self, config: ConnectorConfig, pools: KVPools) -> None:
        super().__init__(config, pools)
        self._redis = client(config)
        self._codec = codec(config.secret)
        self._transfers: dict[str, _Outgoing] = {}  # engine thread only
        self._work: queue.SimpleQueue[_Write | _Cleanup | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[str, str, int, str | None]] = queue.SimpleQueue()
        self._dropped: set[str] = set()  # transfer ids the writer must skip (set by the engine thread)
        self._thread = threading.Thread(target=self._write_loop, name=f"{config.worker_name}-kv-redis-send",
                                        daemon=True)
        self._thread.start()

    def begin(self, spec: TransferSpec) -> None:
        self.check_begin(spec)
        if spec.request_id in self._transfers:  # its notices carry a transfer id: the receiver tells them apart
            self._drop(spec.request_id, "superseded by a new transfer of the same request")
        src_index = torch.tensor(spec.src_block_ids, dtype=torch.long)
        self._transfers[spec.request_id] = _Outgoing(spec, secrets.token_hex(8), dst_digest(spec.dst_block_ids),
                                                     src_index, time.monotonic() + spec.deadline_s)

    def save_layer(self, layer: int, request_ids: list[str]) -> None:
        pool = self.pools.blocks(layer)  # [num_blocks, block_numel]
        for request_id in request_ids:
            t = self._transfers.get(request_id)
            if t is not None and layer not in t.stored:
                # NOTE: index_select copies, so the writer never reads the live pool
                rows = pool.index_select(0, t.src_index)
                self._work.put(_Write(t, layer, rows))

    def poll(self) -> PollResult:
        completed: list[str] = []
        failed: list[tuple[str, str]] = []
        while not self._results.empty():
            request_id, transfer_id, layer, error = self._results.get()
            t = self._transfers.get(request_id)
            if t is None or t.transfer_id != transfer_id:
                continue
            if error is not None:
                failed.append((request_id, f"redis write of layer {layer} failed: {error}"))
                self._drop(request_id, "the prefill side failed to store the KV")
                continue
            t.stored.add(layer)
            if len(t.stored) == self.layout.num_layers:
                completed.append(request_id)
                del self._transfers[request_id]
        now = time.monotonic()
        for request_id, t in list(self._transfers.items()):
            if now > t.deadline:
                failed.append((request_id, f"deadline of {t.spec.deadline_s:.1f} s passed with {len(t.stored)}/"
                                           f"{self.layout.num_layers} layers stored in redis"))
                self._drop(request_id, "deadline passed on the prefill side")
        return PollResult(completed, failed)

    def abort(self, request_id: str) -> None:
        if request_id in self._transfers:
            self._drop(request_id, "aborted by the prefill worker")

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=10.0)
        self._redis.close()

    def _drop(self, request_id: str, reason: str) -> None:
        """Forget a transfer; the writer skips its queued layers, deletes stored ones, tells the receiver."""
        t = self._transfers.pop(request_id)
        self._dropped.add(t.transfer_id)
        self._work.put(_Cleanup(t, reason))

    # ---- writer thread ----

    def _write_loop(self) -> None:
        while True:
            batch = [self._work.get()]
            while len(batch) < MAX_WRITES and batch[-1] is not None and not self._work.empty():
                batch.append(self._work.get())
            items = [item for item in batch if item is not None]
            if items:
                self._write_batch(items)
            if batch[-1] is None:
                return

    def _write_batch(self, items: list[_Write | _Cleanup]) -> None:
        ttl = self.config.redis_ttl_s
        pipe = self._redis.pipeline(transaction=False)
        writes, deletes = [], []
        for item in items:
            t, request_id, num_layers = item.t, item.t.spec.request_id, self.layout.num_layers
            if isinstance(item, _Cleanup):
                self._dropped.discard(t.transfer_id)  # FIFO: no write of it is left behind this
                deletes += [data_key(request_id, t.transfer_id, layer) for layer in range(num_layers)]
                notice: Notice = TransferAborted(request_id, t.transfer_id, t.dst_digest, item.reason)
            elif t.transfer_id in self._dropped:
                continue
            else:
                data = item.rows.view(torch.uint8).numpy().reshape(-1).data  # memoryview of [n * block_bytes]
                key = data_key(request_id, t.transfer_id, item.layer)
                notice = LayerStored(request_id, t.transfer_id, t.dst_digest, item.layer, num_layers, key, data.nbytes,
                                     hashlib.sha256(data).digest(), self.layout.dtype)
                pipe.set(key, data, ex=ttl)
                writes.append(item)
            pipe.rpush(t.spec.receiver, self._codec.encode(notice))
            pipe.expire(t.spec.receiver, ttl)  # an abandoned receiver's list goes too
        if deletes:  # after the abort notices: a receiver that finds a layer gone finds the reason queued
            pipe.delete(*deletes)
        error = None
        try:
            pipe.execute()
        except Exception as exc:  # any failure must reach poll(), not kill this thread
            error = f"{type(exc).__name__}: {exc}"
            logger.warning("%s: redis write failed: %s", self.config.worker_name, error)
        for item in writes:
            self._results.put((item.t.spec.request_id, item.t.transfer_id, item.layer, error))
