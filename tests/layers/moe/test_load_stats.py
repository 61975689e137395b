"""The expert load window: ring behaviour, totals, hottest, balancedness, snapshot, bounds."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.layers.moe.eplb import identity_placement, rebalance
from kvbaton.layers.moe.load_stats import ExpertLoadWindow


def test_window_keeps_only_the_last_steps() -> None:
    w = ExpertLoadWindow(num_layers=2, num_experts=3, window_steps=3)
    for step in range(1, 6):
        w.record(0, [step, 0, 0])
        w.record(1, [0, 0, 10 * step])
        w.end_step()
        first = max(1, step - 2)
        assert w.totals() == [[sum(range(first, step + 1)), 0, 0], [0, 0, 10 * sum(range(first, step + 1))]]
    assert (w.steps_recorded, w.total_steps) == (3, 5)


def test_records_in_a_step_add_up_and_the_open_step_is_not_counted() -> None:
    w = ExpertLoadWindow(num_layers=1, num_experts=2, window_steps=4)
    w.record(0, [1, 2])
    w.record(0, [3, 4])
    assert w.totals() == [[0, 0]] and w.steps_recorded == 0
    w.end_step()
    assert w.totals() == [[4, 6]]
    w.end_step()  # an empty step counts as a step with no tokens
    assert w.totals() == [[4, 6]] and w.steps_recorded == 2
    w.totals()[0][0] = 99  # a copy
    assert w.totals() == [[4, 6]]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.lists(st.lists(st.integers(0, 50), min_size=4, max_size=4), max_size=20))
def test_window_matches_a_brute_force_sum(window: int, steps: list[list[int]]) -> None:
    w = ExpertLoadWindow(num_layers=1, num_experts=4, window_steps=window)
    for counts in steps:
        w.record(0, counts)
        w.end_step()
    tail = steps[-window:] if steps else []
    assert w.totals() == [[sum(c[e] for c in tail) for e in range(4)]]
    assert w.steps_recorded == len(tail)


def test_hottest() -> None:
    w = ExpertLoadWindow(num_layers=2, num_experts=3, window_steps=2)
    w.record(0, [5, 1, 7])
    w.record(1, [7, 0, 2])
    w.end_step()
    assert w.hottest(3) == [(0, 2, 7), (1, 0, 7), (0, 0, 5)]
    assert w.hottest(2, layer=1) == [(1, 0, 7), (1, 2, 2)]
    assert w.hottest(0) == []


def test_balancedness_and_snapshot() -> None:
    w = ExpertLoadWindow(num_layers=2, num_experts=4, window_steps=8)
    w.record(0, [30, 10, 0, 0])
    w.record(1, [10, 10, 10, 10])
    w.end_step()
    # identity over 2 ranks: layer 0 puts 40 tokens on rank 0 and none on rank 1
    assert w.balancedness(2) == [pytest.approx(0.5), pytest.approx(1.0)]
    # two spare slots: expert 0 of layer 0 gets three replicas of 10 tokens, which then split 20 | 20
    plans = rebalance(w.totals(), num_replicas=6, num_groups=1, num_nodes=1, num_ranks=2)
    assert w.balancedness(plans) == [pytest.approx(1.0), pytest.approx(1.0)]
    assert w.balancedness(identity_placement(4, num_ranks=4))[1] == pytest.approx(1.0)
    snap = w.snapshot(plans)
    assert snap == {"num_layers": 2, "num_experts": 4, "window_steps": 8, "steps_recorded": 1, "total_steps": 1,
                    "counts": [[30, 10, 0, 0], [10, 10, 10, 10]], "balancedness": [1.0, 1.0]}
    assert json.loads(json.dumps(snap)) == snap
    assert msgspec.json.decode(msgspec.json.encode(w.snapshot())) == w.snapshot()
    assert "balancedness" not in w.snapshot()


def test_bounds() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        ExpertLoadWindow(num_layers=1, num_experts=4, window_steps=0)
    w = ExpertLoadWindow(num_layers=2, num_experts=3, window_steps=2)
    with pytest.raises(ValueError, match="layer"):
        w.record(2, [0, 0, 0])
    with pytest.raises(ValueError, match="layer"):
        w.record(-1, [0, 0, 0])
    with pytest.raises(ValueError, match="entries"):
        w.record(0, [0, 0])
    with pytest.raises(ValueError, match=">= 0"):
        w.record(0, [0, -1, 0])
    with pytest.raises(ValueError, match="integers"):
        w.record(0, [0, 1.5, 0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="k must"):
        w.hottest(-1)
    with pytest.raises(ValueError, match="layer"):
        w.hottest(1, layer=5)
    with pytest.raises(ValueError, match="placements"):
        w.balancedness([identity_placement(3, num_ranks=1)])
    with pytest.raises(ValueError, match="cover"):
        w.balancedness(identity_placement(4, num_ranks=2))
    assert w.totals() == [[0, 0, 0], [0, 0, 0]]  # nothing half-recorded
