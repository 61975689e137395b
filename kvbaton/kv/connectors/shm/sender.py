"""The shm transport's prefill side: names the rows in place (shared pools) or stages them first."""

from __future__ import annotations

import logging
import os

import zmq

from kvbaton.kv.connectors.base import ConnectorConfig
from kvbaton.kv.connectors.shm import ShmLayer
from kvbaton.kv.connectors.shm.segments import Segment, segment_name
from kvbaton.kv.connectors.zmq_control.sender import Outgoing, ZmqSender
from kvbaton.kv.pools import KVPools
from kvbaton.kv.rows import copy_rows

logger = logging.getLogger(__name__)

MIN_STAGING_BYTES = 2**20
MAX_SPARE_STAGING = 4  # staging segments a sender keeps for reuse


class Sender(ZmqSender):
    host = "127.0.0.1"

    def __init__(self, config: ConnectorConfig, pools: KVPools) -> None:
        super().__init__(config, pools)
        self.zero_copy = pools.shared is not None
        self._spare: list[Segment] = []  # staging segments to reuse (I/O thread only)
        if not self.zero_copy:
            logger.info("%s: KV pools are not in shared memory; each transfer is staged (one more copy)",
                        config.worker_name)

    def _read_layer(self, t: Outgoing, layer: int) -> tuple[str, int, list[int], bool]:
        if (shared := self.pools.shared) is not None:
            return shared.name, shared.layer_offset(layer), t.spec.src_block_ids, False
        n, row_bytes = len(t.spec.src_block_ids), self.layout.block_bytes
        if t.resources is None:
            t.resources = self._staging(self.layout.num_layers * n * row_bytes)
        offset = layer * n * row_bytes  # staging: [layer][n rows]
        copy_rows(t.resources.address + offset, range(n), self.pools.address(layer), t.spec.src_block_ids,
                  row_bytes)
        return t.resources.name, offset, list(range(n)), True

    def _staging(self, nbytes: int) -> Segment:
        """A spare segment that fits, else a new one. NOTE: reused because a fresh one costs more than
        the copy itself (page allocation and faults on both sides); sizes are powers of two so they fit
        later transfers."""
        fits = [segment for segment in self._spare if segment.size >= nbytes]
        if fits:
            segment = min(fits, key=lambda s: s.size)
            self._spare.remove(segment)
            return segment
        size = max(MIN_STAGING_BYTES, 1 << (nbytes - 1).bit_length())
        return Segment.create(segment_name(self.config.worker_name, "stage"), size)

    def _push_layer(self, t: Outgoing, layer: int, data: tuple[str, int, list[int], bool]) -> None:
        msg = ShmLayer(t.spec.request_id, layer, self.layout, self.ack_address, os.getpid(), *data)
        self.io.peer(t.spec.receiver).send(self.codec.encode(msg), zmq.NOBLOCK)

    def _release(self, t: Outgoing, receiver_done: bool) -> None:
        segment, t.resources = t.resources, None
        if segment is None:
            return
        if receiver_done:  # nothing will read it again: reuse it
            self._spare.append(segment)
            segment = None
            if len(self._spare) > MAX_SPARE_STAGING:
                segment = min(self._spare, key=lambda s: s.size)
                self._spare.remove(segment)
        if segment is not None:
            segment.unlink()
            segment.close()

    def close(self) -> None:
        super().close()  # the I/O thread has stopped: the spares are ours
        for segment in self._spare:
            segment.unlink()
            segment.close()
        self._spare.clear()
