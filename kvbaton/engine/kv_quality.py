"""What KV quantization costs in model quality, on a fixed text: perplexity and the KL divergence of the
next-token distributions against a reference KV dtype (teacher-forced, in chunks, so every chunk attends over
context read back from the quantized pool), and greedy agreement over many prompts.

The model computes in float32 for every KV dtype, so only the KV cache's precision differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbaton.config import CacheConfig, EngineConfig
from kvbaton.engine.core import EngineCore
from kvbaton.sched.outputs import ScheduledRequest
from kvbaton.sched.sampling_params import SamplingParams

KL_ROWS = 128  # positions per block of the KL sum


@dataclass(frozen=True)
class QualityReport:
    kv_cache_dtype: str
    perplexity: float
    reference_perplexity: float
    mean_kl: float  # nats per position, reference || quantized

    @property
    def perplexity_delta(self) -> float:
        """Relative: 0.005 is 0.5% worse than the reference."""
        return self.perplexity / self.reference_perplexity - 1.0


def _core(model_dir: Path, kv_cache_dtype: str, num_tokens: int, block_size: int = 16) -> EngineCore:
    blocks = -(-num_tokens // block_size) + 1
    config = EngineConfig(model=str(model_dir), dtype="float32",
                          cache=CacheConfig(block_size=block_size, num_blocks=blocks, kv_cache_dtype=kv_cache_dtype))
    return EngineCore(config, model_dir, eos_token_ids=())


@torch.inference_mode()
def next_token_logprobs(model_dir: Path, token_ids: list[int], kv_cache_dtype: str, chunk: int = 64) -> torch.Tensor:
    """[len - 1, vocab] float32 log-probabilities of each next token, computed `chunk` tokens per forward."""
    core = _core(model_dir, kv_cache_dtype, len(token_ids))
    runner = core.runner
    block_ids = list(range(core.info.num_blocks))
    out: torch.Tensor | None = None  # filled in place: one [len, vocab] tensor (~200 MB here), never a second copy
    for start in range(0, len(token_ids), chunk):
        piece = token_ids[start:start + chunk]
        s = ScheduledRequest(request_id="quality", token_ids=piece, start_position=start, block_ids=block_ids,
                             sample=True, sampling_params=SamplingParams(), num_output_tokens=0)
        inputs = runner.prepare_inputs([s])
        logits = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta,
                              torch.arange(len(piece)))
        if out is None:
            out = torch.empty(len(token_ids), logits.shape[-1], dtype=torch.float32)
        torch.log_softmax(logits.float(), dim=-1, out=out[start:start + len(piece)])
    core.close()
    assert out is not None, "no tokens"
    return out[:-1]


def compare(model_dir: Path, token_ids: list[int], kv_cache_dtype: str, reference: torch.Tensor,
            reference_dtype: str = "bf16") -> QualityReport:
    """`reference`: next_token_logprobs of the same text under `reference_dtype`."""
    logprobs = next_token_logprobs(model_dir, token_ids, kv_cache_dtype)
    targets = torch.tensor(token_ids[1:])
    nll = -logprobs.gather(1, targets[:, None]).mean().item()
    ref_nll = -reference.gather(1, targets[:, None]).mean().item()
    # KL over row blocks: whole, its three [len, vocab] temporaries would triple the peak memory
    kl = sum((ref.exp() * (ref - lp)).sum().item()
             for ref, lp in zip(reference.split(KL_ROWS), logprobs.split(KL_ROWS))) / len(targets)
    return QualityReport(kv_cache_dtype, math.exp(nll), math.exp(ref_nll), kl)


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(fraction of positions with the same token, mean length of the identical prefix as a fraction)."""
    same = sum(a == b for r, o in zip(reference, other) for a, b in zip(r, o))
    total = sum(len(r) for r in reference)
    prefix = 0.0
    for r, o in zip(reference, other):
        n = next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), min(len(r), len(o)))
        prefix += n / max(len(r), 1)
    return same / max(total, 1), prefix / max(len(reference), 1)
