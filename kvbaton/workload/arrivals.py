"""When each request is sent: Poisson (gamma, with burstiness) or constant-rate arrivals, open loop.

Open loop means a request's send time never waits on earlier responses, so a server that falls
behind sees its queue grow, as it would in production. `max_concurrency` (applied by the runner)
is the one closed-loop knob: it caps how many requests are in flight at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvbaton.workload.errors import WorkloadError

ARRIVALS = ("poisson", "constant")


@dataclass(frozen=True)
class ArrivalConfig:
    """A request rate (req/s; inf sends everything at t=0) and how inter-arrival gaps are drawn."""

    request_rate: float = math.inf
    arrival: str = "poisson"
    # Gamma shape of the inter-arrival gaps: 1 is Poisson, < 1 burstier, > 1 smoother.
    burstiness: float = 1.0
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise WorkloadError(f"unknown arrival process {self.arrival!r}; choose one of {', '.join(ARRIVALS)}")
        if not self.request_rate > 0:
            raise WorkloadError("--request-rate must be positive (or inf)")
        if not self.burstiness > 0:
            raise WorkloadError("--burstiness must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise WorkloadError("--max-concurrency must be at least 1")


def arrival_offsets(num_requests: int, cfg: ArrivalConfig, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds after the run starts; the first request goes at 0."""
    if math.isinf(cfg.request_rate):
        return np.zeros(num_requests)
    if cfg.arrival == "constant":
        gaps = np.full(num_requests, 1.0 / cfg.request_rate)
    else:
        # Gamma(k, 1/(k*rate)) keeps the mean gap at 1/rate for every burstiness k.
        gaps = rng.gamma(cfg.burstiness, 1.0 / (cfg.burstiness * cfg.request_rate), num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])
