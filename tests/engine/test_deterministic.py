"""`--deterministic` on the real default model in bf16: greedy output is identical whatever a request
is batched with (alone, 8, 32), whether its prompt is prefilled whole or in chunks, and with 1 or 2
threads. Without it, bf16 output may differ with batch shape (oneDNN picks kernels by shape); that is
why fp32, not bf16, is the parity oracle's dtype. Colocated vs PD: tests/disagg/test_deterministic_pd.py."""

from __future__ import annotations

import pytest
import torch

from kvbaton import LLM
from kvbaton.kernels.linear import amx_enabled
from kvbaton.platform.compute import choose_compute_plan
from kvbaton.platform.cpu import detect_cpu
from tests.support.budget import release_memory
from tests.support.helpers import deterministic_prompts, greedy

pytestmark = pytest.mark.slow

MAX_NEW = 24


@pytest.fixture(scope="module")
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# this CPU's own row, and the AVX2 machines' (the generic dot kernel), which every x86-64 CPU here runs
ROWS = sorted({choose_compute_plan(detect_cpu(), "bfloat16", amx_granted=amx_enabled()).path, "avx2"})


@pytest.mark.parametrize("path", ROWS)
def test_deterministic_output_is_independent_of_batching_chunking_and_threads(default_model_dir, threads, path):
    llm = LLM(str(default_model_dir), dtype="bfloat16", deterministic=True, num_threads=2, compute_path=path)
    assert llm.engine.core.compute_plan.deterministic
    prompts = deterministic_prompts(llm.engine.model_config.vocab_size, 32)
    alone = [greedy(llm, MAX_NEW, [p])[0] for p in prompts[:8]]
    assert greedy(llm, MAX_NEW, prompts[:8]) == alone
    assert greedy(llm, MAX_NEW, prompts)[:8] == alone  # 32 at once: decodes batched with other prompts' prefill chunks
    del llm  # one default-model engine at a time (the suite's 2 GiB budget)
    release_memory()
    # a 16-token budget: every prompt over 16 tokens is prefilled in chunks, beside other requests' decodes
    chunked = LLM(str(default_model_dir), dtype="bfloat16", deterministic=True, num_threads=1,
                  max_num_batched_tokens=16, enable_prefix_caching=False, compute_path=path)
    assert chunked.engine.core.runner.decode_kernel.num_threads == 1
    assert greedy(chunked, MAX_NEW, prompts[:8]) == alone
