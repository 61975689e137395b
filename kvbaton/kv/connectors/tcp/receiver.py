"""The tcp transport's decode side: check a data frame's size and MAC, then copy its rows in poll()."""

from __future__ import annotations

import hmac
import logging
from typing import Any

import numpy as np
import zmq

from kvbaton.kv.connectors.base import ConnectorConfig
from kvbaton.kv.connectors.tcp import TcpLayer, data_key
from kvbaton.kv.connectors.zmq_control import SenderFailed
from kvbaton.kv.connectors.zmq_control.receiver import Incoming, ZmqReceiver
from kvbaton.kv.convert import largest_block_bytes, write_blocks
from kvbaton.kv.layout import KVLayout, KVLayoutMismatch
from kvbaton.kv.pools import KVPools

logger = logging.getLogger(__name__)


class Receiver(ZmqReceiver):
    decode_type = TcpLayer | SenderFailed

    def __init__(self, config: ConnectorConfig, pools: KVPools) -> None:
        self.host = config.host
        self._data_key = data_key(config.secret)
        super().__init__(config, pools)

    def max_frame_bytes(self) -> int:
        """One layer of a request never exceeds one layer of our whole pool (in the widest dtype a sender may hold)."""
        return max(self.max_header_bytes(), self.num_blocks * largest_block_bytes(self.layout))

    def _on_frames(self, frames: list[zmq.Frame]) -> tuple[Any, Any] | None:
        header = self._decode_header(frames[0])
        if isinstance(header, SenderFailed) and len(frames) == 1:
            return header, None
        if isinstance(header, TcpLayer) and len(frames) == 2 and self._data_ok(header, frames[1].buffer):
            return header, frames[1] if self._transferable(header.layout) else None
        if header is not None:
            self._refuse(f"a {type(header).__name__} in {len(frames)} parts")
        return None

    def _transferable(self, layout: KVLayout) -> bool:
        try:
            layout.check_transferable(self.layout)
        except KVLayoutMismatch:
            return False
        return True

    def _data_ok(self, header: TcpLayer, data: memoryview) -> bool:
        if not self._transferable(header.layout):  # poll() fails the request with the mismatch; data unused
            return True
        expected = header.num_blocks * header.layout.block_bytes  # the sender's blocks, converted in poll()
        if len(data) != expected:
            self._refuse(f"a data frame of {len(data)} bytes where the header says {expected}")
            return False
        if not hmac.compare_digest(hmac.digest(self._data_key, data, "sha256"), header.data_mac):
            self._refuse(f"a data frame for {header.request_id!r} layer {header.layer} with a bad MAC")
            return False
        return True

    def _refuse(self, what: str) -> None:
        logger.warning("%s KV receiver: refused %s", self.config.worker_name, what)

    def _write_layer(self, header: TcpLayer, frame: zmq.Frame, st: Incoming) -> None:
        data = np.frombuffer(frame.buffer, dtype=np.uint8)  # [num_blocks * sender's block_bytes], zmq's memory
        write_blocks(self.pools, header.layer, st.dst_block_ids, data.ctypes.data, range(header.num_blocks),
                     header.layout)
