"""The store a worker's config asks for: its tiers, fastest first, over the worker's pools."""

from __future__ import annotations

import logging
from pathlib import Path

from kvbaton.config import ConfigError, KVStoreConfig
from kvbaton.kv.pools import KVPools
from kvbaton.kv.store.base import KVTier
from kvbaton.kv.store.keys import StoreKeys, model_fingerprint
from kvbaton.kv.store.tiered import TieredStore
from kvbaton.paths import cache_root

logger = logging.getLogger(__name__)

GB = 2**30


def build_store(config: KVStoreConfig, model_dir: Path, pools: KVPools) -> TieredStore | None:
    """None when no tier is configured. Raises ConfigError for a tier without what it needs."""
    if not config.enabled:
        return None
    payload = pools.layout.bytes_per_block
    tiers = [_tier(name, config, payload) for name in config.ordered_tiers]
    keys = StoreKeys.of(model_fingerprint(model_dir), pools.layout)
    logger.info("KV store tiers: %s (%d KiB per block)", ", ".join(t.name for t in tiers), payload // 1024)
    return TieredStore(tiers, keys, pools, write_through=config.write_policy == "write-through")


def _tier(name: str, config: KVStoreConfig, payload_bytes: int) -> KVTier:
    if name == "shm":
        from kvbaton.kv.store.shm_tier import ShmTier

        if config.shm_name is None:
            raise ConfigError("the shm KV tier needs an arena name (--kv-store-shm-name) shared by its workers")
        return ShmTier(config.shm_name, payload_bytes, int(config.shm_gb * GB), config.ttl_s)
    if name == "disk":
        from kvbaton.kv.store.disk_tier import DiskTier

        directory = Path(config.disk_dir) if config.disk_dir else cache_root() / "kv-store"
        return DiskTier(directory, payload_bytes, int(config.disk_gb * GB), config.ttl_s)
    from kvbaton.kv.store.redis_tier import RedisTier

    if config.redis_url is None:
        raise ConfigError("the redis KV tier needs a URL (--kv-store-redis-url; `serve` starts a server without one)")
    return RedisTier(config.redis_url, payload_bytes, config.ttl_s, capacity_bytes=int(config.redis_gb * GB))
