"""KV session files (`kvbaton.kv.store.session`) over a real shm arena and a real redis-server: a round trip,
and every way a file can be wrong (another secret, a flipped bit, another model or layout, records that are not
the KV of the tokens the header names, too long, truncated) refused with the reason, nothing written."""

from __future__ import annotations

import os
import random

import msgspec
import pytest

from kvbaton.kv.layout import KVLayout
from kvbaton.kv.store.keys import StoreKeys
from kvbaton.kv.store.records import RecordKey
from kvbaton.kv.store.redis_tier import RedisTier
from kvbaton.kv.store.session import (
    MAC_BYTES,
    SessionError,
    SessionHeader,
    export_session,
    read_session,
    restore_session,
    session_keys,
)
from kvbaton.kv.store.shm_tier import ShmTier

SECRET = b"kvbaton-test-secret-0123456789ab"
LAYOUT = KVLayout.standard(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="bfloat16")
PAYLOAD = LAYOUT.bytes_per_block
KEYS = StoreKeys.of("fingerprint-of-a-model", LAYOUT)
TOKENS = [random.Random(3).randrange(1, 30000) for _ in range(18)]  # 4 full blocks and 2 tokens


def payload_for(key: bytes) -> bytes:
    return random.Random(key).randbytes(PAYLOAD)


@pytest.fixture
def arena(request):
    made = []

    def make() -> ShmTier:
        name = f"test-session-{os.getpid()}-{len(made)}"
        tier = ShmTier(name, PAYLOAD, 2**20, ttl_s=60.0)
        made.append((name, tier))
        return tier

    yield make
    for name, tier in made:
        tier.close()
        ShmTier.destroy(name, PAYLOAD)


def fill(tier, tokens=TOKENS, salt=None) -> list[bytes]:
    block_keys = session_keys(KEYS, LAYOUT, tokens, salt)
    for k in block_keys:
        assert tier.put(k, lambda dst, k=k: dst.__setitem__(slice(None), payload_for(k)))
    tier.flush()
    return block_keys


def read(tier, key: bytes) -> bytes | None:
    out: list[bytes] = []
    return out[0] if tier.get(key, lambda src: out.append(bytes(src))) else None


@pytest.mark.parametrize("salt", [None, "user-7"])
def test_a_session_round_trips_into_another_store(arena, salt):
    source, target = arena(), arena()
    block_keys = fill(source, salt=salt)
    data = export_session([source], KEYS, LAYOUT, TOKENS, salt, SECRET)
    session = read_session(data, KEYS, LAYOUT, SECRET, max_tokens=1024)
    assert session.header.token_ids == TOKENS and session.num_tokens == 16 and len(session.payloads) == 4
    assert restore_session([target], session) == 4
    assert [read(target, k) for k in block_keys] == [payload_for(k) for k in block_keys]
    target.check_integrity()


def test_a_session_goes_into_every_shared_tier(arena, server):
    source, shm = arena(), arena()
    redis_tier = RedisTier(server.url, PAYLOAD, ttl_s=60.0, record_key=RecordKey.of_secret(SECRET))  # the server's
    try:
        block_keys = fill(source)
        session = read_session(export_session([source], KEYS, LAYOUT, TOKENS, None, SECRET), KEYS, LAYOUT, SECRET,
                               1024)
        assert restore_session([shm, redis_tier], session) == 4
        for tier in (shm, redis_tier):
            assert [read(tier, k) for k in block_keys] == [payload_for(k) for k in block_keys]
    finally:
        redis_tier.close()


def test_a_prompt_with_a_block_missing_from_every_tier_is_not_saved(arena):
    tier = arena()
    fill(tier, TOKENS[:8])  # only the first two blocks
    with pytest.raises(SessionError, match="block 2 of 4 .* in no shared KV tier"):
        export_session([tier], KEYS, LAYOUT, TOKENS, None, SECRET)
    with pytest.raises(SessionError, match="fewer than one full block"):
        export_session([tier], KEYS, LAYOUT, TOKENS[:3], None, SECRET)


def test_wrong_files_are_refused_with_the_reason(arena):
    source = arena()
    fill(source)
    data = export_session([source], KEYS, LAYOUT, TOKENS, None, SECRET)

    def refused(blob: bytes, match: str, keys: StoreKeys = KEYS, layout: KVLayout = LAYOUT, secret: bytes = SECRET,
                max_tokens: int = 1024) -> None:
        with pytest.raises(SessionError, match=match):
            read_session(blob, keys, layout, secret, max_tokens)

    refused(data, "another cluster secret", secret=b"another-secret-0123456789abcdef!")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    refused(bytes(flipped), "does not verify")
    refused(data[:-1], "does not verify")
    refused(b"junk", "too short")
    refused(b"\0" * 100, "not a kvbaton KV session file")
    refused(data, "more than this server's context", max_tokens=10)
    int8 = LAYOUT.with_dtype("int8")
    refused(data, "another model or KV layout", keys=StoreKeys.of("fingerprint-of-a-model", int8), layout=int8)
    refused(data, "another model or KV layout", keys=StoreKeys.of("another-model", LAYOUT))


def _resigned(data: bytes, header: SessionHeader) -> bytes:
    """`data`'s records under another header, signed with the secret: what only a holder of the secret can make."""
    import hmac
    import struct

    from kvbaton.kv.store import session as s

    magic, version, header_len = struct.unpack_from("<8sII", data, 0)
    encoded = msgspec.msgpack.encode(header)
    body = data[16 + header_len:-MAC_BYTES]
    unsigned = struct.pack("<8sII", magic, version, len(encoded)) + encoded + body
    return unsigned + hmac.digest(s._mac_key(SECRET), unsigned, "sha256")


def test_records_must_be_the_kv_of_the_tokens_the_header_names(arena):
    """Even a signed file cannot put one prompt's KV under another prompt's name: keys come from the tokens."""
    source = arena()
    fill(source)
    data = export_session([source], KEYS, LAYOUT, TOKENS, None, SECRET)
    other_tokens = [t + 1 for t in TOKENS]
    with pytest.raises(SessionError, match="does not match its tokens"):
        read_session(_resigned(data, SessionHeader(KEYS.namespace, LAYOUT, other_tokens)), KEYS, LAYOUT, SECRET, 1024)
    with pytest.raises(SessionError, match="need"):
        read_session(_resigned(data, SessionHeader(KEYS.namespace, LAYOUT, TOKENS[:8])), KEYS, LAYOUT, SECRET, 1024)
    with pytest.raises(SessionError, match="does not match its tokens"):  # a salted name for unsalted KV
        read_session(_resigned(data, SessionHeader(KEYS.namespace, LAYOUT, TOKENS, "salt")), KEYS, LAYOUT, SECRET,
                     1024)
