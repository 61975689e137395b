"""The `tcp` transport: KV over ZeroMQ TCP, for prefill and decode workers on different hosts.

    prefill: save_layer(i) -> I/O thread: gather the rows, MAC them, send [signed TcpLayer, data] ──▶
    decode:  I/O thread: check size and MAC, queue;  poll(): memmove the rows into dst blocks  ──▶ Ack

The receiver binds `tcp://{config.host}:{port chosen by the OS}` (its `address`); the sender binds
its ack socket the same way and names it in every header. Data frames go zero-copy from the
gathered buffer, and are received without a copy into zmq's own buffer.

NOTE on authenticating the data: the header (SignedCodec, HMAC-SHA256) carries an HMAC-SHA256 of
the data frame under a key derived from the cluster secret. Measured on this project's 2-core dev
box (SHA-NI): HMAC-SHA256 ~1.3 GB/s vs keyed BLAKE2b ~0.55 GB/s, so HMAC-SHA256 it is. It is the
dominant CPU cost of this transport (a gather is ~4 GB/s), paid once on each side, on the I/O
threads (hashlib releases the GIL), pipelined with the network layer by layer.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from kvbaton.kv.connectors._transport import Incoming, Outgoing, SenderFailed, ZmqReceiver, ZmqSender
from kvbaton.kv.connectors.base import ConnectorConfig
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.rows import copy_rows

logger = logging.getLogger(__name__)

DATA_KEY_INFO = b"kvbaton/kv-data/v1"  # domain separation: a data MAC is never a valid control signature


class TcpLayer(msgspec.Struct, tag="tcp_layer", frozen=True):
    """Prefill -> decode, first frame; the second is `num_blocks` rows of layer `layer`, in dst order."""

    request_id: str
    layer: int
    layout: KVLayout
    ack_to: str
    num_blocks: int
    data_mac: bytes  # HMAC-SHA256(data key, data frame)


def data_key(secret: bytes) -> bytes:
    return hmac.digest(secret, DATA_KEY_INFO, "sha256")


class Sender(ZmqSender):
    def __init__(self, config: ConnectorConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        self.host = config.host
        self._data_key = data_key(config.secret)
        super().__init__(config, layout, kv_caches)

    def _read_layer(self, t: Outgoing, layer: int) -> np.ndarray:
        n, row_bytes = len(t.spec.src_block_ids), self.layout.block_bytes
        # a fresh buffer per frame: zmq holds it until the bytes are on the wire
        data = np.empty(n * row_bytes, dtype=np.uint8)  # [n * block_bytes]
        copy_rows(data.ctypes.data, range(n), self.kv_caches[layer].data_ptr(), t.spec.src_block_ids, row_bytes)
        return data

    def _push_layer(self, t: Outgoing, layer: int, data: np.ndarray) -> None:
        mac = hmac.digest(self._data_key, data, "sha256")
        header = TcpLayer(t.spec.request_id, layer, self.layout, self.ack_address, len(t.spec.src_block_ids), mac)
        self.io.peer(t.spec.receiver).send_multipart([self.codec.encode(header), data], zmq.NOBLOCK, copy=False)


class Receiver(ZmqReceiver):
    decode_type = TcpLayer | SenderFailed

    def __init__(self, config: ConnectorConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        self.host = config.host
        self._data_key = data_key(config.secret)
        super().__init__(config, layout, kv_caches)

    def max_frame_bytes(self) -> int:
        """One layer of a request never exceeds one layer of our whole pool."""
        return max(self.max_header_bytes(), self.num_blocks * self.layout.block_bytes)

    def _on_frames(self, frames: list[zmq.Frame]) -> tuple[Any, Any] | None:
        header = self._decode_header(frames[0])
        if isinstance(header, SenderFailed) and len(frames) == 1:
            return header, None
        if isinstance(header, TcpLayer) and len(frames) == 2 and self._data_ok(header, frames[1].buffer):
            return header, frames[1] if header.layout == self.layout else None
        if header is not None:
            self._refuse(f"a {type(header).__name__} in {len(frames)} parts")
        return None

    def _data_ok(self, header: TcpLayer, data: memoryview) -> bool:
        if header.layout != self.layout:  # poll() fails the request with the mismatch; data unused
            return True
        expected = header.num_blocks * self.layout.block_bytes
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
        data = np.frombuffer(frame.buffer, dtype=np.uint8)  # [num_blocks * block_bytes], zmq's memory
        copy_rows(self.pool_address(header.layer), st.dst_block_ids, data.ctypes.data, range(header.num_blocks),
                  self.layout.block_bytes)
