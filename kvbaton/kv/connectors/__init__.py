"""KV transports behind one contract (`base.py`), created by name."""

from __future__ import annotations

import torch

from kvbaton.kv.connectors.base import ConnectorConfig, KVReceiver, KVSender, PollResult, TransferSpec
from kvbaton.kv.layout import KVLayout

TRANSPORTS = ("shm", "tcp", "redis", "mooncake")


def _module(transport: str):
    if transport == "shm":
        from kvbaton.kv.connectors import shm as mod
    elif transport == "tcp":
        from kvbaton.kv.connectors import tcp as mod
    elif transport == "redis":
        from kvbaton.kv.connectors import redis as mod
    elif transport == "mooncake":
        from kvbaton.kv.connectors import mooncake as mod
    else:
        raise ValueError(f"unknown KV transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    return mod


def make_sender(config: ConnectorConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> KVSender:
    return _module(config.transport).Sender(config, layout, kv_caches)


def make_receiver(config: ConnectorConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> KVReceiver:
    return _module(config.transport).Receiver(config, layout, kv_caches)


__all__ = ["ConnectorConfig", "KVReceiver", "KVSender", "PollResult", "TransferSpec", "make_receiver",
           "make_sender", "TRANSPORTS"]
