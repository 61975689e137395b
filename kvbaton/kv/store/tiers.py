"""Opening one tier from a `KVStoreConfig` (no torch: the server's session endpoints open the shared tiers too)."""

from __future__ import annotations

from pathlib import Path

from kvbaton.config import ConfigError, KVStoreConfig
from kvbaton.kv.store.base import KVTier
from kvbaton.kv.store.records import RecordKey
from kvbaton.paths import cache_root

GB = 2**30
# one store every worker (and the server) reaches; a disk tier is one worker's
SHARED_TIERS = ("shm", "redis", "mooncake")


def open_tier(name: str, config: KVStoreConfig, payload_bytes: int, record_key: RecordKey) -> KVTier:
    """Tier `name` of `config`, for blocks of `payload_bytes`; disk, redis and mooncake sign and check their records
    under `record_key` (shm keeps no records: only this host's workers map its memory). Raises ConfigError for a
    tier without what it needs."""
    if name == "shm":
        from kvbaton.kv.store.shm_tier import ShmTier

        if config.shm_name is None:
            raise ConfigError("the shm KV tier needs an arena name (--kv-store-shm-name) shared by its workers")
        return ShmTier(config.shm_name, payload_bytes, int(config.shm_gb * GB), config.ttl_s)
    if name == "disk":
        from kvbaton.kv.store.disk_tier import DiskTier

        directory = Path(config.disk_dir) if config.disk_dir else cache_root() / "kv-store"
        return DiskTier(directory, payload_bytes, int(config.disk_gb * GB), config.ttl_s, record_key=record_key)
    if name == "mooncake":
        from kvbaton.kv.store.mooncake_tier import MooncakeTier

        if config.mooncake_master is None or config.mooncake_metadata_url is None:
            raise ConfigError("the mooncake KV tier needs its master and metadata server (--kv-store-mooncake-master, "
                              "--kv-store-mooncake-metadata; `serve` starts a private store without them)")
        return MooncakeTier(config.mooncake_master, config.mooncake_metadata_url, payload_bytes, config.ttl_s,
                            record_key=record_key, capacity_bytes=int(config.mooncake_gb * GB))
    from kvbaton.kv.store.redis_tier import RedisTier

    if config.redis_url is None:
        raise ConfigError("the redis KV tier needs a URL (--kv-store-redis-url; `serve` starts a server without one)")
    return RedisTier(config.redis_url, payload_bytes, config.ttl_s, record_key=record_key,
                     capacity_bytes=int(config.redis_gb * GB))
