"""kvbaton: disaggregated LLM inference that hands the KV cache along like a baton."""

from kvbaton.engine.llm import LLM
from kvbaton.engine.request_output import CompletionOutput, RequestOutput
from kvbaton.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
