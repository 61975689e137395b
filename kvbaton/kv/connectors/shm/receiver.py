"""The shm transport's decode side: maps the senders' segments, copies rows out, watches sender pids."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import zmq

from kvbaton.kv.connectors.base import ConnectorConfig
from kvbaton.kv.connectors.shm import ShmLayer
from kvbaton.kv.connectors.shm.segments import Segment, require_shm_dir
from kvbaton.kv.connectors.zmq_control import SenderFailed
from kvbaton.kv.connectors.zmq_control.receiver import Incoming, ZmqReceiver
from kvbaton.kv.convert import write_blocks
from kvbaton.kv.pools import KVPools
from kvbaton.kv.rows import rows_within

logger = logging.getLogger(__name__)

PID_CHECK_S = 0.5  # how often a receiver checks that its senders are alive
STAGING_IDLE_S = 10.0  # a receiver unmaps a staging segment unused this long


@dataclass
class _Mapping:
    segment: Segment
    pid: int  # its creator
    staging: bool
    last_used: float


class Receiver(ZmqReceiver):
    host = "127.0.0.1"
    decode_type = ShmLayer | SenderFailed

    def __init__(self, config: ConnectorConfig, pools: KVPools) -> None:
        require_shm_dir()
        self._mappings: dict[str, _Mapping] = {}  # by segment name (names are never reused)
        self._live_pids: set[int] = set()  # senders seen alive, so worth watching
        self._next_check = 0.0
        super().__init__(config, pools)

    def _on_frames(self, frames: list[zmq.Frame]) -> tuple[ShmLayer | SenderFailed, None] | None:
        if len(frames) != 1:
            logger.warning("%s KV receiver: refused a %d-part message", self.config.worker_name, len(frames))
            return None
        msg = self._decode_header(frames[0])
        return None if msg is None else (msg, None)

    def _write_layer(self, msg: ShmLayer, payload: None, st: Incoming) -> None:
        segment = self._segment(msg, st)
        row_bytes = msg.layout.block_bytes  # the sender's blocks: write_blocks converts another dtype
        if not 0 <= msg.offset <= segment.size or not rows_within(msg.rows, (segment.size - msg.offset) // row_bytes):
            raise ValueError(f"layer message points outside shared memory segment {msg.segment}")
        write_blocks(self.pools, msg.layer, st.dst_block_ids, segment.address + msg.offset, msg.rows, msg.layout)

    def _segment(self, msg: ShmLayer, st: Incoming) -> Segment:
        if st.resources is None:  # the sender's pid
            st.resources = msg.sender_pid
            if _alive(msg.sender_pid):  # else another pid namespace: rely on the deadline
                self._live_pids.add(msg.sender_pid)
        mapping = self._mappings.get(msg.segment)
        if mapping is None:
            try:
                segment = Segment.attach(msg.segment)
            except FileNotFoundError as exc:
                raise OSError(f"shared memory segment {msg.segment} is gone (did the prefill worker exit?)") from exc
            mapping = self._mappings[msg.segment] = _Mapping(segment, msg.sender_pid, msg.staging, 0.0)
        mapping.last_used = time.monotonic()
        return mapping.segment

    def _housekeep(self, failed: list[tuple[str, str]]) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + PID_CHECK_S
        for pid in [pid for pid in self._live_pids if not _alive(pid)]:
            self._live_pids.discard(pid)
            for request_id in [rid for rid, st in self._expected.items() if st.resources == pid]:
                self._fail(request_id, f"prefill worker process {pid} is gone", failed)
            self._unmap([name for name, m in self._mappings.items() if m.pid == pid])
        # a sender may have unlinked a staging segment; our mapping would keep its memory alive
        self._unmap([name for name, m in self._mappings.items() if m.staging and now - m.last_used > STAGING_IDLE_S])

    def _unmap(self, names: list[str]) -> None:
        for name in names:
            self._mappings.pop(name).segment.close()

    def close(self) -> None:
        super().close()
        self._unmap(list(self._mappings))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True
