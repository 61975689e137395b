"""An expert worker's placements (EPLB in the AFD expert pool, `parallel/afd/shard.py`): a newer placement handed
while an older one loads is not refused but loads next, and a dispatch at it waits for both. (A replacement
catching up on the placement in use while it still loads an older one refused it, and the dispatch after it
failed its step: seen once in `tests/cluster/test_ray.py`'s AFD failover.)"""

from __future__ import annotations

import pytest
import torch

from kvbaton.parallel.afd.shard import ExpertShard, PlacementRefused, ShardSpec


def rotated(placement: list[list[int]], by: int) -> list[list[int]]:
    """Another valid placement: every layer's slots shifted (each expert still in it)."""
    return [row[by:] + row[:by] for row in placement]


def test_a_newer_placement_handed_while_one_loads_loads_next(tiny_moe_models):
    shard = ExpertShard(ShardSpec(tiny_moe_models["qwen3_moe"], 0, 2, torch.float32, kernels=False, redundant=2))
    first = shard.held[0].pool
    shard.place(1, rotated(first, 1))
    shard.place(3, rotated(first, 3))  # while 1 loads (or is loaded, not yet installed): next
    assert (shard.loading, shard.next_epoch) == (1, 3)
    shard.place(3, rotated(first, 3))  # the same again: a no-op
    with pytest.raises(PlacementRefused, match="older than the newest here"):
        shard.place(2, rotated(first, 2))  # older than the one next
    shard.wait_loaded(3)  # a dispatch at 3 that came first waits for 1, then 3
    assert shard.newest == 3 and shard.holds(1) and shard.loading is None and shard.next_epoch is None
    assert shard.held[3].pool == rotated(first, 3)
    with pytest.raises(PlacementRefused, match="covering each of the"):
        shard.place(4, [[0] * len(row) for row in first])  # malformed: refused at once, not at its turn
