"""Memory math: weights, KV pool and sequences per instance, checked against figures written out here."""

from __future__ import annotations

import pytest

from kvbaton.config import SchedulerConfig
from kvbaton.plan.memory import plan_memory, weight_bytes_per_device
from kvbaton.sim.hardware import hardware_preset
from kvbaton.sim.model_spec import Dtype, KVDtype, model_preset
from kvbaton.sim.roofline import Parallelism

SCHED = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)


def test_article_memory_math() -> None:
    m, hw = model_preset("llama-3-70b"), hardware_preset("h800-sxm")
    plan = plan_memory(m, hw, Parallelism(4, 2), weight_dtype=Dtype.FP16, kv_dtype=KVDtype.FP16, scheduler=SCHED)
    assert plan.weight_bytes == pytest.approx(141.1e9 / 8, rel=0.01)  # ~17.6 GB
    assert plan.kv_bytes_per_token_per_device == 327_680 / 8  # 2 of 8 KV heads, 40 of 80 layers
    pool = hw.memory_bytes * 0.9 - plan.weight_bytes - plan.reserve_bytes
    assert plan.kv_pool_bytes == pytest.approx(pool)
    tokens = int(pool // 40_960) // 16 * 16
    assert plan.kv_tokens == tokens
    assert plan.max_seqs(1800) == tokens // 16 // 113  # 1,800 tokens take 113 blocks of 16
    assert plan.kv_pool_bytes_per_instance == pytest.approx(8 * pool)


def test_fp8_kv_doubles_the_sequences() -> None:
    m, hw = model_preset("llama-3-70b"), hardware_preset("h800-sxm")
    kw = dict(weight_dtype=Dtype.FP16, scheduler=SCHED)
    fp16 = plan_memory(m, hw, Parallelism(8), kv_dtype=KVDtype.FP16, **kw)  # type: ignore[arg-type]
    fp8 = plan_memory(m, hw, Parallelism(8), kv_dtype=KVDtype.FP8, **kw)  # type: ignore[arg-type]
    assert fp8.max_seqs(1800) == pytest.approx(2 * fp16.max_seqs(1800), abs=1)


def test_what_does_not_fit() -> None:
    m, hw = model_preset("llama-3-70b"), hardware_preset("h100-sxm")
    one = plan_memory(m, hw, Parallelism(1), weight_dtype=Dtype.FP16, kv_dtype=KVDtype.FP16, scheduler=SCHED)
    assert one.kv_pool_bytes < 0 and one.num_blocks == 0 and not one.fits(1800)


def test_attention_dp_replicates_the_non_expert_weights() -> None:
    m = model_preset("deepseek-v3")
    tp = weight_bytes_per_device(m, Parallelism(8), Dtype.FP8)
    dp = weight_bytes_per_device(m, Parallelism(8, ep=8), Dtype.FP8)
    assert tp == pytest.approx(m.total_params / 8)
    assert dp == pytest.approx(m.shared_params + m.routed_expert_params / 8)
    assert dp > tp
