"""The AFD step timeline (`sim/afd.py`): one micro-batch is the sum of both sides' work; a balanced ping-pong
hides the other side; latency and fixed costs make more micro-batches lose; the plan favours the side that is
short of workers."""

from __future__ import annotations

import dataclasses

import pytest

from kvbaton.sim.afd import AfdCosts, Affine, afd_step, best_micro_batches, plan_afd, split_tokens, with_ratio

PER_TOKEN = Affine(0.0, 1e-3)
FREE = Affine(0.0)


def costs(attention=PER_TOKEN, experts=PER_TOKEN, post=FREE, latency_s=0.0, layers=4, moe_layers=4) -> AfdCosts:
    return AfdCosts(attention=attention, post=post, experts=experts, latency_s=latency_s, layers=layers,
                    moe_layers=moe_layers)


def test_one_micro_batch_is_the_sum_of_both_sides():
    c = costs(post=Affine(1e-4), latency_s=2e-4)
    step = afd_step(c, 16, 1)
    per_layer = 16e-3 + 1e-4 + 2 * 2e-4 + 16e-3
    assert step.seconds == pytest.approx(4 * per_layer)
    assert step.attention_busy_s == pytest.approx(4 * (16e-3 + 1e-4))
    assert step.expert_busy_s == pytest.approx(4 * 16e-3)


def test_a_balanced_ping_pong_hides_one_side_as_m_grows():
    c = costs()  # attention and experts cost the same per token, nothing else
    one, two, four = (afd_step(c, 64, m).seconds for m in (1, 2, 4))
    assert one == pytest.approx(2 * 4 * 64e-3)
    assert two < one and four < two
    assert four == pytest.approx(4 * 64e-3 + 16e-3)  # one side's work plus the pipeline's fill
    assert afd_step(c, 64, 4).attention_bubble < afd_step(c, 64, 1).attention_bubble


def test_fixed_costs_and_latency_make_more_micro_batches_lose():
    cheap = costs(attention=Affine(0.0, 1e-3), experts=Affine(0.0, 1e-3))
    costly = costs(attention=Affine(5e-3, 1e-4), experts=Affine(5e-3, 1e-4), latency_s=3e-3)
    assert best_micro_batches(cheap, 64) == 4
    assert best_micro_batches(costly, 8) == 1


def test_dense_layers_run_on_the_attention_side_only():
    c = costs(layers=4, moe_layers=3)
    assert afd_step(c, 8, 1).expert_busy_s == pytest.approx(3 * 8e-3)
    with pytest.raises(ValueError):
        afd_step(costs(layers=2, moe_layers=3), 8, 1)


def test_splits_match_the_engine_and_the_plan_gives_experts_to_the_busier_side():
    assert split_tokens(10, 4) == [3, 3, 2, 2] and split_tokens(2, 4) == [1, 1]
    heavy_experts = costs(attention=Affine(0.0, 1e-4), experts=Affine(0.0, 1e-3))
    best = plan_afd(heavy_experts, 32, 4)[0]
    assert (best.attention_workers, best.expert_workers) == (1, 3)
    assert with_ratio(heavy_experts, 2, 1).experts.per_token_s == pytest.approx(2e-3)


def test_a_step_s_own_work_is_paid_once_whatever_m():
    base = costs(post=Affine(1e-4), latency_s=2e-4)
    with_head = dataclasses.replace(base, step=Affine(0.003, 1e-5))
    for m in (1, 2, 4):
        extra = afd_step(with_head, 32, m).seconds - afd_step(base, 32, m).seconds
        assert extra == pytest.approx(0.003 + 32e-5)
    assert AfdCosts.from_dict(with_head.to_dict()) == with_head
    old = {k: v for k, v in base.to_dict().items() if k != "step"}  # a profile from before the step term
    assert AfdCosts.from_dict(old) == base


def test_the_expert_side_prices_the_experts_a_micro_batch_hits():
    c = dataclasses.replace(costs(experts=FREE), per_expert_s=1e-3, num_experts=64, top_k=8)
    assert c.experts_hit(1) == pytest.approx(8)
    assert c.experts_hit(4) == pytest.approx(64 * (1 - (56 / 64) ** 4))  # ~27: fewer than 4 x 8 (overlaps)
    assert c.experts_hit(512) == pytest.approx(64)
    # weight reads make small micro-batches dear: 4 micro-batches of 4 tokens read ~108 experts, 1 of 16 ~57
    assert afd_step(c, 16, 4).expert_busy_s > 1.8 * afd_step(c, 16, 1).expert_busy_s
    assert best_micro_batches(c, 16) == 1
    assert AfdCosts.from_dict(c.to_dict()) == c
    shared = with_ratio(c, 2, 1)  # two attention workers' exchanges each read the experts they hit
    assert shared.per_expert_s == pytest.approx(2e-3)
