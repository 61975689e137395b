"""Quantized KV (int8, fp8_e4m3) against bf16 KV, in one run on the default model:

    .venv/bin/python benchmarks/bench_kv_quant.py                 # ~15 min on 2 cores
    .venv/bin/python benchmarks/bench_kv_quant.py --sections attention,capacity

- attention: the C decode-attention kernel over a 4k-token context, 8 requests, reading bf16, int8 and fp8 pools
  (quantized: computed over the codes, each row's scale folded into its score or probability); the peer is
  PyTorch SDPA over the same context as dense bf16 tensors (what HF transformers runs), the roofline is the pool
  bytes read / this machine's read bandwidth.
- decode: the engine's decode step (TPOT) with 4 requests at 4k context, per KV dtype.
- capacity: 4k-token sequences that fit in a 1 GiB pool, per KV dtype.
- quality: on tests/data/kv_quality_text.txt, perplexity and mean KL of the next-token distributions against
  bf16 KV (fp32 compute), and greedy agreement with bf16 KV over 100 prompts x 64 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common.machine import cpu_name
from kvbaton import LLM, SamplingParams
from kvbaton.engine.kv_quality import compare, greedy_agreement, next_token_logprobs
from kvbaton.kernels import paged_decode_kernel
from kvbaton.kernels.kv_quant import quantize_rows
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.pools import torch_dtype

RESULTS = Path(__file__).parent / "results"
TEXT = Path(__file__).parent.parent / "tests" / "data" / "kv_quality_text.txt"
DTYPES = ("bfloat16", "int8", "fp8_e4m3")
HEADS, KV_HEADS, DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16
SECTIONS = ("attention", "decode", "capacity", "quality")


def best_of(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth_gb_s() -> float:
    x = torch.ones(256 * 2**20 // 4)
    return x.numel() * 4 / best_of(lambda: x.sum(), 10) / 1e9


def section_attention(context: int = 4096, batch: int = 8) -> dict:
    nb = context // BLOCK
    torch.manual_seed(0)
    dense = torch.randn(batch * nb * BLOCK, 2, KV_HEADS, DIM)
    table = torch.arange(batch * nb).view(batch, nb).contiguous()
    lens = torch.full((batch,), context)
    q = torch.randn(batch, HEADS, DIM)
    bw = read_bandwidth_gb_s()
    out = {"context": context, "batch": batch, "read_gb_s": bw}
    for name in DTYPES:
        layout = KVLayout.standard(num_layers=1, block_size=BLOCK, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=name)
        storage = torch_dtype(layout)
        pool = dense.to(storage) if name == "bfloat16" else quantize_rows(dense, storage)
        kernel = paged_decode_kernel(storage, HEADS, KV_HEADS, DIM)
        assert kernel is not None, "the C kernels are not built"
        s = best_of(lambda k=kernel, p=pool: k(q, p, table, lens, BLOCK, DIM**-0.5))
        nbytes = pool.numel() * pool.element_size()
        out[name] = {"seconds": s, "bytes": nbytes, "roofline_s": nbytes / (bw * 1e9)}
    k = dense[:, 0].view(batch, nb * BLOCK, KV_HEADS, DIM).transpose(1, 2).to(torch.bfloat16)
    v = dense[:, 1].view(batch, nb * BLOCK, KV_HEADS, DIM).transpose(1, 2).to(torch.bfloat16)
    qq = q.view(batch, HEADS, 1, DIM).to(torch.bfloat16)
    out["sdpa_bf16_s"] = best_of(lambda: F.scaled_dot_product_attention(qq, k, v, enable_gqa=True))
    base = out["bfloat16"]["seconds"]
    for name in DTYPES:
        r = out[name]
        print(f"attention {name}: {r['seconds'] * 1e3:.2f} ms for {batch} x {context} tokens "
              f"({r['bytes'] / 2**20:.0f} MiB read; roofline {r['roofline_s'] * 1e3:.2f} ms), bf16/this "
              f"{base / r['seconds']:.2f}x, SDPA-bf16/this {out['sdpa_bf16_s'] / r['seconds']:.2f}x", flush=True)
    return out


def section_decode(rng: random.Random, context: int = 4096, batch: int = 4, steps: int = 16) -> dict:
    """Steady-state decode: every request's prompt computed first, then `steps` decode steps timed."""
    out = {}
    for name in ("bf16", "int8", "fp8_e4m3"):
        # decode_burst=1: each timed engine step is one model step (a burst would run several)
        llm = LLM(dtype="bfloat16", kv_cache_dtype=name, max_model_len=8192, kv_cache_memory_gb=1.0, decode_burst=1)
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"d{i}", {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(context)]},
                               params)
        produced: set[str] = set()
        while len(produced) < batch:  # prefill (chunked) until every request has its first token
            produced.update(o.request_id for o in engine.step())
        engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        out[name] = {"step_s": (time.perf_counter() - start) / steps}
        while engine.has_unfinished_requests():
            engine.step()
        engine.core.close()
        print(f"decode {name}: {out[name]['step_s'] * 1e3:.1f} ms per step with {batch} requests at {context} tokens",
              flush=True)
    for name in ("int8", "fp8_e4m3"):
        out[name]["speedup"] = out["bf16"]["step_s"] / out[name]["step_s"]
    return out


