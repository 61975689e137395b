"""Colocated, PD, or PD with local prefill of short prompts: decided by simulating the workload each way.

Conditional PD (short prompts prefill on their decode instance, long ones on a prefill instance) is tried
only when prompts vary (a length range, or shared prefixes whose cached part needs no prefill): with one
fixed prompt length a threshold sends every request the same way, which is plain PD or colocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvbaton.plan.candidate import Candidate
from kvbaton.plan.evaluate import Harness
from kvbaton.plan.workload import Workload

PD_MARGIN = 1.05  # PD must beat colocated by 5% of goodput per GPU: it costs a KV transfer path to run


class DisaggregationMode(str, Enum):
    COLOCATED = "colocated"
    PD = "pd"
    CONDITIONAL_PD = "conditional-pd"


@dataclass(frozen=True, kw_only=True)
class DisaggregationAdvice:
    mode: DisaggregationMode
    local_prefill_threshold: int | None  # conditional PD: prompts with fewer uncached tokens stay local
    colocated_per_device: float  # goodput per GPU of the best of each kind
    pd_per_device: float
    conditional_per_device: float
    colocated_label: str
    pd_label: str | None

    @property
    def reason(self) -> str:
        figures = (f"goodput per GPU: colocated {self.colocated_per_device:.3f} ({self.colocated_label}), "
                   f"PD {self.pd_per_device:.3f} ({self.pd_label or 'not tried'})")
        if self.conditional_per_device:
            figures += f", conditional PD {self.conditional_per_device:.3f}"
        return figures


def recommend_disaggregation(harness: Harness, colocated: Candidate, pd: Candidate | None) -> DisaggregationAdvice:
    load = harness.load
    col, pd_value = colocated.per_device, pd.per_device if pd else 0.0
    threshold, conditional = None, 0.0
    if pd is not None and (load.range_ratio > 0 or load.prefix_len > 0):
        for t in local_thresholds(load):
            value = harness.goodput(pd.deployment.with_(local_prefill_threshold=t)).per_device
            if value > conditional:
                threshold, conditional = t, value
    best_split = max(pd_value, conditional)
    if best_split <= col * PD_MARGIN:
        mode = DisaggregationMode.COLOCATED
    elif conditional > pd_value:
        mode = DisaggregationMode.CONDITIONAL_PD
    else:
        mode = DisaggregationMode.PD
    return DisaggregationAdvice(mode=mode, local_prefill_threshold=threshold if mode is
                                DisaggregationMode.CONDITIONAL_PD else None, colocated_per_device=col,
                                pd_per_device=pd_value, conditional_per_device=conditional,
                                colocated_label=colocated.deployment.label,
                                pd_label=pd.deployment.label if pd else None)


def local_thresholds(load: Workload) -> list[int]:
    """Uncached-prompt lengths to split at: the lower quartile and the median of the prompts' new tokens."""
    low = load.input_len * (1 - load.range_ratio / 2)
    return sorted({max(65, round(low)), max(65, load.input_len)})
