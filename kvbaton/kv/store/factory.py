"""The store a worker's config asks for: its tiers, fastest first, over the worker's pools."""

from __future__ import annotations

import logging
from pathlib import Path

from kvbaton.config import KVStoreConfig
from kvbaton.kv.pools import KVPools
from kvbaton.kv.store.base import KVTier
from kvbaton.kv.store.keys import StoreKeys, model_fingerprint
from kvbaton.kv.store.tiered import TieredStore

logger = logging.getLogger(__name__)

GB = 2**30


def build_store(config: KVStoreConfig, model_dir: Path, pools: KVPools) -> TieredStore | None:
    """None when no tier is configured."""
    if not config.enabled:
        return None
    payload = pools.layout.bytes_per_block
    tiers: list[KVTier] = []
    if config.shm_name:
        from kvbaton.kv.store.shm_tier import ShmTier

        tiers.append(ShmTier(config.shm_name, payload, int(config.shm_gb * GB), config.ttl_s))
    if config.disk_dir:
        from kvbaton.kv.store.disk_tier import DiskTier

        tiers.append(DiskTier(Path(config.disk_dir), payload, int(config.disk_gb * GB), config.ttl_s))
    if config.redis_url:
        from kvbaton.kv.store.redis_tier import RedisTier

        tiers.append(RedisTier(config.redis_url, payload, config.ttl_s, capacity_bytes=int(config.redis_max_gb * GB)))
    keys = StoreKeys.of(model_fingerprint(model_dir), pools.layout)
    logger.info("KV store tiers: %s (%d KiB per block)", ", ".join(t.name for t in tiers), payload // 1024)
    return TieredStore(tiers, keys, pools, write_through=config.write_policy == "write-through")
