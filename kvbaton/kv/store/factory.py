"""The store a worker's config asks for: its tiers, fastest first, over the worker's pools, signing their records
under the cluster secret (`records.py`)."""

from __future__ import annotations

import functools
import logging
import os
import secrets
from pathlib import Path

from kvbaton.config import KVStoreConfig
from kvbaton.kv.pools import KVPools
from kvbaton.kv.store.keys import StoreKeys, model_fingerprint
from kvbaton.kv.store.records import RecordKey
from kvbaton.kv.store.tiered import TieredStore
from kvbaton.kv.store.tiers import open_tier
from kvbaton.wire import SECRET_ENV

logger = logging.getLogger(__name__)


def build_store(config: KVStoreConfig, model_dir: Path, pools: KVPools) -> TieredStore | None:
    """None when no tier is configured. Raises ConfigError for a tier without what it needs."""
    if not config.enabled:
        return None
    payload = pools.layout.bytes_per_block
    record_key = store_record_key()
    tiers = [open_tier(name, config, payload, record_key) for name in config.ordered_tiers]
    keys = StoreKeys.of(model_fingerprint(model_dir), pools.layout)
    logger.info("KV store tiers: %s (%d KiB per block)", ", ".join(t.name for t in tiers), payload // 1024)
    return TieredStore(tiers, keys, pools, write_through=config.write_policy == "write-through")


def store_record_key() -> RecordKey:
    """The record key of the cluster secret a launcher hands its workers (KVBATON_CLUSTER_SECRET), or, in a
    process without one (an in-process `LLM`), of a secret made once per process."""
    secret = os.environ.get(SECRET_ENV)
    return RecordKey.of_secret(secret.encode() if secret else _process_secret())


@functools.cache
def _process_secret() -> bytes:
    # NOTE: random, not a fixed default: a constant everyone can read would let anyone forge records again
    logger.info("KV store: %s is not set, so blocks written now are readable by this process only; set it (the same "
                "everywhere) to share a redis, mooncake or disk store across processes and restarts", SECRET_ENV)
    return secrets.token_bytes(32)
