"""The load a plan must serve: request rate, prompt and output lengths, the SLOs and the attainment target.

Simulated requests come from the bench's own generators (`kvbaton.sim.workload.synthetic_requests`): word
prompts hashed to token ids, so shared prefixes hit the simulated prefix cache as they hit the real one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvbaton.config import ConfigError
from kvbaton.sim.spec import SimRequest
from kvbaton.sim.workload import synthetic_requests
from kvbaton.workload.arrivals import ArrivalConfig
from kvbaton.workload.datasets import DatasetConfig
from kvbaton.workload.errors import WorkloadError
from kvbaton.workload.metrics import SLO


@dataclass(frozen=True, kw_only=True)
class Workload:
    qps: float  # the whole deployment's request rate
    input_len: int  # mean prompt tokens (after the shared prefix, when there is one)
    output_len: int
    range_ratio: float = 0.0  # lengths uniform in [L(1-r), L(1+r)]
    prefix_len: int = 0  # > 0: every prompt starts with one of `num_prefixes` shared prefixes of this length
    num_prefixes: int = 4
    slo_ttft_ms: float = 3000.0  # per request; `attainment_target` of the requests must meet both
    slo_tpot_ms: float = 100.0
    attainment_target: float = 0.9  # the fraction of requests that must meet both

    def __post_init__(self) -> None:
        if not (math.isfinite(self.qps) and self.qps > 0):
            raise ConfigError(f"--qps must be a positive number, not {self.qps}")
        if min(self.input_len, self.output_len, self.num_prefixes) < 1 or self.prefix_len < 0:
            raise ConfigError("input and output lengths must be at least 1 (and the prefix length >= 0)")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ConfigError("--range-ratio must be in [0, 1)")
        if not (self.slo_ttft_ms > 0 and self.slo_tpot_ms > 0):
            raise ConfigError("SLO targets must be positive")
        if not 0.0 < self.attainment_target <= 1.0:
            raise ConfigError("--attainment must be in (0, 1]")

    @property
    def slo(self) -> SLO:
        return SLO(self.slo_ttft_ms, self.slo_tpot_ms)

    @property
    def mean_prompt_len(self) -> int:
        return self.prefix_len + self.input_len

    @property
    def mean_seq_len(self) -> int:
        """Tokens one request holds in the KV cache when it finishes: prompt + output."""
        return self.mean_prompt_len + self.output_len

    @property
    def max_seq_len(self) -> int:
        grow = 1 + self.range_ratio
        return self.prefix_len + math.ceil(self.input_len * grow) + math.ceil(self.output_len * grow)

    def dataset(self, num_prompts: int) -> DatasetConfig:
        name = "shared-prefix" if self.prefix_len else "random"
        try:
            return DatasetConfig(name=name, num_prompts=num_prompts, input_len=self.input_len,
                                 output_len=self.output_len, range_ratio=self.range_ratio,
                                 num_prefixes=self.num_prefixes, prefix_len=max(self.prefix_len, 1))
        except WorkloadError as exc:
            raise ConfigError(str(exc)) from exc

    def pool(self, size: int, seed: int) -> RequestPool:
        """`size` requests arriving at 1 request/s; `RequestPool.at` rescales them to any rate."""
        return RequestPool(tuple(synthetic_requests(self.dataset(size), ArrivalConfig(request_rate=1.0), seed)))


@dataclass(frozen=True)
class RequestPool:
    """One seeded set of requests shared by every rate and configuration a plan simulates.

    NOTE: Poisson (gamma) gaps scale exactly with 1/rate for the same draws, so dividing unit-rate arrival
    times by `rate` is the bench's own arrival process at that rate, and every configuration sees the very
    same prompts in the same order (common random numbers: differences between configurations are theirs,
    not the dataset's); generating word prompts costs more than simulating them, so this is also faster."""

    unit_rate: tuple[SimRequest, ...]

    def at(self, rate: float, count: int) -> list[SimRequest]:
        return [replace(r, arrival_s=r.arrival_s / rate) for r in self.unit_rate[:count]]
