"""The encoder cache's shared level (`mm/shared_encodings.py`): an image one engine encoded is found by another
through the deployment's shared tier (shm, redis) and not encoded again, with transformers' tokens; records are
whole or missing: one cut short, naming another image or signed under another secret is a miss, never an error."""

from __future__ import annotations

import os

import pytest
import redis as redis_client

from kvbaton import LLM, SamplingParams
from kvbaton.config import KVStoreConfig
from kvbaton.kv.redis_server import start_redis_server
from kvbaton.kv.store.records import RecordKey
from kvbaton.kv.store.redis_tier import RedisTier
from kvbaton.kv.store.shm_tier import remove_arenas
from kvbaton.mm.embeddings import EmbeddingBytes
from kvbaton.mm.shared_encodings import CHUNK_BYTES, SharedEncodings
from tests.mm.test_llava_parity import MAX_NEW, PROMPTS
from tests.support.helpers import build_tiny_llava, hf_llava_greedy


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    model = build_tiny_llava(tmp_path_factory.mktemp("llava"))
    return model, hf_llava_greedy(model, PROMPTS[:3], MAX_NEW)


@pytest.fixture(scope="module")
def redis():
    server = start_redis_server(maxmemory_mb=64, maxmemory_policy="allkeys-lru")
    yield server
    server.stop()


def generate(llm: LLM, prompts) -> list[list[int]]:
    inputs = [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}} for ids, images in prompts]
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kind", ["shm", "redis"])
def test_an_image_one_engine_encoded_is_not_encoded_again_by_another(kind, llava, redis, tmp_path):
    model, refs = llava
    store = (KVStoreConfig(tiers=("shm",), shm_name=f"t{os.getpid()}-{tmp_path.name[-20:]}", shm_gb=0.25)
             if kind == "shm" else KVStoreConfig(tiers=("redis",), redis_url=redis.url))
    try:
        a = LLM(str(model), dtype="float32", kv_store=store)
        assert generate(a, PROMPTS[:1]) == refs[:1]
        a.engine.core.close()
        b = LLM(str(model), dtype="float32", kv_store=store, enable_prefix_caching=True)
        assert generate(b, PROMPTS[:3]) == refs  # 1 image from A's encoding, 3 its own
        stats, encoder = b.engine.stats().encoder_cache, b.engine.core.vision_encoder
        assert stats is not None and encoder is not None
        assert (stats.misses, stats.shared_hits, encoder.encoded) == (4, 1, 3), stats
        b.engine.core.close()
    finally:
        if kind == "shm":
            remove_arenas(store.shm_name or "")


def test_a_record_is_whole_or_a_miss(redis):
    tier = RedisTier(redis.url, CHUNK_BYTES, 60.0, record_key=RecordKey.of_secret(b"one secret, 16 bytes or more"))
    shared = SharedEncodings(tier, b"testns01")
    digest, other = "ab" * 32, "cd" * 32
    record = EmbeddingBytes("float32", 300, 100, bytes(range(256)) * 468 + bytes(192))  # 120000 bytes: 2 chunks
    assert shared.put(digest, record)
    tier.flush()
    assert shared.get(digest) == record
    assert shared.get(other) is None  # never stored
    # another secret reads none of it (every chunk is signed), and says so in its counters
    forger = RedisTier(redis.url, CHUNK_BYTES, 60.0, record_key=RecordKey.of_secret(b"another secret, as long as it"))
    assert SharedEncodings(forger, b"testns01").get(digest) is None
    assert forger.stats().corrupt >= 1
    # a record cut short (its second chunk gone, as an eviction would take it) is a miss
    client = redis_client.Redis.from_url(redis.url)
    assert client.delete(f"kvb:kv:{shared._key(digest, 1).hex()}") == 1  # noqa: SLF001
    assert shared.get(digest) is None and shared.misses == 2
    tier.close()
    forger.close()
