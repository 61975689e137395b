"""Whether an AFD expert pool still serves every expert once a worker is down for good: by the placement the live
workers' heartbeats say (EPLB moves experts layer by layer), not only by what their hellos named."""

from __future__ import annotations

from kvbaton.router.expert_view import every_expert_served

EXPERTS = {0, 1, 2, 3}


def test_hellos_alone_decide_before_any_heartbeat():
    assert every_expert_served(EXPERTS, [([0, 1, 2, 3], {})])
    assert not every_expert_served(EXPERTS, [([0, 1, 2], {})])
    assert not every_expert_served(EXPERTS, [])


def test_a_placement_that_moved_an_expert_away_from_the_survivor_is_not_served():
    # its hello (the mirrored first placement) held every expert, but EPLB left expert 3 of layer 1 elsewhere
    survivor = ([0, 1, 2, 3], {0: [0, 1, 2, 3], 1: [0, 1, 2, 2]})
    assert not every_expert_served(EXPERTS, [survivor])
    assert every_expert_served(EXPERTS, [survivor, ([], {1: [3]})])
