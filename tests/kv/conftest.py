"""A private, real redis-server per test module, and a client of it (the redis transport's and tier's tests)."""

from __future__ import annotations

import os

import pytest
import redis

from kvbaton.kv.redis_server import start_redis_server


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
