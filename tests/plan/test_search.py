"""Search plumbing that needs no simulation: P:D ratios from the roofline, capacity estimates, fitting."""

from __future__ import annotations

from kvbaton.plan.deployment import DeploymentPlan, Setting
from kvbaton.plan.disaggregation import local_thresholds
from kvbaton.plan.evaluate import Harness, SimOptions
from kvbaton.plan.search import pd_ratios
from kvbaton.plan.workload import Workload
from kvbaton.sim.hardware import hardware_preset
from kvbaton.sim.model_spec import Dtype, KVDtype, model_preset
from kvbaton.sim.roofline import Parallelism

SETTING = Setting(model=model_preset("llama-3-70b"), hardware=hardware_preset("h800-sxm"))
DEP = DeploymentPlan(parallel=Parallelism(4), weight_dtype=Dtype.FP16, kv_dtype=KVDtype.FP16)


def harness(input_len: int, output_len: int) -> Harness:
    load = Workload(qps=10, input_len=input_len, output_len=output_len)
    return Harness.build(SETTING, load, SimOptions(max_requests=4))


def test_pd_ratio_follows_the_prefill_share() -> None:
    long_prompts = pd_ratios(harness(8000, 50), DEP)[0]
    long_answers = pd_ratios(harness(100, 2000), DEP)[0]
    assert long_prompts[0] > long_prompts[1]
    assert long_answers[0] < long_answers[1]


def test_capacity_estimate_orders_parallelisms_per_gpu() -> None:
    h = harness(1500, 300)
    tp4 = h.estimated_capacity(DEP)
    tp4pp2 = h.estimated_capacity(DEP.with_(parallel=Parallelism(4, 2)))
    pd = h.estimated_capacity(DEP.with_(num_prefill=3, num_decode=1))
    assert tp4 / 4 > tp4pp2 / 8  # PP without overlap: the same speed on twice the GPUs
    assert pd > tp4


def test_local_thresholds_split_the_prompt_lengths() -> None:
    assert local_thresholds(Workload(qps=1, input_len=1000, output_len=10, range_ratio=0.5)) == [750, 1000]
