"""RooflineLatency: the StepLatencyModel contract, and the roofline's arithmetic on known cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.config import ConfigError
from kvbaton.sim.hardware import HARDWARE_PRESETS, hardware_preset
from kvbaton.sim.latency import StepLatencyModel, StepShape
from kvbaton.sim.model_spec import Dtype, KVDtype, model_preset
from kvbaton.sim.roofline import Parallelism, RooflineLatency, expected_experts_hit

LLAMA_70B = model_preset("llama-3-70b")
H800 = hardware_preset("h800-sxm")
MODELS = {
    "dense-tp4-pp2": RooflineLatency(model=LLAMA_70B, hardware=H800, parallel=Parallelism(4, 2),
                                     weight_dtype=Dtype.FP16, kv_dtype=KVDtype.FP16),
    "moe-ep8": RooflineLatency(model=model_preset("deepseek-v3"), hardware=hardware_preset("h200"),
                               parallel=Parallelism(8, 1, ep=8), weight_dtype=Dtype.FP8),
    "moe-tp2": RooflineLatency(model=model_preset("qwen3-30b-a3b"), hardware=hardware_preset("a100-80gb"),
                               parallel=Parallelism(2)),
    "cpu": RooflineLatency(model=model_preset("smollm2-135m"), hardware=hardware_preset("xeon-amx-2vcpu")),
}
FIELDS = ("prefill_tokens", "prefill_seqs", "prefill_attended", "decode_seqs", "decode_context")
shapes = st.builds(StepShape, st.integers(0, 20_000), st.integers(0, 64), st.integers(0, 10**8),
                   st.integers(0, 1024), st.integers(0, 10**7))


def test_is_a_step_latency_model() -> None:
    model: StepLatencyModel = MODELS["dense-tp4-pp2"]
    assert "TP4 PP2" in model.name


@pytest.mark.parametrize("key", list(MODELS))
@settings(max_examples=60, deadline=None)
@given(shape=shapes, field=st.sampled_from(FIELDS), extra=st.integers(1, 5000))
def test_deterministic_positive_and_monotone(key: str, shape: StepShape, field: str, extra: int) -> None:
    model = MODELS[key]
    seconds = model.step_seconds(shape)
    assert seconds == model.step_seconds(StepShape(**{f: getattr(shape, f) for f in FIELDS}))
    assert seconds > 0
    bigger = StepShape(**{f: getattr(shape, f) + (extra if f == field else 0) for f in FIELDS})
    assert model.step_seconds(bigger) >= seconds


def test_decode_is_memory_bound_and_reads_the_weights_once() -> None:
    model = MODELS["dense-tp4-pp2"]
    costs = model.costs(StepShape(decode_seqs=1, decode_context=1000))
    assert costs.memory_s > costs.compute_s
    # a GPU reads its 1/4 of each stage's weights, stages in turn: 141 GB / 4 over 3.35 TB/s x 0.8, ~13 ms
    weights_per_gpu_summed = LLAMA_70B.weight_bytes(Dtype.FP16) / 4
    assert costs.memory_s == pytest.approx(weights_per_gpu_summed / (3.35e12 * 0.8), rel=0.02)


def test_prefill_is_compute_bound() -> None:
    model = MODELS["dense-tp4-pp2"]
    costs = model.costs(StepShape(prefill_tokens=8192, prefill_seqs=1, prefill_attended=8192 * 4096))
    assert costs.compute_s > costs.memory_s
    flops = 2 * LLAMA_70B.active_params * 8192  # the attention and LM head add a few percent
    assert costs.compute_s == pytest.approx(flops / (4 * 989.4e12 * 0.5), rel=0.1)


def test_pp_adds_no_speed_tp_does() -> None:
    shape = StepShape(prefill_tokens=4096, prefill_seqs=1, prefill_attended=4096 * 2048)
    kw = dict(model=LLAMA_70B, hardware=H800, weight_dtype=Dtype.FP16)
    tp4, tp4pp2, tp8 = (RooflineLatency(parallel=p, **kw).step_seconds(shape)  # type: ignore[arg-type]
                        for p in (Parallelism(4), Parallelism(4, 2), Parallelism(8)))
    assert tp4pp2 > tp4 > tp8


def test_expected_experts_hit() -> None:
    assert expected_experts_hit(256, 8, 1) == pytest.approx(8)
    assert expected_experts_hit(256, 8, 10_000) == pytest.approx(256)
    assert expected_experts_hit(8, 2, 0) == 0


def test_kv_split_by_tp_unless_replicated() -> None:
    llama = RooflineLatency(model=LLAMA_70B, hardware=H800, parallel=Parallelism(4, 2), kv_dtype=KVDtype.FP16)
    assert llama.kv_bytes_per_token_per_device() == 327_680 / 8
    mla_tp = RooflineLatency(model=model_preset("deepseek-v3"), hardware=H800, parallel=Parallelism(8))
    mla_dp = RooflineLatency(model=model_preset("deepseek-v3"), hardware=H800, parallel=Parallelism(8, ep=8))
    assert mla_tp.kv_bytes_per_token_per_device() == 70_272  # the latent is replicated on every TP rank
    assert mla_dp.kv_bytes_per_token_per_device() == 70_272 / 8  # attention-DP: each GPU its own sequences


def test_bad_parallelism() -> None:
    with pytest.raises(ConfigError, match="exceeds a node"):
        RooflineLatency(model=LLAMA_70B, hardware=H800, parallel=Parallelism(16))
    with pytest.raises(ConfigError, match="needs an MoE model"):
        RooflineLatency(model=LLAMA_70B, hardware=H800, parallel=Parallelism(4, ep=4))
    with pytest.raises(ConfigError, match="ep must be 1 or equal to tp"):
        Parallelism(4, ep=2)


def test_presets() -> None:
    assert HARDWARE_PRESETS["h800-sxm"].bf16_flops == HARDWARE_PRESETS["h100-sxm"].bf16_flops
    assert HARDWARE_PRESETS["h800-sxm"].link_bandwidth < HARDWARE_PRESETS["h100-sxm"].link_bandwidth
    with pytest.raises(ConfigError, match="unknown hardware"):
        hardware_preset("tpu")
