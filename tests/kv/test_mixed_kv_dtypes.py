"""Prefill and decode pools of different KV dtypes: the receiver converts the sender's blocks as it writes its
pool, over every transport that writes its own pool (tcp, shm staged and zero-copy, redis, real sockets and a
real redis-server); a transport that cannot convert refuses with the reason."""

from __future__ import annotations

import random

import pytest
import torch

from kvbaton.kernels.kv_quant import dequantize_rows, quantize_rows
from kvbaton.kv.connectors import ConnectorConfig, TransferSpec, make_receiver, make_sender, pool_allocator
from kvbaton.kv.convert import convert_slots
from kvbaton.kv.layout import KVLayout, KVLayoutMismatch
from kvbaton.kv.pools import KVPools, allocate_pools
from tests.kv.kv_peer import BLOCKS, kv_layout
from tests.support.wait import wait_until

SECRET = b"kvbaton-test-secret-0123456789ab"
# (prefill, decode): quantizing, dequantizing, widening, narrowing, and between two quantized formats
PAIRS = [("bfloat16", "int8"), ("int8", "bfloat16"), ("fp8_e4m3", "float32"), ("float32", "fp8_e4m3"),
         ("int8", "fp8_e4m3"), ("bfloat16", "float32")]


def layout_of(dtype: str) -> KVLayout:
    return kv_layout(torch.float32).with_dtype(dtype)


def fill(pools: KVPools, seed: int) -> None:
    """Random K/V values in the pools' own format (quantized ones through the write path's quantizer)."""
    gen = torch.Generator().manual_seed(seed)
    layout = pools.layout
    for cache in pools.caches:
        values = torch.randn((cache.shape[0], 2, layout.num_kv_heads, layout.head_dim), generator=gen)
        cache.copy_(quantize_rows(values, cache.dtype) if layout.quantized else values.to(cache.dtype))


def as_float(pools: KVPools, layer: int, block_ids: list[int]) -> torch.Tensor:
    """Blocks of one layer as fp32 values [n, block_size, 2, H, D]."""
    layout = pools.layout
    slots = pools.caches[layer].view(-1, layout.block_size, *layout.slot_shape)[block_ids]
    return dequantize_rows(slots, torch.float32) if layout.quantized else slots.float()


@pytest.fixture
def pair_of(request):
    made = []

    def make(variant: str, src_dtype: str, dst_dtype: str) -> tuple:
        transport = variant.split("-")[0]
        url = request.getfixturevalue("server").url if transport == "redis" else None
        config = ConnectorConfig(transport, SECRET, worker_name="kvmix", redis_url=url, redis_ttl_s=30)
        allocate = pool_allocator(config, sending=True) if variant == "shm-shared" else allocate_pools
        src = allocate(layout_of(src_dtype), BLOCKS)
        fill(src, seed=len(made))
        dst = allocate_pools(layout_of(dst_dtype), BLOCKS)
        sender, receiver = make_sender(config, src), make_receiver(config, dst)
        made.append((sender, receiver, src))
        return sender, receiver, src, dst

    yield make
    for sender, receiver, src in made:
        sender.close()
        receiver.close()
        src.close()


def transfer(sender, receiver, src_ids: list[int], dst_ids: list[int], request_id: str = "a") -> tuple[list, list]:
    """Run one transfer to its end (bounded): (receiver's failures, sender's failures)."""
    receiver.expect(request_id, dst_ids, 10.0)
    sender.begin(TransferSpec(request_id=request_id, src_block_ids=src_ids, dst_block_ids=dst_ids,
                              receiver=receiver.address, layout=receiver.layout, deadline_s=10.0))
    for layer in range(sender.layout.num_layers):
        sender.save_layer(layer, [request_id])
    r_done, s_done, r_failed, s_failed = [], [], [], []

    def ended() -> bool:
        r, s = receiver.poll(), sender.poll()
        r_done.extend(r.completed)
        r_failed.extend(r.failed)
        s_done.extend(s.completed)
        s_failed.extend(s.failed)
        return bool((r_done or r_failed) and (s_done or s_failed))

    wait_until(ended, 10.0, interval_s=0.002, message="the transfer did not end")
    return r_failed, s_failed


@pytest.mark.parametrize("variant", ["tcp", "shm", "shm-shared", "redis"])
@pytest.mark.parametrize(("src_dtype", "dst_dtype"), PAIRS)
def test_receiver_converts_another_kv_dtype(pair_of, variant, src_dtype, dst_dtype):
    sender, receiver, src, dst = pair_of(variant, src_dtype, dst_dtype)
    rng = random.Random(f"{variant}{src_dtype}{dst_dtype}")
    ids = rng.sample(range(BLOCKS), 24)
    src_ids, dst_ids = ids[:12], ids[12:]
    assert transfer(sender, receiver, src_ids, dst_ids) == ([], [])
    untouched = sorted(set(range(BLOCKS)) - set(dst_ids))
    for layer in range(src.layout.num_layers):
        sent = src.caches[layer].view(-1, src.layout.block_size, *src.layout.slot_shape)[src_ids]
        expected = convert_slots(sent.flatten(0, 1), src.layout, dst.layout)  # exactly what a receiver writes
        got = dst.caches[layer].view(-1, *dst.layout.slot_shape).view(BLOCKS, -1, *dst.layout.slot_shape)[dst_ids]
        assert torch.equal(got.flatten(0, 1), expected), f"layer {layer}"
        assert not dst.caches[layer].view(BLOCKS, -1)[untouched].any(), "a block outside dst_block_ids was written"
        # and the values survive the trip to within the coarser format's rounding
        tolerance = {"int8": 0.02, "fp8_e4m3": 0.07, "bfloat16": 0.01, "float32": 0.0}
        err = (as_float(dst, layer, dst_ids) - as_float(src, layer, src_ids)).abs()
        scale = as_float(src, layer, src_ids).abs().amax(dim=-1, keepdim=True)
        assert (err <= scale * max(tolerance[src_dtype], tolerance[dst_dtype]) + 1e-6).all()


def test_layouts_that_differ_in_more_than_dtype_are_still_refused():
    ours = layout_of("int8")
    ours.check_transferable(layout_of("bfloat16"))
    other = KVLayout.standard(num_layers=ours.num_layers, block_size=ours.block_size * 2,
                              num_kv_heads=ours.num_kv_heads, head_dim=ours.head_dim, dtype="bfloat16")
    with pytest.raises(KVLayoutMismatch, match="block_size"):
        ours.check_transferable(other)
    with pytest.raises(KVLayoutMismatch, match="dtype int8 vs bfloat16"):
        ours.check_compatible(layout_of("bfloat16"))


def test_a_deployment_refuses_mixed_dtypes_over_a_transport_that_cannot_convert():
    from kvbaton.cluster.deploy import DeploymentSpec
    from kvbaton.config import ConfigError

    with pytest.raises(ConfigError, match="mooncake moves blocks between pools as they are"):
        DeploymentSpec(num_prefill=1, kv_transport="mooncake", prefill_kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="must be one of"):
        DeploymentSpec(num_prefill=1, prefill_kv_cache_dtype="int4")
    DeploymentSpec(num_prefill=1, kv_transport="tcp", prefill_kv_cache_dtype="int8")
