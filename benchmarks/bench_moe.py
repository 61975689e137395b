#!/usr/bin/env python
"""MoE prefill and decode: kvbaton (its C experts kernel, and its PyTorch expert loop) against transformers
and llama.cpp on the same weights, in one run.

Model: a random-weight Qwen3-MoE built here with transformers (bf16, cached under the kvbaton cache): 8
layers, hidden 768, 64 experts of intermediate 384, top-8, 12 query / 4 KV heads of 64, tied embeddings,
the default model's vocabulary and tokenizer (SmolLM2-135M-Instruct, 49152 tokens): ~0.5 B parameters,
~70 M of them active per token (attention + 8 experts per layer) besides the 38 M of the embedding / LM head.

Measured, every engine in its own process with the same thread count (2) and bf16 weights:
- prefill tok/s: one fresh 512-token random prompt (median of 3);
- batch-1 decode ms/step: 64 tokens after a 512-token prompt (median step; llama-bench: the median of its 3
  runs' mean);
- batch-32 decode ms/step: 32 fresh 128-token prompts, then 32 steps decoding all of them (median step);
for kvbaton (engine, default compute path: the C kernel), kvbaton with KVBATON_MOE_KERNEL=0 (PyTorch's loop
over the hit experts), transformers (its model forward and KV cache, in its default experts implementation
grouped_mm and in eager; a greedy loop, so only the forward is timed), and llama.cpp on the same weights
converted to a bf16 GGUF (`llama-bench -p 512 -n 0`, `-p 0 -n 64 -d 512`; `llama-batched-bench -npp 128
-ntg 32 -npl 32`, built in the peers' llama.cpp build directory with `cmake --build build --target
llama-batched-bench`).

Roofline: the bytes of the weights a decode step must read, at the read bandwidth measured here (torch sum):
batch 1: attention, norms and router of every layer, top-8 experts' matrices per layer, the LM head (tied:
the embedding) and one embedding row; batch 32: the same with the union of the experts the 32 tokens hit
(counted in kvbaton's run). KV bytes are left out (~4 MB at 512 tokens of context, ~2%).

    .venv/bin/python benchmarks/bench_moe.py                  # ~8 min (the first run builds the model and GGUF)
    .venv/bin/python benchmarks/bench_moe.py --engines kvbaton,kvbaton-torch

Results: benchmarks/results/moe-<stamp>.json and benchmarks/results/moe.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.contention import LoadMonitor, OverlapWatch, note_load, take_lock, wait_foreign, wait_idle
from common.log import log
from common.machine import environment, measure_bandwidth
from common.peers import Peers, add_peer_args, resolve_peers
from common.procs import thread_env
from common.prompts import fresh_seed, make_prompts
from common.report import RESULTS_DIR, ResultFiles, command_line, fmt, notes_section, ratio, stamp
from common.workers import WorkerFailed, run_worker, worker_main

ENGINES = ("kvbaton", "kvbaton-torch", "hf", "hf-eager", "llamacpp")
LABELS = {"kvbaton": "kvbaton (C experts kernel)", "kvbaton-torch": "kvbaton (PyTorch expert loop)",
          "hf": "transformers (grouped_mm experts, its default)", "hf-eager": "transformers (eager experts)",
          "llamacpp": "llama.cpp"}
SHAPE = dict(vocab_size=49152, hidden_size=768, intermediate_size=2048, moe_intermediate_size=384,
             num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_experts=64,
             num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
             tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-6)
MODEL_NAME = "qwen3-moe-bench-64x384-h768-l8"
TOKENIZER_FROM = "SmolLM2-135M-Instruct"  # the default model: its vocabulary and tokenizer
PREFILL_LEN, DECODE_PROMPT, DECODE_STEPS = 512, 512, 64
BATCH, BATCH_PROMPT, BATCH_STEPS = 32, 128, 32
PREFILL_REPEATS = 3
FOREIGN = "benchmarks/bench_"  # other benchmark processes this run waits for, and records if they overlap it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {','.join(ENGINES)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: fresh, printed)")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help=f"where the random-weight model is built (default: <kvbaton cache>/bench/{MODEL_NAME})")
    ap.add_argument("--wait-idle", type=float, default=120, help="before each engine, wait up to S s for quiet")
    ap.add_argument("--worker-timeout-s", type=float, default=600)
    ap.add_argument("--wait-lock", type=float, default=3600, help="wait up to S s for the benchmarks' run lock")
    ap.add_argument("--wait-foreign", type=float, default=3600,
                    help="before each engine, wait up to S s while another benchmarks/bench_*.py runs")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    add_peer_args(ap)
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---- the model ----------------------------------------------------------------------------------------------


def default_model_dir() -> Path:
    from kvbaton.paths import cache_root

    return cache_root() / "bench" / MODEL_NAME


def build_model(out: Path) -> Path:
    """The random-weight Qwen3-MoE (bf16 safetensors) with the default model's tokenizer; built once."""
    if (out / "config.json").exists() and list(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from kvbaton.paths import models_dir

    src = models_dir() / TOKENIZER_FROM
    if not (src / "tokenizer.json").exists():
        raise SystemExit(f"{src} has no tokenizer.json: fetch the default model first (kvbaton pulls it on first use)")
    tok_cfg = json.loads((src / "config.json").read_text())
    log(f"building the random-weight MoE in {out}")
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**SHAPE, bos_token_id=tok_cfg.get("bos_token_id"), eos_token_id=tok_cfg.get("eos_token_id"),
                         pad_token_id=tok_cfg.get("pad_token_id"))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "vocab.json", "merges.txt"):
        if (src / name).exists():
            shutil.copy(src / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def num_experts(cfg: dict[str, Any]) -> int:
    return int(cfg.get("num_experts") or cfg["num_local_experts"])  # transformers 5 writes the latter


def weight_bytes(model_dir: Path, experts_hit_per_layer: float) -> dict[str, float]:
    """Bytes of weights one decode step reads (bf16): everything but the experts, `experts_hit_per_layer`
    experts' three matrices per layer, one embedding row (the LM head is the tied embedding)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, layers, e_inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["moe_intermediate_size"]
    head_dim, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2 + 2 * head_dim  # q, o, k, v, q/k norms
    per_layer = attn + num_experts(cfg) * h + 2 * h  # + router, two norms
    expert = 3 * h * e_inter
    lm_head = cfg["vocab_size"] * h
    elems = layers * (per_layer + experts_hit_per_layer * expert) + lm_head + h + h  # + final norm, embedding row
    return {"bytes": 2 * elems, "expert_bytes": 2 * layers * experts_hit_per_layer * expert,
            "experts_hit_per_layer": experts_hit_per_layer}


# ---- workers (one engine per process) ------------------------------------------------------------------------


def engine_runner(engine: Any, tag: str, params: Callable[[int], Any],
                  ) -> Callable[[list[list[int]], int], tuple[list[float], dict[str, list[float]]]]:
    """`run(prompts, out_len)`: the prompts through the engine's own step loop (`params(out_len)` each) until
    done; the time of every model step with all of them decoding, and per request its token stamps.
    NOTE: a decode burst (sched/burst.py) runs several model steps in one engine step, each request getting a token
    from each: such a step counts as that many model steps of its time over their number."""
    calls = itertools.count()

    def run(prompts: list[list[int]], out_len: int) -> tuple[list[float], dict[str, list[float]]]:
        """Step the engine until done: each step's (start, end), and per request its token stamps."""
        sampling = params(out_len)
        call = next(calls)
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}-{call}-{i}", {"prompt_token_ids": p}, sampling)
        steps: list[float] = []
        stamps: dict[str, list[float]] = {}
        counts: dict[str, int] = {}
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            decode_only = len(counts) == len(prompts) and all(v >= 1 for v in counts.values())
            if decode_only and len(outs) == len(prompts):
                model_steps = min(len(out.outputs[0].token_ids) - counts[out.request_id] for out in outs)
                steps += [(now - t0) / model_steps] * model_steps if model_steps > 0 else []
            for out in outs:
                n = len(out.outputs[0].token_ids)
                stamps.setdefault(out.request_id, []).extend([now] * (n - counts.get(out.request_id, 0)))
                counts[out.request_id] = n
        return steps, stamps

    return run


