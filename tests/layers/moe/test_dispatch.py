"""The expert-parallel dispatch's pieces that need no process group: the expert map's replica lookup, the wire
payload (rows + slot ids, exact or int8) round trip, empty batches included, and the int8 codec's error."""

from __future__ import annotations

import pytest
import torch

from kvbaton.layers.moe.dispatch import AllToAllDispatch, ExpertMap, dequantize_rows, quantize_rows


def _wire(int8: bool) -> AllToAllDispatch:
    dispatch = AllToAllDispatch.__new__(AllToAllDispatch)  # only the codec: no process group needed
    dispatch.int8_wire = int8
    return dispatch


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_payload_round_trip(int8, rows, dtype):
    wire = _wire(int8)
    x, slots = torch.randn(rows, 64).to(dtype), torch.arange(rows, dtype=torch.int64) * 7 + 3
    received = wire._pack(x, slots).clone()  # a fresh buffer, as all_to_all_single fills one
    got, got_slots = wire._unpack(received, dtype, 64)
    assert got.dtype == dtype and got.shape == x.shape and torch.equal(got_slots, slots)
    if not int8:
        assert torch.equal(got, x)


def test_int8_rows_within_half_a_step():
    x = torch.randn(32, 256) * torch.linspace(0.01, 10, 32).unsqueeze(1)  # rows of very different scales
    back = dequantize_rows(quantize_rows(x), torch.float32)
    step = x.abs().amax(dim=1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 + 1e-6).all()
    assert quantize_rows(x).shape == (32, 256 + 4)


def test_expert_map_lookup_and_validation():
    m = ExpertMap((0, 1, 2, 0, 3, 0), num_ranks=2)  # expert 0 three times
    table, copies = m.lookup(4)
    assert copies.tolist() == [3, 1, 1, 1]
    assert table[0].tolist() == [0, 3, 5] and table[1].tolist() == [1, 1, 1]
    assert m.local_experts(1) == [0, 3, 0]
    with pytest.raises(ValueError, match="at least one slot"):
        ExpertMap((0, 1), num_ranks=1).lookup(3)
    with pytest.raises(ValueError, match="do not split"):
        ExpertMap((0, 1, 2), num_ranks=2)
    with pytest.raises(ValueError, match="evenly"):
        ExpertMap.contiguous(6, 4)


def test_a_mirrored_map_puts_each_rank_s_experts_on_the_next_ranks():
    m = ExpertMap.mirrored(6, 3, 6)  # every expert twice: its own rank, and the rank before it
    assert [m.local_experts(r) for r in range(3)] == [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 0, 1]]
    for rank in range(3):  # any one rank down: every expert still has a slot
        table, copies = m.lookup(6, frozenset({rank}))
        assert sorted(copies.tolist()) == [1, 1, 1, 1, 2, 2]  # the two experts both others hold keep 2 copies
        assert all(slot // m.slots_per_rank != rank for slot in table.flatten().tolist())
    with pytest.raises(ValueError, match="at least one slot"):
        m.lookup(6, frozenset({0, 1}))  # experts 2, 3 were only on ranks 0 and 1
    assert ExpertMap.mirrored(4, 2, 2).local_experts(0) == [0, 1, 2]  # a partial mirror: the next rank's first
    assert ExpertMap.mirrored(4, 2, 0) == ExpertMap.contiguous(4, 2)
    for bad in (1, 3, 10):  # not a multiple of the ranks, or more copies than other ranks
        with pytest.raises(ValueError, match="redundant"):
            ExpertMap.mirrored(4, 2, bad)
