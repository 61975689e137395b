"""One configuration the planner weighed: its deployment, its memory plan, and the goodput it simulated to.
(Its own module: the search makes candidates and the disaggregation advice compares two of them.)"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbaton.plan.deployment import DeploymentPlan
from kvbaton.plan.evaluate import Evaluation, Goodput
from kvbaton.plan.memory import MemoryPlan


@dataclass(frozen=True, kw_only=True)
class Candidate:
    deployment: DeploymentPlan
    memory: MemoryPlan
    goodput: Goodput | None  # None: does not fit
    at_target: Evaluation | None = None  # one unit at its share of the QPS on the budget's GPUs

    @property
    def fits(self) -> bool:
        return self.goodput is not None

    @property
    def per_device(self) -> float:
        return self.goodput.per_device if self.goodput else 0.0

    def devices_for(self, qps: float) -> int | None:
        """GPUs that serve `qps` at the target attainment (None: no rate met it)."""
        if not self.goodput or self.goodput.rate <= 0:
            return None
        return math.ceil(qps / self.goodput.rate) * self.deployment.unit_devices

    def units_on(self, devices: int) -> int:
        return devices // self.deployment.unit_devices
