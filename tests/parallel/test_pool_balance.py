"""The expert pool's EPLB planner (attention worker 0's side): the load window it takes from the expert workers'
running counts, and the placement it plans from it."""

from __future__ import annotations

from kvbaton.layers.moe.dispatch import ExpertMap
from kvbaton.parallel.afd.pool_balance import PoolBalancer


def test_the_window_is_the_pools_rows_since_the_last_plan_and_a_replacement_starts_from_zero():
    balancer = PoolBalancer(interval_steps=3, num_experts=4)
    assert balancer.window([[[1, 0, 0, 2]], [[0, 5, 0, 0]]]) == [[1, 5, 0, 2]]
    assert balancer.window([[[3, 0, 1, 2]], [[0, 9, 0, 0]]]) == [[2, 4, 1, 0]]
    # worker 1 was replaced: its counts restarted, so what it reports is all new
    assert balancer.window([[[3, 0, 1, 2]], [[0, 2, 0, 0]]]) == [[0, 2, 0, 0]]
    assert [balancer.due() for _ in range(6)] == [False, False, True, False, False, True]


def test_a_plan_copies_the_hot_expert_and_keeps_every_expert_placed():
    balancer = PoolBalancer(interval_steps=1, num_experts=4)
    first = ExpertMap.mirrored(4, 2, 2)  # 6 slots: each worker its two experts and a copy of one of the other's
    assert balancer.plan([[0, 0, 0, 0]], [first]) is None  # nothing served: nothing to plan from
    placement = balancer.plan([[100, 1, 1, 1]], [first])
    assert placement is not None and len(placement[0]) == 6 and set(placement[0]) == {0, 1, 2, 3}
    per_worker = [placement[0][:3], placement[0][3:]]
    assert all(0 in slots for slots in per_worker), "the hot expert is on both workers"
    again = ExpertMap(tuple(placement[0]), 2)
    assert balancer.plan([[100, 1, 1, 1]], [again]) is None  # the same load again: nothing moves
