"""Worked cases `kvbaton plan --example NAME` answers, and `benchmarks/plan_examples.py` commits.

article   the incident of the article this planner was built to answer: 8 nodes x 8 H800 80 GB (200 Gbps RoCE
          between nodes), Llama-3-70B-Instruct in FP16 deployed TP=4 PP=2 colocated (8 instances of 8 GPUs),
          200 QPS of 1,500-token prompts and 300-token answers; observed: P99 TPOT > 120 ms, GPU memory 95%
          full, SM active 22%. The article names no TTFT target; 3 s is this planner's assumption.
llama-3-8b-h100   a plan from scratch: the dense 8B model on H100s, a chat load.
deepseek-v3-h200  a plan from scratch for an MLA + MoE model: DeepSeek-V3 in FP8, as its checkpoint ships (its
          671 B parameters are 1.34 TB in BF16: more than one node of 8 x 141 GB holds, so BF16 would need two
          nodes and PP across them; FP8 fits one node with ~40 GB per GPU left for KV), TP=8 or EP=8 with
          data-parallel attention, on H200s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvbaton.plan.deployment import DEFAULT_SCHEDULER, DeploymentPlan
from kvbaton.plan.diagnose import Observation
from kvbaton.plan.workload import Workload
from kvbaton.sim.model_spec import Dtype, KVDtype
from kvbaton.sim.roofline import Parallelism


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    title: str
    model: str  # a preset name or a config.json path
    hardware: str
    devices: int | None  # GPUs available (None: as many as the load needs)
    deployment: DeploymentPlan  # the current deployment (diagnosed), or the base of the search
    workload: Workload
    kv_link: str = "roce200"  # between nodes: PD's KV transfers
    observation: Observation | None = None  # set: diagnose the deployment as it runs; None: plan from scratch
    tps: tuple[int, ...] = (1, 2, 4, 8)
    pps: tuple[int, ...] = (1, 2)
    search_pd: bool = True
    try_ep: bool = True
    notes: tuple[str, ...] = field(default_factory=tuple)


ARTICLE = Scenario(
    name="article", title="Llama-3-70B FP16 on 8 x 8 H800, TP=4 PP=2, 200 QPS, 1,500 in / 300 out",
    model="llama-3-70b", hardware="h800-sxm", devices=64,
    deployment=DeploymentPlan(parallel=Parallelism(tp=4, pp=2), weight_dtype=Dtype.FP16, kv_dtype=KVDtype.FP16,
                          scheduler=DEFAULT_SCHEDULER),
    workload=Workload(qps=200, input_len=1500, output_len=300, slo_ttft_ms=3000, slo_tpot_ms=120),
    observation=Observation(tpot_p99_ms=120, memory_used=0.95, sm_active=0.22),
    notes=("SLO: TPOT p99 <= 120 ms (the line the article's deployment crosses), TTFT p99 <= 3 s (assumed).",))

LLAMA3_8B_H100 = Scenario(
    name="llama-3-8b-h100", title="Llama-3-8B BF16 on H100, 100 QPS, 1,024 in / 256 out (range 0.5)",
    model="llama-3-8b", hardware="h100-sxm", devices=16,
    deployment=DeploymentPlan(parallel=Parallelism(), weight_dtype=Dtype.BF16, kv_dtype=KVDtype.BF16),
    workload=Workload(qps=100, input_len=1024, output_len=256, range_ratio=0.5, slo_ttft_ms=1000, slo_tpot_ms=50),
    tps=(1, 2, 4), pps=(1,))

DEEPSEEK_V3_H200 = Scenario(
    name="deepseek-v3-h200", title="DeepSeek-V3 FP8 (MLA, 256 experts) on H200, 20 QPS, 2,000 in / 500 out",
    model="deepseek-v3", hardware="h200", devices=32,
    deployment=DeploymentPlan(parallel=Parallelism(tp=8), weight_dtype=Dtype.FP8, kv_dtype=KVDtype.BF16),
    workload=Workload(qps=20, input_len=2000, output_len=500, slo_ttft_ms=5000, slo_tpot_ms=100),
    tps=(8,), pps=(1, 2),
    notes=("FP8 weights (as the checkpoint ships): 671 GB, 84 GB per GPU at 8 GPUs; BF16 would need 16 GPUs.",))

EXAMPLES: Mapping[str, Scenario] = MappingProxyType({s.name: s for s in (ARTICLE, LLAMA3_8B_H100, DEEPSEEK_V3_H200)})
