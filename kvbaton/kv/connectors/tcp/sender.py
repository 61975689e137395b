"""The tcp transport's prefill side: gather a layer's rows into a fresh frame, MAC it, send it."""

from __future__ import annotations

import hmac

import numpy as np
import zmq

from kvbaton.kv.connectors.base import ConnectorConfig
from kvbaton.kv.connectors.tcp import TcpLayer, data_key
from kvbaton.kv.connectors.zmq_control.sender import Outgoing, ZmqSender
from kvbaton.kv.pools import KVPools
from kvbaton.kv.rows import copy_rows


class Sender(ZmqSender):
    def __init__(self, config: ConnectorConfig, pools: KVPools) -> None:
        self.host = config.host
        self._data_key = data_key(config.secret)
        super().__init__(config, pools)

    def _read_layer(self, t: Outgoing, layer: int) -> np.ndarray:
        n, row_bytes = len(t.spec.src_block_ids), self.layout.block_bytes
        # a fresh buffer per frame: zmq holds it until the bytes are on the wire
        data = np.empty(n * row_bytes, dtype=np.uint8)  # [n * block_bytes]
        copy_rows(data.ctypes.data, range(n), self.pools.address(layer), t.spec.src_block_ids, row_bytes)
        return data

    def _push_layer(self, t: Outgoing, layer: int, data: np.ndarray) -> None:
        frame = data.data  # a memoryview: zmq sends from the gathered buffer itself
        mac = hmac.digest(self._data_key, frame, "sha256")
        header = TcpLayer(t.spec.request_id, layer, self.layout, self.ack_address, len(t.spec.src_block_ids), mac)
        self.io.peer(t.spec.receiver).send_multipart([self.codec.encode(header), frame], zmq.NOBLOCK, copy=False)
