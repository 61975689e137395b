"""The engines measured inside a worker process: kvbaton's `LLM` and HF `generate` (and the
machine's bandwidth, measured alone in a process of its own too)."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from functools import cache, partial
from typing import Any

from common.log import log
from common.machine import measure_bandwidth, read_gb_s_now
from common.prompts import make_prompts
from common.records import Bandwidth, Latency, Throughput, WorkerRun
from engine_bench.measure import PROBE_N, PROBE_OUT, best_of, latency_summary, log_latency, throughput_skip


def worker_bandwidth(args: argparse.Namespace) -> Bandwidth:
    return measure_bandwidth(args.sizes.bw_mb, args.threads)


def _paired(measure: Callable[[], Latency], probe: Any) -> Latency:
    """`measure()` with the read bandwidth taken just before and just after it (`probe`: a large tensor)."""
    before = read_gb_s_now(probe)
    latency = measure()
    return dataclasses.replace(latency, read_gb_s_around=(before, read_gb_s_now(probe)))


def _kvbaton_latency(llm: Any, prompt: list[int], out_len: int, rid: str) -> Latency:
    from kvbaton import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    stamps: list[float] = []
    n = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id == rid:
                k = len(out.outputs[0].token_ids)
                stamps.extend([now] * (k - n))  # first step with a token = prefill
                n = k
    return latency_summary(t0, stamps, n, len(prompt))


def worker_kvbaton(args: argparse.Namespace) -> WorkerRun:
    import torch

    import kvbaton
    from kvbaton import LLM, SamplingParams

    s = args.sizes
    t = time.perf_counter()
    llm = LLM(args.model_dir, dtype=args.dtype, num_threads=args.threads, compile=args.compile,
              max_model_len=2048, kv_cache_memory_gb=4.0, compute_path=args.compute_path,
              deterministic=args._deterministic)
    load_s = time.perf_counter() - t
    # NOTE: as a served worker does (and vLLM, whose pools are zeroed at start): else the first steps to reach a
    # block pay its pages' first-touch faults (~25 ms of a 512-token prefill on Zen 4, with 5 ms THP stalls)
    llm.engine.core.prefault_kv_pools()
    vocab = llm.engine.model_config.vocab_size
    plan = llm.engine.core.compute_plan.summary()
    log(f"kvbaton compute path: {plan}")
    tag = f"kvbaton-{args.dtype}-{args.compile}-{args._deterministic}"

    t = time.perf_counter()
    _kvbaton_latency(llm, make_prompts(args.seed, f"{tag}-warm", 1, s.prompt_len, vocab)[0], 8, "warm")
    probe_s = None
    if args.tp:
        warm = make_prompts(args.seed, f"{tag}-warmbatch", PROBE_N, s.prompt_len, vocab)
        t_probe = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(max_tokens=PROBE_OUT, ignore_eos=True))
        probe_s = time.perf_counter() - t_probe
    warmup_s = time.perf_counter() - t
    log(f"kvbaton {args.dtype} compile={args.compile}: loaded in {load_s:.1f}s, warm-up {warmup_s:.1f}s")

    prompts = make_prompts(args.seed, "latency", s.latency_repeats, s.prompt_len, vocab)
    probe = torch.ones(s.bw_mb * 2**20 // 4)
    latency = best_of([_paired(partial(_kvbaton_latency, llm, p, s.out_len, f"lat-{i}"), probe)
                       for i, p in enumerate(prompts)])
    del probe
    log_latency("kvbaton", latency)

    def offline() -> Throughput:
        prompts = make_prompts(args.seed, "throughput", s.tp_prompts, s.prompt_len, vocab)
        params = SamplingParams(temperature=0.0, max_tokens=s.out_len, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        elapsed = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        log(f"kvbaton throughput: {n_out / elapsed:.1f} output tok/s")
        return Throughput(elapsed_s=elapsed, output_tokens=n_out, output_tok_s=n_out / elapsed,
                          total_tok_s=(n_out + s.tp_prompts * s.prompt_len) / elapsed,
                          preemptions=llm.engine.stats().num_preemptions)

    return WorkerRun(load_s=load_s, torch_threads=torch.get_num_threads(), version=kvbaton.__version__,
                     compile=args.compile, compute_path=plan, probe_s=probe_s, warmup_s=warmup_s, latency=latency,
                     throughput=throughput_skip(args, latency, probe_s) or offline())


@cache
def hf_stamps() -> type:
    """A transformers streamer class that stamps each generated token as it arrives (generate() puts the prompt
    first: skipped)."""
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value: Any) -> None:
            if not self.prompt_seen:  # generate() first puts the prompt
                self.prompt_seen = True
                return
            self.times.extend([time.perf_counter()] * value.numel())

        def end(self) -> None:
            pass

    return Stamps


def hf_one(model: Any, prompt: list[int], out_len: int, pad_id: int) -> Latency:
    """One greedy `generate` of `out_len` tokens, each token stamped by a streamer."""
    import torch

    ids = torch.tensor([prompt])
    streamer = hf_stamps()()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                       min_new_tokens=out_len, do_sample=False, streamer=streamer, pad_token_id=pad_id)
    return latency_summary(t0, streamer.times, len(streamer.times), len(prompt))


def hf_batch(model: Any, prompts: list[list[int]], out_len: int, pad_id: int) -> tuple[float, int]:
    """One batched greedy `generate` (left padding): its seconds and output tokens."""
    import torch

    width = max(map(len, prompts))  # left padding (a no-op when all prompts are equally long)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_len,
                             min_new_tokens=out_len, do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t0, int(out[:, width:].numel())


def worker_hf(args: argparse.Namespace) -> WorkerRun:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    s = args.sizes
    torch.set_num_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).eval()
    load_s = time.perf_counter() - t
    vocab = model.config.vocab_size
    pad_id = 2

    def offline() -> Throughput:
        prompts = make_prompts(args.seed, "throughput", s.tp_prompts, s.prompt_len, vocab)
        elapsed, n_out = hf_batch(model, prompts, s.out_len, pad_id)
        log(f"hf throughput: {n_out / elapsed:.1f} output tok/s")
        return Throughput(elapsed_s=elapsed, output_tokens=n_out, output_tok_s=n_out / elapsed,
                          total_tok_s=(n_out + s.tp_prompts * s.prompt_len) / elapsed)

    t = time.perf_counter()
    hf_one(model, make_prompts(args.seed, "hf-warm", 1, s.prompt_len, vocab)[0], 8, pad_id)
    probe_s, _ = hf_batch(model, make_prompts(args.seed, "hf-warmbatch", PROBE_N, s.prompt_len, vocab), PROBE_OUT,
                          pad_id)
    warmup_s = time.perf_counter() - t
    latency = best_of([hf_one(model, p, s.out_len, pad_id)
                       for p in make_prompts(args.seed, "latency", s.latency_repeats, s.prompt_len, vocab)])
    log_latency("hf", latency)
    return WorkerRun(load_s=load_s, torch_threads=torch.get_num_threads(), version=transformers.__version__,
                     attn_implementation=model.config._attn_implementation, probe_s=probe_s, warmup_s=warmup_s,
                     latency=latency, throughput=throughput_skip(args, latency, probe_s) or offline())


WORKERS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "bandwidth": worker_bandwidth, "kvbaton": worker_kvbaton, "hf": worker_hf}
