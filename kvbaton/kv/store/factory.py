"""The store a worker's config asks for: its tiers, fastest first, over the worker's pools."""

from __future__ import annotations

import logging
from pathlib import Path

from kvbaton.config import KVStoreConfig
from kvbaton.kv.pools import KVPools
from kvbaton.kv.store.keys import StoreKeys, model_fingerprint
from kvbaton.kv.store.tiered import TieredStore
from kvbaton.kv.store.tiers import open_tier

logger = logging.getLogger(__name__)


def build_store(config: KVStoreConfig, model_dir: Path, pools: KVPools) -> TieredStore | None:
    """None when no tier is configured. Raises ConfigError for a tier without what it needs."""
    if not config.enabled:
        return None
    payload = pools.layout.bytes_per_block
    tiers = [open_tier(name, config, payload) for name in config.ordered_tiers]
    keys = StoreKeys.of(model_fingerprint(model_dir), pools.layout)
    logger.info("KV store tiers: %s (%d KiB per block)", ", ".join(t.name for t in tiers), payload // 1024)
    return TieredStore(tiers, keys, pools, write_through=config.write_policy == "write-through")