def experts_hit(run: Callable[..., Any], experts: list[Any], seed: int, vocab: int) -> list[int]:
    """The experts a 32-token decode step hits, per layer, over the last two steps of a short batch (pure
    32-token decodes): hooks on the expert groups, after the timed steps (the hooks cost time)."""
    import torch

    hits: list[int] = []
    hooks = [m.register_forward_hook(lambda mod, a, out: hits.append(int(torch.count_nonzero(a[1].counts))))
             for m in experts]
    run(make_prompts(seed, "batch-hits", BATCH, 16, vocab), 4)
    for hook in hooks:
        hook.remove()
    return [n for n in hits[-len(experts) * 2:]]


def worker_kvbaton(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvbaton import LLM, SamplingParams
    from kvbaton.layers.moe.experts import GroupedExperts

    t = time.perf_counter()
    llm = LLM(str(args.model_dir), dtype="bfloat16", num_threads=args.threads, max_model_len=2048,
              kv_cache_memory_gb=2.0)
    load_s = time.perf_counter() - t
    engine = llm.engine
    experts = [m for m in engine.core.runner.model.modules() if isinstance(m, GroupedExperts)]
    kernel = experts[0].kernel
    vocab = engine.model_config.vocab_size
    tag = args._worker
    run = engine_runner(engine, tag, lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    run(make_prompts(args.seed, f"{tag}-warm", 2, 256, vocab), 4)  # warm-up (kernels, allocator)
    prefill = []
    for i in range(PREFILL_REPEATS):
        prompt = make_prompts(args.seed, f"prefill-{i}", 1, PREFILL_LEN, vocab)
        t0 = time.perf_counter()
        _, stamps = run(prompt, 1)
        prefill.append(PREFILL_LEN / (next(iter(stamps.values()))[0] - t0))
    decode_steps, stamps = run(make_prompts(args.seed, "decode", 1, DECODE_PROMPT, vocab), DECODE_STEPS + 1)
    times = next(iter(stamps.values()))
    # per model step (a burst's tokens reach the stamps together: their gaps are not steps)
    decode_ms = 1e3 * statistics.median(decode_steps)
    decode_mean_ms = 1e3 * (times[-1] - times[0]) / (len(times) - 1)
    batch_steps, _ = run(make_prompts(args.seed, "batch", BATCH, BATCH_PROMPT, vocab), BATCH_STEPS + 1)
    batch_hits = experts_hit(run, experts, args.seed, vocab)
    log(f"kvbaton {tag}: prefill {statistics.median(prefill):.0f} tok/s, decode b1 {decode_ms:.2f} ms, "
        f"b{BATCH} {1e3 * statistics.median(batch_steps):.1f} ms/step")
    return {"load_s": load_s, "compute_path": engine.core.compute_plan.summary(),
            "moe_experts": kernel.name if kernel is not None else "pytorch loop",
            "prefill_tok_s": prefill, "decode_b1_ms": decode_ms, "decode_b1_mean_ms": decode_mean_ms,
            "decode_b32_step_ms": [1e3 * s for s in batch_steps],
            "experts_hit_b32": statistics.mean(batch_hits) if batch_hits else None,
            "torch_threads": torch.get_num_threads()}


def worker_hf(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    experts = {"experts_implementation": "eager"} if args._worker == "hf-eager" else {}  # else its default
    model = AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=torch.bfloat16, **experts).eval()
    load_s = time.perf_counter() - t
    vocab = model.config.vocab_size

    @torch.inference_mode()
    def greedy(prompts: list[list[int]], steps: int) -> tuple[float, list[float]]:
        """Prefill seconds, then each decode step's seconds (model forward over its KV cache, argmax)."""
        ids = torch.tensor(prompts)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        prefill_s = time.perf_counter() - t0
        past, step_s = out.past_key_values, []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            past = out.past_key_values
            step_s.append(time.perf_counter() - t0)
        return prefill_s, step_s

    greedy(make_prompts(args.seed, "hf-warm", 2, 64, vocab), 2)
    prefill = [PREFILL_LEN / greedy(make_prompts(args.seed, f"prefill-{i}", 1, PREFILL_LEN, vocab), 0)[0]
               for i in range(PREFILL_REPEATS)]
    _, steps = greedy(make_prompts(args.seed, "decode", 1, DECODE_PROMPT, vocab), DECODE_STEPS)
    _, batch_steps = greedy(make_prompts(args.seed, "batch", BATCH, BATCH_PROMPT, vocab), BATCH_STEPS)
    log(f"transformers {args._worker}: prefill {statistics.median(prefill):.0f} tok/s, decode b1 "
        f"{1e3 * statistics.median(steps):.2f} ms, b{BATCH} {1e3 * statistics.median(batch_steps):.1f} ms/step")
    return {"load_s": load_s, "experts_implementation": getattr(model.config, "_experts_implementation", None),
            "prefill_tok_s": prefill, "decode_b1_ms": 1e3 * statistics.median(steps),
            "decode_b1_mean_ms": 1e3 * statistics.mean(steps),
            "decode_b32_step_ms": [1e3 * s for s in batch_steps], "torch_threads": torch.get_num_threads()}


def worker_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    bw = measure_bandwidth(512, args.threads)
    return {"read_gb_s": bw.read_gb_s, "copy_gb_s": bw.copy_gb_s, "matvec_bfloat16_gb_s": bw.matvec_bfloat16_gb_s}


WORKERS = {"kvbaton": worker_kvbaton, "kvbaton-torch": worker_kvbaton, "hf": worker_hf, "hf-eager": worker_hf,
           "bandwidth": worker_bandwidth}


def run_in_worker(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--_worker", kind, "--threads", str(args.threads), "--seed", str(args.seed),
           "--model-dir", str(args.model_dir)]
    env = thread_env(args.threads)
    env["KVBATON_MOE_KERNEL"] = "0" if kind == "kvbaton-torch" else "1"
    wait_foreign(FOREIGN, args.wait_foreign, kind)
    busy = wait_idle(args.wait_idle, kind, args.notes)
    with OverlapWatch(FOREIGN) as watch, args.monitor.window() as window:
        try:
            res = run_worker(cmd, env, args.worker_timeout_s, kind)
        except WorkerFailed as exc:
            res = {"error": str(exc)}
    res["busy_before"] = busy
    note_load(res, kind, window, args.notes)
    note_overlap(res, kind, watch, args.notes)
    return res


def note_overlap(res: dict[str, Any], what: str, watch: OverlapWatch, notes: list[str]) -> None:
    if watch.seen:
        res["overlapping_benchmarks"] = watch.seen
        notes.append(f"another benchmark ran during {what}: {watch.seen[0][:120]}")


# ---- llama.cpp ------------------------------------------------------------------------------------------------


def ensure_gguf(peers: Peers, model_dir: Path, threads: int) -> Path:
    gguf = model_dir.with_name(model_dir.name + "-bf16.gguf")
    if gguf.exists():
        return gguf
    log(f"llama.cpp: converting the model to {gguf}")
    tmp = gguf.with_suffix(".tmp.gguf")
    python = peers.root / "venv-convert" / "bin" / "python"
    env = thread_env(threads) | ({"PYTHON": str(python)} if python.exists() else {})
    proc = subprocess.run(["bash", str(peers.scripts / "llama-cpp.sh"), "gguf", str(peers.root), str(model_dir),
                           str(tmp), "bf16"], capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 or not tmp.exists():
        raise RuntimeError(f"gguf conversion failed: {proc.stderr[-1500:]}")
    tmp.rename(gguf)
    return gguf


def run_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    peers: Peers | None = args.peer_paths
    if peers is None:
        return {"skipped": "no --peer-dir / --peer-scripts"}
    if missing := peers.missing("llamacpp", binary="llama-bench"):
        return {"skipped": missing}
    try:
        gguf = ensure_gguf(peers, args.model_dir, args.threads)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    bench, batched = peers.llama_bin("llama-bench"), peers.llama_bin("llama-batched-bench")
    assert bench is not None and batched is not None
    t = str(args.threads)
    res: dict[str, Any] = {"gguf": str(gguf), "versions": peers.versions(), "commands": []}
    wait_foreign(FOREIGN, args.wait_foreign, "llama.cpp")
    res["busy_before"] = wait_idle(args.wait_idle, "llama.cpp", args.notes)
    with OverlapWatch(FOREIGN) as watch, args.monitor.window() as window:
        rows = []
        tests = (["-p", str(PREFILL_LEN), "-n", "0"], ["-p", "0", "-n", str(DECODE_STEPS), "-d", str(DECODE_PROMPT)])
        for extra in tests:
            cmd = [str(bench), "-m", str(gguf), "-t", t, "-r", str(PREFILL_REPEATS), "-o", "json", *extra]
            res["commands"].append(shlex.join(cmd))
            log(f"llama.cpp: {' '.join(cmd[1:])}")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=thread_env(args.threads), timeout=600)
            if proc.returncode != 0:
                return res | {"error": f"llama-bench failed: {proc.stderr[-1500:]}"}
            rows += json.loads(proc.stdout)
        pp = next(r for r in rows if r["n_gen"] == 0)
        tg = next(r for r in rows if r["n_gen"] == DECODE_STEPS)
        tg_samples = tg.get("samples_ts") or [tg["avg_ts"]]
        res |= {"build_commit": pp.get("build_commit"), "prefill_tok_s": pp.get("samples_ts") or [pp["avg_ts"]],
                "decode_b1_ms": 1e3 / statistics.median(tg_samples), "decode_b1_samples_tok_s": tg_samples,
                "decode_b1_depth": tg.get("n_depth")}
        if batched is not None and batched.exists():
            ctx = BATCH * (BATCH_PROMPT + BATCH_STEPS) + 256
            cmd = [str(batched), "-m", str(gguf), "-t", t, "-tb", t, "-c", str(ctx), "-b", "2048", "-ub", "512",
                   "-npp", str(BATCH_PROMPT), "-ntg", str(BATCH_STEPS), "-npl", str(BATCH), "--output-format", "jsonl"]
            res["commands"].append(shlex.join(cmd))
            log(f"llama.cpp: {' '.join(cmd[1:])}")
            proc = subprocess.run(cmd, capture_output=True, text=True, env=thread_env(args.threads), timeout=600)
            lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
            got = [ln for ln in lines if ln.get("pl") == BATCH]
            if proc.returncode != 0 or not got:
                res["batched_error"] = (proc.stderr or proc.stdout)[-1500:]
            else:
                res["batched"] = got[0]
                res["decode_b32_step_ms"] = [1e3 * got[0]["t_tg"] / BATCH_STEPS]
        else:
            res["batched_error"] = ("llama-batched-bench not built: cmake --build <llama.cpp>/build "
                                    "--target llama-batched-bench")
    note_load(res, "llama.cpp", window, args.notes)
    note_overlap(res, "llama.cpp", watch, args.notes)
    return res


# ---- the report -----------------------------------------------------------------------------------------------


def figures(res: dict[str, Any]) -> tuple[float | None, float | None, float | None]:
    """(prefill tok/s, batch-1 decode ms, batch-32 decode ms/step) medians, None where missing."""
    if "error" in res or "skipped" in res:
        return None, None, None
    pre = statistics.median(res["prefill_tok_s"]) if res.get("prefill_tok_s") else None
    b32 = statistics.median(res["decode_b32_step_ms"]) if res.get("decode_b32_step_ms") else None
    return pre, res.get("decode_b1_ms"), b32


def targets(res: dict[str, Any], ours: tuple[float | None, ...], roof: dict[str, Any]) -> list[str]:
    """The issue's targets: batch-32 decode >= 5x transformers; >= 1.0x llama.cpp."""
    out = []
    hf = [figures(res[k])[2] for k in ("hf", "hf-eager") if k in res]
    if any(hf):
        hf_b32 = min(v for v in hf if v is not None)  # transformers' faster experts implementation
        got = ratio(hf_b32, ours[2])
        ceiling = ratio(hf_b32, roof["b32_ms"])  # what reading the active weights once at the bandwidth would give
        out.append(f"- Target batch-{BATCH} decode >= 5x transformers (its faster implementation): {fmt(got, '.2f')}x, "
                   f"{'met' if got and got >= 5 else 'not met'}; the roofline itself is {fmt(ceiling, '.2f')}x "
                   "transformers here (the bound for any engine that reads each hit expert once per step)")
    if "llamacpp" in res:
        pre, b1, b32 = figures(res["llamacpp"])
        got = [ratio(ours[0], pre), ratio(b1, ours[1]), ratio(b32, ours[2])]
        met = all(g is not None and g >= 1 for g in got)
        out.append(f"- Target >= 1.0x llama.cpp (prefill / b1 / b{BATCH}): "
                   f"{' / '.join(fmt(g, '.2f') + 'x' for g in got)}, {'met' if met else 'not met'}")
    return [*out, ""] if out else []


def markdown(doc: dict[str, Any]) -> str:
    env, res, roof = doc["environment"], doc["results"], doc["roofline"]
    ours = figures(res.get("kvbaton", {"skipped": ""}))
    lines = [f"# MoE prefill and decode — {doc['started']}", "",
             f"Command: `{doc['command']}`  ",
             f"Machine: {env['cpu']}; kvbaton sees {env['cpu_features']}; {doc['threads']} threads; "
             f"torch {env['torch']}, transformers {env['transformers']}; kvbaton commit {env['kvbaton_commit']}"
             + (f"; llama.cpp {env['peers'].get('llama.cpp')}" if env.get("peers") else ""), "",
             f"Model: random-weight Qwen3-MoE built with transformers (`{doc['model_dir']}`), bf16: "
             f"{doc['model']['params'] / 1e6:.0f} M parameters, 8 layers, hidden 768, 64 experts x 384, top-8, tied "
             f"embeddings, vocabulary {SHAPE['vocab_size']} (SmolLM2's tokenizer). Prompt seed {doc['seed']}.", "",
             f"Read bandwidth (torch sum of 512 MB): {roof['read_gb_s']:.1f} GB/s. Decode roofline = active weight "
             f"bytes / that: batch 1 {roof['b1']['bytes'] / 1e6:.0f} MB ({roof['b1']['experts_hit_per_layer']:.0f} "
             f"experts/layer) -> {roof['b1_ms']:.2f} ms; batch {BATCH} {roof['b32']['bytes'] / 1e6:.0f} MB "
             f"({roof['b32']['experts_hit_per_layer']:.1f} experts/layer hit, counted) -> {roof['b32_ms']:.2f} ms.", "",
             f"| engine | prefill tok/s ({PREFILL_LEN}) | decode b1 ms/step | b1 % roofline | decode b{BATCH} "
             f"ms/step | b{BATCH} % roofline | kvbaton speed-up: prefill / b1 / b{BATCH} |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name in ENGINES:
        if name not in res:
            continue
        r = res[name]
        pre, b1, b32 = figures(r)
        if pre is None and b1 is None:
            lines.append(f"| {LABELS[name]} | {r.get('error') or r.get('skipped')} | | | | | |")
            continue
        speed = "—" if name == "kvbaton" else " / ".join(
            fmt(x, ".2f") + "x" if x is not None else "—"
            for x in (ratio(ours[0], pre), ratio(b1, ours[1]), ratio(b32, ours[2])))
        lines.append(f"| {LABELS[name]} | {fmt(pre, '.0f')} | {fmt(b1, '.2f')} | "
                     f"{fmt(ratio(roof['b1_ms'], b1), '.0%')} | {fmt(b32, '.1f')} | "
                     f"{fmt(ratio(roof['b32_ms'], b32), '.0%')} | {speed} |")
    lines += ["", "Speed-up: kvbaton's prefill tok/s over the engine's, the engine's ms/step over kvbaton's (> 1: "
              "kvbaton is faster). Figures are medians (prefill of 3 prompts, batch-32 of 32 steps).", ""]
    lines += targets(res, ours, roof)
    for key, label in (("kvbaton", "kvbaton"), ("kvbaton-torch", "kvbaton (PyTorch loop, KVBATON_MOE_KERNEL=0)")):
        if key in res and "error" not in res[key]:
            lines.append(f"- {label}: {res[key]['compute_path']}; MoE experts: {res[key]['moe_experts']} "
                         f"(loaded in {res[key]['load_s']:.1f} s)")
    for key in ("hf", "hf-eager"):
        if key in res and "error" not in res[key]:
            lines.append(f"- {LABELS[key]}: experts implementation `{res[key].get('experts_implementation')}`, "
                         "a greedy loop over `model(...)` with its DynamicCache (only the forward is timed)")
    lc = res.get("llamacpp", {})
    for cmd in lc.get("commands", []):
        lines.append(f"- llama.cpp: `{cmd}`")
    if "batched_error" in lc:
        lines.append(f"- llama.cpp batch-{BATCH}: {lc['batched_error'][:300]}")
    lines += notes_section(doc["notes"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        worker_main(lambda: WORKERS[args._worker](args))
        return 0
    started = dt.datetime.now()
    t_start = time.perf_counter()
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise SystemExit(f"unknown engines {sorted(unknown)}; choose from {','.join(ENGINES)}")
    args.peer_paths = resolve_peers(args, ["llamacpp"] if "llamacpp" in engines else [], "leave out llamacpp")
    args.seed = fresh_seed() if args.seed is None else args.seed
    args.model_dir = (args.model_dir or default_model_dir()).resolve()
    args.notes = []
    log(f"seed {args.seed}; model {args.model_dir}")
    lock = take_lock(args.wait_lock)  # noqa: F841 - held for the run: benchmarks that take it never overlap
    build_model(args.model_dir)
    args.monitor = LoadMonitor()
    args.monitor.start()
    results: dict[str, Any] = {}
    bw = run_in_worker("bandwidth", args)
    for name in engines:
        log(f"--- {name}")
        results[name] = run_llamacpp(args) if name == "llamacpp" else run_in_worker(name, args)
    hit_b32 = next((r["experts_hit_b32"] for r in results.values() if r.get("experts_hit_b32")), None)
    cfg = json.loads((args.model_dir / "config.json").read_text())
    if hit_b32 is None:  # uniform routing: P(an expert is hit by none of 32 tokens) = (1 - k/E)^32
        hit_b32 = num_experts(cfg) * (1 - (1 - cfg["num_experts_per_tok"] / num_experts(cfg)) ** BATCH)
    read = bw.get("read_gb_s") or float("nan")
    b1, b32 = weight_bytes(args.model_dir, cfg["num_experts_per_tok"]), weight_bytes(args.model_dir, hit_b32)
    roof = {"read_gb_s": read, "bandwidth": bw, "b1": b1, "b32": b32,
            "b1_ms": 1e3 * b1["bytes"] / (read * 1e9), "b32_ms": 1e3 * b32["bytes"] / (read * 1e9)}
    from common.machine import model_facts

    peers = results.get("llamacpp", {}).get("versions")
    doc = {"started": started.isoformat(timespec="seconds"), "command": command_line("bench_moe.py", sys.argv[1:]),
           "environment": environment(with_transformers=True, peers=peers).__dict__, "threads": args.threads,
           "seed": args.seed, "model_dir": str(args.model_dir), "model": model_facts(str(args.model_dir)).__dict__,
           "shape": SHAPE, "roofline": roof, "results": results, "notes": args.notes,
           "wall_s": time.perf_counter() - t_start}
    files = ResultFiles.of(args.out_dir, "moe", stamp(started))
    files.write(doc, markdown(doc), time.perf_counter() - t_start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
