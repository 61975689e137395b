"""Routing policies as pure functions of what the router knows: each candidate's name and load score,
and (prefix-aware) which prompt blocks the router itself sent where. The candidates here are plain
records with exactly the two attributes a policy may read (`Candidate`), so these run in
milliseconds; the real-process tests (test_pd.py, test_router_colocated.py) drive the same
policies through a real router."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvbaton.kv.hashing import chained_block_hashes, hash_block_tokens, salted_root
from kvbaton.router.policies import POLICIES, LeastLoaded, PrefixAware, PrefixIndex, RoundRobin, make_policy
from kvbaton.sched.request import ImageSpan, Request
from kvbaton.sched.sampling_params import SamplingParams

BS = 4


@dataclass
class Worker:
    name: str
    load_score: float = 0.0


def pool(*loads: float) -> list[Worker]:
    return [Worker(f"w{i}", load) for i, load in enumerate(loads)]


def test_round_robin_cycles_through_candidates():
    policy, workers = RoundRobin(BS), pool(0, 0, 0)
    assert [policy.pick(workers, [1]).name for _ in range(7)] == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]


def test_least_loaded_picks_the_lowest_score_first_on_ties():
    policy = LeastLoaded(BS)
    assert policy.pick(pool(3, 1.5, 2), [1]).name == "w1"
    assert policy.pick(pool(1, 1, 1), [1]).name == "w0"


def test_prefix_index_matches_the_longest_routed_prefix():
    index = PrefixIndex(BS)
    prompt = list(range(1, 14))  # 3 full blocks and a partial one
    assert index.hashes(prompt) == chained_block_hashes(prompt, BS) and len(index.hashes(prompt)) == 3
    index.add("w0", index.hashes(prompt[:8]))
    assert index.matched_blocks("w0", index.hashes(prompt)) == 2
    assert index.matched_blocks("w1", index.hashes(prompt)) == 0
    other = [99] + prompt[1:]  # differs in the first block: nothing matches, later blocks included
    assert index.matched_blocks("w0", index.hashes(other)) == 0


def test_prefix_index_is_bounded_per_worker():
    index = PrefixIndex(BS, max_blocks_per_worker=4)
    first, second = list(range(100, 116)), list(range(200, 216))
    index.add("w0", index.hashes(first))
    index.add("w0", index.hashes(second))  # evicts the first prompt's blocks (oldest first)
    assert index.matched_blocks("w0", index.hashes(first)) == 0
    assert index.matched_blocks("w0", index.hashes(second)) == 4


def test_prefix_aware_follows_the_cached_prefix_over_load():
    policy, workers = PrefixAware(BS), pool(0, 5)
    system = list(range(1, 33))  # a shared 8-block system prompt
    policy.note_routed("w1", system + [40, 41])
    # w1 is busier but holds the prefix: it wins
    assert policy.pick(workers, system + [50, 51, 52]).name == "w1"
    # a prompt nobody has seen goes to the least loaded
    assert policy.pick(workers, list(range(300, 340))).name == "w0"


def test_prefix_aware_keeps_each_cache_salt_apart():
    """A salted request's blocks are cached under hashes of their own: it follows its own salt's earlier
    requests, never another tenant's (whose cache it could not use, and whose placement it would reveal)."""
    policy, workers = PrefixAware(BS), pool(0, 5)
    system = list(range(1, 33))
    policy.note_routed("w1", system, cache_salt="tenant-a")
    assert policy.pick(workers, system).name == "w0"  # unsalted: no match, the least loaded
    assert policy.pick(workers, system, cache_salt="tenant-b").name == "w0"
    assert policy.pick(workers, system, cache_salt="tenant-a").name == "w1"
    assert policy.index.hashes(system, "tenant-a") == chained_block_hashes(system, BS, parent=salted_root("tenant-a"))


def test_prefix_aware_tells_images_apart_as_the_engines_prefix_caches_do():
    """Every image's placeholders are the same tokens: the blocks holding them are named by the image's digest
    too, exactly as an engine's prefix cache names them, so a prompt follows the worker that saw its image and
    another image matches only the blocks before it."""
    policy, workers = PrefixAware(BS), pool(0, 5)
    placeholders = [9] * 8  # 2 blocks of one image's placeholders, after 2 blocks of text
    prompt = list(range(1, 9)) + placeholders + [20, 21, 22, 23]
    cat, dog = (ImageSpan(8, 8, bytes([1]) * 32),), (ImageSpan(8, 8, bytes([2]) * 32),)
    policy.note_routed("w1", prompt, images=cat)
    assert policy.pick(workers, prompt, images=cat).name == "w1"
    assert policy.index.matched_blocks("w1", policy.index.hashes(prompt, images=dog)) == 2  # the text before it
    assert policy.pick(workers, prompt, images=dog).name == "w1"  # still the longest match (2 blocks)
    assert policy.pick(workers, prompt).name == "w1"
    # the engine's hashes: a request's block hashes with the same spans
    req = Request("r", prompt, SamplingParams(), image_spans=cat)
    assert policy.index.hashes(prompt, images=cat) == [
        hash_block_tokens(None if i == 0 else policy.index.hashes(prompt, images=cat)[i - 1],
                          prompt[i * BS:(i + 1) * BS], req.image_digests(i * BS, (i + 1) * BS)) for i in range(5)]


def test_prefix_aware_breaks_ties_by_load_and_forgets_workers_that_left():
    policy = PrefixAware(BS)
    prompt = list(range(1, 17))
    policy.note_routed("w0", prompt)
    policy.note_routed("w1", prompt)
    assert policy.pick(pool(2, 1), prompt).name == "w1"  # same match, lower load
    policy.forget_worker("w1")
    assert policy.pick(pool(2, 1), prompt).name == "w0"  # w1's blocks are forgotten: w0 has the longer match


def test_prefix_aware_prefers_the_longer_partial_match():
    policy, workers = PrefixAware(BS), pool(0, 0)
    prompt = list(range(1, 25))  # 6 blocks
    policy.note_routed("w0", prompt[:8])
    policy.note_routed("w1", prompt[:20])
    assert policy.pick(workers, prompt).name == "w1"


def test_make_policy_by_name():
    assert set(POLICIES) == {"round_robin", "least_loaded", "prefix_aware"}
    assert isinstance(make_policy("prefix_aware", BS), PrefixAware)
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        make_policy("fastest", BS)
