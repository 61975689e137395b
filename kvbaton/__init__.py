"""kvbaton: disaggregated LLM inference that hands the KV cache along like a baton."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from kvbaton.engine.llm import LLM
    from kvbaton.sched.sampling_params import SamplingParams
    from kvbaton.text.request_output import CompletionOutput, RequestOutput

_LAZY = {
    "LLM": "kvbaton.engine.llm",
    "SamplingParams": "kvbaton.sched.sampling_params",
    "RequestOutput": "kvbaton.text.request_output",
    "CompletionOutput": "kvbaton.text.request_output",
}


def __getattr__(name: str) -> Any:
    # NOTE: lazy, so torch-free modules (scheduler, simulator) can be imported without torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvbaton' has no attribute {name!r}")
