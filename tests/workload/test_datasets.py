from __future__ import annotations

import math

import numpy as np
import pytest

from kvbaton.workload.arrivals import ArrivalConfig, arrival_offsets
from kvbaton.workload.datasets import DatasetConfig, TokenizerPrompts, WordPrompts, build_requests, sample_lengths
from kvbaton.workload.errors import WorkloadError
from tests.support.helpers import build_tiny_tokenizer


def test_sample_lengths_stay_in_range_and_are_fixed_without_a_ratio():
    rng = np.random.default_rng(0)
    lens = sample_lengths(rng, 100, 0.25, 2000)
    assert lens.min() == 75 and lens.max() == 125
    assert set(sample_lengths(rng, 100, 0.0, 50).tolist()) == {100}
    assert sample_lengths(rng, 1, 0.9, 100).min() >= 1


def test_random_dataset_lengths_and_determinism():
    cfg = DatasetConfig(name="random", num_prompts=40, input_len=50, output_len=20, range_ratio=0.5)
    reqs = build_requests(cfg, WordPrompts(), seed=7)
    assert [r.request_id for r in reqs] == list(range(40))
    for r in reqs:
        assert 25 <= r.prompt_len <= 75 and 10 <= r.output_len <= 30
        assert len(r.prompt.split()) == r.prompt_len and r.system is None
    assert reqs == build_requests(cfg, WordPrompts(), seed=7)
    assert reqs != build_requests(cfg, WordPrompts(), seed=8)


def test_shared_prefix_groups_share_exactly_one_system_prompt():
    cfg = DatasetConfig(name="shared-prefix", num_prompts=12, num_prefixes=3, prefix_len=64, input_len=8)
    reqs = build_requests(cfg, WordPrompts(), seed=1)
    assert [r.group for r in reqs] == [i % 3 for i in range(12)]
    prefixes = {g: {r.system for r in reqs if r.group == g} for g in range(3)}
    assert all(len(p) == 1 for p in prefixes.values())
    assert len({next(iter(p)) for p in prefixes.values()}) == 3
    for r in reqs:
        assert len(r.system.split()) == 64 and r.prompt_len == 64 + 8
        assert r.completion_text().startswith(r.system) and r.completion_text().endswith(r.prompt)
    assert len({r.prompt for r in reqs}) == 12  # each question is its own


def test_mixed_has_exactly_the_long_fraction():
    cfg = DatasetConfig(name="mixed", num_prompts=40, long_fraction=0.1, long_input_len=300, short_input_len=12)
    reqs = build_requests(cfg, WordPrompts(), seed=3)
    lens = [r.prompt_len for r in reqs]
    assert lens.count(300) == 4 and lens.count(12) == 36
    assert [i for i, n in enumerate(lens) if n == 300] != [0, 1, 2, 3]  # placed at random, not first


def test_tokenizer_prompts_hit_the_length_and_avoid_special_tokens(tmp_path):
    build_tiny_tokenizer(tmp_path)
    source = TokenizerPrompts.from_dir(str(tmp_path))
    assert 0 not in source.token_ids  # "t0" is the unk (special) token
    text, n = source.make(np.random.default_rng(0), 33)
    assert n == 33 and len(source.tokenizer.encode(text, add_special_tokens=False)) == 33


@pytest.mark.parametrize("bad", [dict(name="nope"), dict(num_prompts=0), dict(range_ratio=1.0),
                                 dict(long_fraction=1.5), dict(prefix_len=0)])
def test_dataset_config_rejects_bad_values(bad):
    with pytest.raises(WorkloadError):
        DatasetConfig(**bad)


def test_constant_and_infinite_arrivals():
    rng = np.random.default_rng(0)
    assert arrival_offsets(4, ArrivalConfig(request_rate=2.0, arrival="constant"), rng).tolist() == [0, .5, 1, 1.5]
    assert arrival_offsets(3, ArrivalConfig(), rng).tolist() == [0, 0, 0]


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gamma_arrivals_keep_the_mean_rate(burstiness):
    cfg = ArrivalConfig(request_rate=5.0, burstiness=burstiness)
    gaps = np.diff(arrival_offsets(20000, cfg, np.random.default_rng(0)))
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    # Gamma(k): coefficient of variation is 1/sqrt(k); Poisson (k=1) has CV 1.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


@pytest.mark.parametrize("bad", [dict(request_rate=0), dict(burstiness=0), dict(max_concurrency=0),
                                 dict(arrival="uniform")])
def test_arrival_config_rejects_bad_values(bad):
    with pytest.raises(WorkloadError):
        ArrivalConfig(**bad)
