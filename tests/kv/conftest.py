"""Shared fixtures of the KV tests: a private, real redis-server per test module (started only when a test asks
for it), a client of it, and `make_pair`, the one way every KV transport's sender/receiver pair is built
(`tests/kv/transports.py`)."""

from __future__ import annotations

import os

import pytest
import redis

from kvbaton.kv.redis_server import start_redis_server
from tests.kv.transports import PairFactory


@pytest.fixture(scope="module")
def server():
    srv = start_redis_server()
    yield srv
    srv.stop()
    assert not os.path.exists(f"/proc/{srv.pid}"), "redis-server outlived stop()"


@pytest.fixture
def store(server) -> redis.Redis:
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


@pytest.fixture
def make_pair(request, monkeypatch) -> PairFactory:
    """make_pair(variant, dtype, seed, recv_dim) -> Pair (see `PairFactory`); everything made is closed after."""
    factory = PairFactory(request, monkeypatch)
    yield factory
    factory.close()