def section_capacity(context: int = 4096, pool_gib: float = 1.0) -> dict:
    out = {}
    for name in DTYPES:
        layout = KVLayout.standard(num_layers=LAYERS, block_size=BLOCK, num_kv_heads=KV_HEADS, head_dim=DIM,
                                   dtype=name)
        blocks = int(pool_gib * 2**30 // layout.bytes_per_block)
        out[name] = {"bytes_per_token": layout.bytes_per_block // BLOCK, "sequences": blocks // (context // BLOCK)}
        print(f"capacity {name}: {out[name]['bytes_per_token']} B/token, {out[name]['sequences']} sequences of "
              f"{context} tokens in {pool_gib} GiB", flush=True)
    return out


def section_quality(model_dir: Path) -> dict:
    from kvbaton.text.tokenizer import Tokenizer

    ids = Tokenizer(model_dir).encode(TEXT.read_text())
    prompts = [ids[i * 8: i * 8 + 32] for i in range(100)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    def greedy(kind: str) -> list[list[int]]:
        llm = LLM(dtype="float32", kv_cache_dtype=kind)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.engine.core.close()
        return [list(o.outputs[0].token_ids) for o in outs]

    ref_lp, ref_greedy = next_token_logprobs(model_dir, ids, "bf16"), greedy("bf16")
    out = {"text_tokens": len(ids)}
    for kind in ("float32", "int8", "fp8_e4m3"):
        r = compare(model_dir, ids, kind, ref_lp)
        agree, prefix = greedy_agreement(ref_greedy, greedy(kind))
        out[kind] = {"perplexity": r.perplexity, "bf16_perplexity": r.reference_perplexity,
                     "perplexity_delta": r.perplexity_delta, "mean_kl": r.mean_kl, "greedy_agreement": agree,
                     "identical_prefix": prefix}
        print(f"quality {kind}: perplexity {r.perplexity:.3f} vs bf16 KV {r.reference_perplexity:.3f} "
              f"({r.perplexity_delta:+.2%}), KL {r.mean_kl:.5f} nats, greedy agreement {agree:.3f} "
              f"(identical prefix {prefix:.3f}) over 100 x 64", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    from kvbaton.models.registry import pull_default_model

    doc: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "seed": seed, "command": " ".join(sys.argv)}
    print(f"CPU {doc['cpu']} ({doc['cores']} cores), seed {seed}", flush=True)
    if "attention" in sections:
        doc["attention"] = section_attention()
    if "decode" in sections:
        doc["decode"] = section_decode(rng)
    if "capacity" in sections:
        doc["capacity"] = section_capacity()
    if "quality" in sections:
        doc["quality"] = section_quality(pull_default_model())
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    (RESULTS / f"kv-quant-{stamp}.json").write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {RESULTS / f'kv-quant-{stamp}.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
