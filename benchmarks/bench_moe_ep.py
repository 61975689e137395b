"""Expert parallelism (EP over gloo) on a random-weight Qwen3-MoE-shaped model, in one run:

    .venv/bin/python benchmarks/bench_moe_ep.py            # ~5 min on 2 cores
    .venv/bin/python benchmarks/bench_moe_ep.py --quick    # smoke run (1 round, 1 repeat; ~2.5 min)

- EP1 vs EP2: the decode step at batch 16 (EP1: 16 sequences, 2 threads; EP2: 8 sequences on each of 2 rank
  processes, 1 thread each, so both use the machine's 2 cores) and the prefill step of a 256-token prompt per
  rank (EP1: 2 x 256 in one step), in ms per step, and the part of it spent inside the all-to-all exchanges
  (every `torch.distributed.all_to_all_single` call of the dispatch, timed by a wrapper this script installs in
  its rank processes; it includes waiting for the other rank). A third set-up, EP1 with 1 thread and one rank's
  batch (8 / 1 x 256), is the compute of one rank without any exchange.
- int8 dispatch: the all-to-all bytes per step (`bytes_sent` deltas, and the wire bytes the wrapper counts) and
  the step time, exact (bf16) vs `int8_dispatch=True`; greedy agreement of int8 with exact over every decoded
  token; and the error of one MoE layer's output on real hidden states (captured from the model's forward):
  SparseMoeBlock's experts over the bf16 rows against the same over quantize_rows/dequantize_rows of them.
- EPLB: a copy of the model whose routers favour 6 experts that the first placement puts on rank 0; EP2 with 4
  redundant slots; balancedness (mean / max of `rows_computed` per rank) and the decode and prefill steps before
  and after `rebalance_now()` (fresh prompts for each phase), and the greedy outputs checked against EP1's. These
  groups run PyTorch's expert loop (KVBATON_MOE_KERNEL=0) unless `--eplb-moe-kernel on` (see the results' note).

Flags: `--sections ep,eplb`, `--rounds N` (2), `--repeats N` (3), `--decode-tokens N` (32), `--seed N`,
`--group-timeout-s S` (180: one group of rank processes), `--wait-idle S`, `--wait-lock S`, `--out-dir DIR`,
`--render RESULTS_JSON` (write that run's summary again, measuring nothing).

The models are built with transformers at run time in a temporary directory (bf16 safetensors and a word-level
tokenizer; prompts are random token ids from a printed seed). Every rank is its own process, started with a time
limit and stopped by PID at the end (also on failure or Ctrl-C). Output: a table on stdout,
`benchmarks/results/moe-ep-<stamp>.json` (every step of every rank) and `benchmarks/results/moe-ep.md`.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common.contention import LoadMonitor, OverlapWatch, note_load, take_lock, wait_idle
from common.log import log
from common.machine import environment, model_facts
from common.procs import stop_pids, thread_env
from common.prompts import fresh_seed, make_prompts
from common.records import to_json
from common.report import RESULTS_DIR, ResultFiles, command_line, fmt, notes_section, stamp

# Qwen3-30B-A3B's shape (hidden 2048, 48 layers, 128 experts, top-8, moe_intermediate 768, 32 heads / 4 KV heads
# of 128) scaled down to what 2 cores run in minutes: experts/top-k ratio and the GQA layout kept.
SHAPE = dict(vocab_size=32768, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, intermediate_size=1024, moe_intermediate_size=192, num_experts=64, num_experts_per_tok=8,
             max_position_embeddings=2048, norm_topk_prob=True, tie_word_embeddings=False)
DECODE_BATCH = 16  # sequences in the group (EP2: 8 per rank)
DECODE_PROMPT = 32  # tokens of each decode sequence's prompt
PREFILL_LEN = 256  # one prompt per rank
HOT_EXPERTS = (4, 6, 8, 10, 12, 14)  # the skewed model's favourites: all on rank 0 in EP2's first placement
REDUNDANT = 4  # EPLB slots: (64 + 4) / 2 = 34 per rank
SKEW_CHANNEL_VALUE = 0.5  # the skewed model's constant residual channel (the routers' bias rides on it)
MOE_KERNEL_ENV = "KVBATON_MOE_KERNEL"  # 0: PyTorch's expert loop instead of the C MoE kernel (compute_paths)
RESULT_PREFIX = "moe-ep"
PER_RANK_BATCH = {"ep1": DECODE_BATCH, "ep2": DECODE_BATCH // 2, "ep2_int8": DECODE_BATCH // 2,
                  "ep1_half": DECODE_BATCH // 2}  # decode sequences per rank, per set-up
FOREIGN = "benchmarks/bench_"  # other benchmark processes (command lines) seen during a group are noted


# ---- the models ---------------------------------------------------------------------------------


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**SHAPE, eos_token_id=None, bos_token_id=None, pad_token_id=0)


def write_tokenizer(out: Path) -> None:
    """kvbaton wants a tokenizer.json; a word-level one over t0..t{V-1} (the benchmark feeds token ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(SHAPE["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(out))


def capture_moe_inputs(model, prompts: list[list[int]]) -> list[Any]:
    """Every MoE layer's input ([T, H], after the post-attention norm) for one forward over `prompts`."""
    import torch

    caps: list[Any] = [None] * len(model.model.layers)
    hooks = [layer.mlp.register_forward_pre_hook(lambda _m, a, i=i: caps.__setitem__(i, a[0].reshape(
        -1, a[0].shape[-1]).detach().clone())) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.tensor(prompts))
    for h in hooks:
        h.remove()
    return caps


def skew_routers(model, prompts: list[list[int]], hot_share: float) -> list[float]:
    """Make each router send about `hot_share` of the top-k choices to HOT_EXPERTS. Channel 0 of the residual
    stream is made a constant: every embedding row holds SKEW_CHANNEL_VALUE there, no attention or expert output
    writes it and nothing but the routers reads it (so attention and the experts compute as in the unskewed
    model), so every token's normalized MoE input has a positive channel 0; the hot experts' gate rows
    get a boost on it, found per layer by bisection on the inputs of one forward over `prompts` (a pre-hook
    calibrates each layer before it runs). Returns the share each layer got there."""
    import torch

    shares: list[float] = []
    hot = torch.tensor(HOT_EXPERTS)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = SKEW_CHANNEL_VALUE
        model.lm_head.weight[:, 0] = 0
        for layer in model.model.layers:  # channel 0 reaches only the routers (and the norms' scale)
            attn = layer.self_attn
            attn.o_proj.weight[0, :] = 0
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.weight[:, 0] = 0
            layer.mlp.experts.down_proj[:, 0, :] = 0  # [E, H, I]: no expert writes channel 0
            layer.mlp.experts.gate_up_proj[:, :, 0] = 0  # [E, 2I, H]: nor reads it

    def calibrate(mlp, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        gate = mlp.gate.weight
        w0 = gate.detach().float()
        lo, hi = 0.0, 16.0
        for _ in range(30):
            mid = (lo + hi) / 2
            w = w0.clone()
            w[hot, 0] += mid
            lo, hi = (mid, hi) if hot_share_of(x, w) < hot_share else (lo, mid)
        with torch.no_grad():
            gate[hot, 0] += hi
        shares.append(hot_share_of(x, gate.detach().float()))

    hooks = [layer.mlp.register_forward_pre_hook(calibrate) for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor(prompts))
    for h in hooks:
        h.remove()
    return shares


def hot_share_of(x, gate_weight) -> float:
    """The share of top-k choices of the rows `x` ([T, H]) that go to HOT_EXPERTS under `gate_weight`."""
    import torch

    top = (x.float() @ gate_weight.float().T).topk(SHAPE["num_experts_per_tok"], dim=-1).indices
    return torch.isin(top, torch.tensor(HOT_EXPERTS)).float().mean().item()


def layer_int8_error(model_dir: Path, inputs: list[Any]) -> list[dict]:
    """Per MoE layer: kvbaton's SparseMoeBlock (from the checkpoint, PyTorch expert loop) over real hidden states,
    experts fed the exact bf16 rows vs rows through dispatch.quantize_rows/dequantize_rows (what the int8 wire
    carries: routing is decided on the exact rows, the combine stays exact); and bf16's own error (the same block
    in fp32) as the scale to judge it by."""
    import torch

    from kvbaton.layers.moe.dispatch import dequantize_rows, quantize_rows
    from kvbaton.layers.moe.experts import ExpertGroups
    from kvbaton.models.loader import load_model

    model = load_model(model_dir, torch.bfloat16, SHAPE["max_position_embeddings"])
    out = []
    with torch.inference_mode():
        for i, layer in enumerate(model.layers):
            block, x = layer.mlp, inputs[i].to(torch.bfloat16)
            weights, ids = block.gate(x)
            groups = ExpertGroups.of(ids, weights, SHAPE["num_experts"])
            exact = block.experts(x, groups).float()
            wire = dequantize_rows(quantize_rows(x), x.dtype)
            int8 = block.experts(wire, ExpertGroups.of(ids, weights, SHAPE["num_experts"])).float()
            experts32 = copy.deepcopy(block.experts).float()
            fp32 = experts32(x.float(), ExpertGroups.of(ids, weights, SHAPE["num_experts"]))
            err, noise = (int8 - exact).abs(), (exact - fp32).abs()
            out.append({"layer": i, "tokens": x.shape[0], "mean_abs_output": exact.abs().mean().item(),
                        "int8_max_abs_err": err.max().item(), "int8_mean_abs_err": err.mean().item(),
                        "int8_rel_rms_err": ((int8 - exact).norm() / exact.norm()).item(),
                        "bf16_vs_fp32_max_abs_err": noise.max().item(),
                        "bf16_vs_fp32_mean_abs_err": noise.mean().item(),
                        "input_max_abs_err": (wire.float() - x.float()).abs().max().item()})
    return out


def build_models(root: Path, seed: int, hot_share: float) -> dict:
    """The uniform model (random init), the int8 layer error on its hidden states, and the skewed copy."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(qwen3_moe_config(), dtype=torch.bfloat16).eval()
    uniform, skewed = root / "uniform", root / "skewed"
    model.save_pretrained(str(uniform))
    write_tokenizer(uniform)
    inputs = capture_moe_inputs(model, make_prompts(seed, "layer-error", 4, PREFILL_LEN, SHAPE["vocab_size"]))
    errors = layer_int8_error(uniform, inputs)
    shares = skew_routers(model, make_prompts(seed, "skew-calibration", 8, 128, SHAPE["vocab_size"]), hot_share)
    model.save_pretrained(str(skewed))
    write_tokenizer(skewed)
    held_out = capture_moe_inputs(model, make_prompts(seed, "skew-check", DECODE_BATCH, DECODE_PROMPT,
                                                      SHAPE["vocab_size"]))
    checked = [hot_share_of(x, layer.mlp.gate.weight) for x, layer in zip(held_out, model.model.layers)]
    del model, inputs, held_out
    log(f"models built in {time.perf_counter() - t0:.0f}s: hot-expert share per layer "
        f"{', '.join(f'{s:.2f}' for s in shares)} (calibration), {', '.join(f'{s:.2f}' for s in checked)} "
        "(held-out prompts)")
    return {"uniform": uniform, "skewed": skewed, "layer_error": errors, "hot_share_per_layer": shares,
            "hot_share_held_out": checked}


# ---- one rank (its own process) -------------------------------------------------------------


class Clock:
    """What one step spent where (this rank), from wrappers around the calls that cross ranks."""

    def __init__(self) -> None:
        self.a2a_s = self.allreduce_s = self.codec_s = self.experts_s = 0.0
        self.slots_hit = 0  # distinct local expert slots that computed rows, summed over the layers
        self.wire = {"rows": 0, "slot_ids": 0, "counts": 0}
        self.sched = (0, 0)

    def reset(self) -> None:
        self.__init__()


def install_timers(clock: Clock, rank: int, world: int) -> None:
    """Wrap torch.distributed's all_to_all_single / all_reduce, dispatch's int8 codec and the local expert call.
    Measurement only, in this process; kvbaton looks them up at call time, so it runs through the wrappers."""
    import torch.distributed as dist

    from kvbaton.layers.moe import dispatch

    real_a2a, real_reduce = dist.all_to_all_single, dist.all_reduce
    real_q, real_dq = dispatch.quantize_rows, dispatch.dequantize_rows
    real_local = dispatch.AllToAllDispatch._local_experts

    def all_to_all_single(*args, **kwargs):
        tensor, split = args[1], kwargs.get("input_split_sizes")
        if split is None:  # the per-rank row counts: an equal split
            clock.wire["counts"] += tensor.nbytes * (world - 1) // world
        else:
            row = tensor.element_size() * (tensor[0].numel() if tensor.dim() > 1 and tensor.shape[0] else 1)
            clock.wire["slot_ids" if tensor.dim() == 1 else "rows"] += (sum(split) - split[rank]) * row
        t = time.perf_counter()
        try:
            return real_a2a(*args, **kwargs)
        finally:
            clock.a2a_s += time.perf_counter() - t

    def all_reduce(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real_reduce(*args, **kwargs)
        finally:
            clock.allreduce_s += time.perf_counter() - t

    def timed(fn, field):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(clock, field, getattr(clock, field) + time.perf_counter() - t)
        return wrapper

    dist.all_to_all_single, dist.all_reduce = all_to_all_single, all_reduce
    dispatch.quantize_rows, dispatch.dequantize_rows = timed(real_q, "codec_s"), timed(real_dq, "codec_s")
    timed_local = timed(real_local, "experts_s")

    def local_experts(self, rows, local_slots):
        clock.slots_hit += int(local_slots.unique().numel())
        return timed_local(self, rows, local_slots)

    dispatch.AllToAllDispatch._local_experts = local_experts


def moe_kernel_layers(model) -> int:
    from kvbaton.layers.moe.experts import GroupedExperts

    return sum(getattr(m, "kernel", None) is not None for m in model.modules() if isinstance(m, GroupedExperts))


def rank_main(job: dict) -> dict:
    from kvbaton import LLM, SamplingParams
    from kvbaton.config import ExpertParallelConfig

    size, rank = job["size"], job["rank"]
    clock = Clock()
    install_timers(clock, rank, size)
    ep = None if size == 1 else ExpertParallelConfig(
        size=size, rank=rank, init_method=f"tcp://127.0.0.1:{job['port']}", int8_dispatch=job["int8"],
        num_redundant_experts=job["redundant"], timeout_s=job["collective_timeout_s"])
    t0 = time.perf_counter()
    llm = LLM(job["model"], dtype="bfloat16", num_threads=job["threads"], max_model_len=1024,
              kv_cache_memory_gb=0.25, expert_parallel=ep)
    init_s = time.perf_counter() - t0
    core = llm.engine.core
    group = core.expert_parallel
    model = core.runner.model
    kernel_layers = moe_kernel_layers(model)
    counters = (lambda: (group.bytes_sent, group.rows_computed)) if group is not None else (lambda: (0, 0))
    steps: list[list] = []
    real_step, real_execute = core.step, core.runner.execute

    def execute(sched):
        clock.sched = (sched.num_scheduled_tokens, len(sched.scheduled))
        return real_execute(sched)

    def step():
        clock.reset()
        b0, r0 = counters()
        t = time.perf_counter()
        res = real_step()
        wall = time.perf_counter() - t
        b1, r1 = counters()
        # [tokens, seqs, wall, a2a, all_reduce, codec, experts, bytes_sent, rows_computed, wire rows/ids/counts,
        #  slots hit]
        steps.append([*clock.sched, wall, clock.a2a_s, clock.allreduce_s, clock.codec_s, clock.experts_s, b1 - b0,
                      r1 - r0, clock.wire["rows"], clock.wire["slot_ids"], clock.wire["counts"], clock.slots_hit])
        return res

    core.step, core.runner.execute = step, execute
    phases = []
    for ph in job["phases"]:
        prompts = make_prompts(job["seed"], ph["tag"], ph["n"], ph["len"], SHAPE["vocab_size"])
        share = len(prompts) // size
        mine = prompts[rank * share:(rank + 1) * share]
        params = SamplingParams(temperature=0, max_tokens=ph["max_tokens"], ignore_eos=True)
        steps.clear()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in mine], params)
        rec = {"name": ph["name"], "tag": ph["tag"], "kind": ph["kind"], "wall_s": time.perf_counter() - t,
               "steps": [list(s) for s in steps if s[0] > 0],
               "outputs": [list(o.outputs[0].token_ids) for o in outs]}
        if ph.get("rebalance_after"):
            assert group is not None, "EPLB needs an EP group"
            t = time.perf_counter()
            group.rebalance_now()
            rec["rebalance_s"] = time.perf_counter() - t
        phases.append(rec)
    res = {"rank": rank, "init_s": init_s, "compute_path": llm.engine.info.compute_path,
           "moe_kernel_layers": kernel_layers, "moe_kernel_layers_end": moe_kernel_layers(model), "phases": phases}
    if group is not None:
        res.update(bytes_sent=group.bytes_sent, rows_computed=group.rows_computed,
                   rebalances=group.rebalancer.rebalances,
                   layer0_slots_end=list(group.rebalancer.expert_map(0).local_experts(rank)))
        group.close()
    return res


# ---- the groups (parent) --------------------------------------------------------------------


def decode_phase(name: str, tag: str, n: int, max_tokens: int) -> dict:
    return {"name": name, "tag": tag, "kind": "decode", "n": n, "len": DECODE_PROMPT, "max_tokens": max_tokens}


def prefill_phase(name: str, tag: str, n: int) -> dict:
    return {"name": name, "tag": tag, "kind": "prefill", "n": n, "len": PREFILL_LEN, "max_tokens": 1}


def uniform_phases(round_: int, repeats: int, decode_n: int, prefill_n: int, decode_tokens: int) -> list[dict]:
    """A warm-up (not measured), then `repeats` decode and prefill phases with this round's prompts."""
    return ([decode_phase("warm", "warm", decode_n, 4), prefill_phase("warm", "warm-prefill", prefill_n)]
            + [decode_phase(f"decode-{i}", f"decode-{round_}-{i}", decode_n, decode_tokens + 1)
               for i in range(repeats)]
            + [prefill_phase(f"prefill-{i}", f"prefill-{round_}-{i}", prefill_n) for i in range(repeats)])


def eplb_phases(repeats: int, decode_tokens: int, rebalance: bool) -> list[dict]:
    """Decode and prefill phases under the first placement, then (EP2: after `rebalance_now()`) the same shapes
    with fresh prompts."""
    def phases(when: str) -> list[dict]:
        return ([decode_phase(f"{when}-{i}", f"eplb-{when}-{i}", DECODE_BATCH, decode_tokens + 1)
                 for i in range(repeats)]
                + [prefill_phase(f"{when}-prefill-{i}", f"eplb-{when}-prefill-{i}", 2) for i in range(repeats)])
    before = phases("before")
    if rebalance:
        before[-1]["rebalance_after"] = True
    return [decode_phase("warm", "eplb-warm", DECODE_BATCH, 4)] + before + phases("after")


def run_group(name: str, *, model: Path, size: int, threads: int, phases: list[dict], work: Path, seed: int,
              timeout_s: float, int8: bool = False, redundant: int = 0, env: dict[str, str] | None = None,
              ) -> list[dict]:
    """One process per rank (bounded by `timeout_s` in all), each writing its result to a file; every process
    is stopped by PID on the way out, whatever happened."""
    from kvbaton.kv.processes import die_with_parent, free_port

    port = free_port("127.0.0.1")
    procs: list[subprocess.Popen] = []
    files = []
    try:
        for rank in range(size):
            job = {"model": str(model), "size": size, "rank": rank, "port": port, "threads": threads,
                   "int8": int8, "redundant": redundant, "phases": phases, "seed": seed,
                   "collective_timeout_s": min(120.0, timeout_s), "result": str(work / f"{name}-r{rank}.json")}
            job_path = work / f"{name}-r{rank}-job.json"
            job_path.write_text(json.dumps(job))
            log_file = open(work / f"{name}-r{rank}.log", "w")  # noqa: SIM115 - closed below
            files.append((job["result"], log_file))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_rank", str(job_path)]
            procs.append(subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                          env=thread_env(threads) | (env or {}), preexec_fn=die_with_parent))
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{name}: rank processes still running after {timeout_s:.0f}s") from None
        results = []
        for (result, log_file), proc in zip(files, procs):
            log_file.flush()
            if proc.returncode != 0 or not Path(result).exists():
                tail = Path(log_file.name).read_text(errors="replace")[-2500:]
                raise RuntimeError(f"{name}: a rank exited {proc.returncode}:\n{tail}")
            results.append(json.loads(Path(result).read_text()))
        return results
    finally:
        stop_pids([p.pid for p in procs if p.poll() is None])
        for _, log_file in files:
            log_file.close()


# ---- summaries ----------------------------------------------------------------------------------

# step record columns
TOK, SEQ, WALL, A2A, RED, CODEC, EXP, BYTES, ROWS, W_ROWS, W_IDS, W_COUNTS, SLOTS = range(13)


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def step_summary(ranks: list[dict], kind: str, per_rank_seqs: int, names: tuple[str, ...] = ()) -> dict | None:
    """Medians over the measured steps of `kind` (decode: steps of exactly `per_rank_seqs` sequences, one token
    each; prefill: the prompt's step); times averaged over the ranks (lockstep: one group step), bytes and rows
    summed over them."""
    per_rank = []
    for r in ranks:
        rows = [s for ph in r["phases"] if ph["kind"] == kind and ph["name"] != "warm"
                and (not names or ph["name"].startswith(names)) for s in ph["steps"]
                if (kind == "prefill" or (s[SEQ] == per_rank_seqs and s[TOK] == per_rank_seqs))]
        if not rows:
            return None
        per_rank.append({c: med([s[i] for s in rows]) for c, i in
                         (("wall", WALL), ("a2a", A2A), ("allreduce", RED), ("codec", CODEC), ("experts", EXP),
                          ("bytes", BYTES), ("rows", ROWS), ("wire_rows", W_ROWS), ("wire_ids", W_IDS),
                          ("wire_counts", W_COUNTS), ("slots_hit", SLOTS))}
                        | {"a2a_share": med([s[A2A] / s[WALL] for s in rows]), "steps": len(rows),
                           "rows_total": sum(s[ROWS] for s in rows)})
    mean = lambda key: statistics.fmean(p[key] for p in per_rank)  # noqa: E731
    total = lambda key: sum(p[key] for p in per_rank)  # noqa: E731
    rows_total = [p["rows_total"] for p in per_rank]
    return {"step_ms": 1e3 * mean("wall"), "a2a_ms": 1e3 * mean("a2a"), "a2a_share": mean("a2a_share"),
            "allreduce_ms": 1e3 * mean("allreduce"), "codec_ms": 1e3 * mean("codec"),
            "experts_ms": 1e3 * mean("experts"), "bytes_per_step": total("bytes"), "rows_per_step": total("rows"),
            "wire_bytes_per_step": total("wire_rows") + total("wire_ids") + total("wire_counts"),
            "wire_row_bytes_per_step": total("wire_rows"), "steps_per_rank": per_rank[0]["steps"],
            "balancedness": statistics.fmean(rows_total) / max(rows_total) if max(rows_total) else None,
            "per_rank": per_rank}


def outputs_of(ranks: list[dict], name: str) -> list[list[int]]:
    """A phase's greedy outputs in prompt order (rank r held the r-th share)."""
    return [o for r in ranks for ph in r["phases"] if ph["name"] == name for o in ph["outputs"]]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y))
    total = sum(len(x) for x in ref)
    prefix = 0
    for x, y in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
        prefix += n
    first = sum(bool(x) and bool(y) and x[0] == y[0] for x, y in zip(ref, got))
    return {"tokens": total, "equal": same, "agreement": same / total if total else None,
            "identical_prefix": prefix / total if total else None, "first_token_equal": first, "sequences": len(ref)}


def pooled_agreement(a: list[list[dict]], b: list[list[dict]], names: list[str]) -> dict:
    """Agreement of set-up b with set-up a over the decode phases of every round (same prompts per round)."""
    ref, got = [], []
    for ra, rb in zip(a, b):
        for name in names:
            ref += outputs_of(ra, name)
            got += outputs_of(rb, name)
    return agreement(ref, got)


# ---- the report -----------------------------------------------------------------------------


def kb(x: float | None) -> str:
    return "—" if x is None else f"{x / 1024:,.1f} KiB"


def a2a_cell(d: dict) -> str:
    return f"{fmt(d['a2a_ms'])} ({d['a2a_share']:.0%})"


def reading_ep(doc: dict) -> list[str]:
    """What EP1 vs EP2 says, in the direction this run measured."""
    r = doc["summary"]["ratios"]
    dec, pre = r.get("ep1_over_ep2_decode"), r.get("ep1_over_ep2_prefill")
    why = ("the two ranks share the same 2 cores (and memory bandwidth) that EP1 has alone, and every MoE layer "
           "adds 4 all-to-alls (counts, slot ids, rows, combine) plus a per-step all-reduce, each a loopback TCP "
           "round trip through gloo and a synchronization point where the faster rank waits for the slower one")
    point = ("EP's point is memory per rank (each rank holds half of the routed experts here) and scale across "
             "nodes, where each rank has its own cores and memory bandwidth; on one machine the exchanges are pure "
             "overhead.")
    if dec is None or pre is None:
        return [f"- EP1 vs EP2 was not measured in this run. {point}"]
    if dec < 1 and pre < 1:
        return [f"- On this one 2-core machine EP2 is slower than EP1 (EP2 takes {1 / dec:.2f}x EP1's decode step "
                f"and {1 / pre:.2f}x its prefill step), as expected: {why}. {point}"]
    slower = [name for name, x in (("decode", dec), ("prefill", pre)) if x < 1]
    return [f"- EP2 was not slower than EP1 everywhere here (EP1 / EP2: decode {dec:.2f}, prefill {pre:.2f}), "
            "which is not EP's doing: EP1 runs one process with 2 OpenMP threads, which stall together whenever "
            "another process takes one of the 2 cores (see the other load in the notes), while each EP2 rank runs "
            "1 thread; and EP2 does not read all experts per rank. On a quiet machine expect EP2 to be slower: "
            f"{why}. {point}" + (f" EP2 was slower in {' and '.join(slower)}." if slower else "")]


def reading_exchanges(doc: dict) -> list[str]:
    s, layers = doc["summary"], doc["shape"]["num_hidden_layers"]
    d, dq, p, pq = (s.get(k) for k in ("ep2_decode", "ep2_int8_decode", "ep2_prefill", "ep2_int8_prefill"))
    out = ["- The all-to-all time includes waiting: a rank that finishes its attention or experts first waits inside "
           "the next exchange, so the share is an upper bound on the cost of the transfers themselves."]
    if d:
        out[0] += (f" A decode step makes {4 * layers} `all_to_all_single` calls per rank (4 per MoE layer: counts, "
                   f"slot ids, rows, combine), {d['a2a_ms'] / (4 * layers):.2f} ms each on average here, so it is "
                   "latency, not bytes, that costs at decode: sending the slot ids inside the row payload (as the "
                   "int8 rows carry their scale) would save a quarter of the calls.")
    if d and dq and p and pq:
        r = s["ratios"]
        verdict = "slower" if (r["int8_over_exact_time_decode"] or 0) > 1 else "not slower"
        out.append(
            "- int8 dispatch quantizes only the dispatched rows (the combine stays bf16), so it saves at most ~25% of "
            f"the bytes (here {1 - r['int8_over_exact_bytes_decode']:.0%}); its codec (`quantize_rows` + "
            "`dequantize_rows`, about a dozen PyTorch passes over the rows on the rank's one thread) costs "
            f"{dq['codec_ms']:.1f} ms per decode step and {pq['codec_ms']:.1f} ms per prefill step, more than the "
            f"loopback transfer it saves, so int8 is {verdict} here (int8 / exact: decode "
            f"{r['int8_over_exact_time_decode']:.2f}, prefill {r['int8_over_exact_time_prefill']:.2f}). It is for "
            "links where the bytes are the bottleneck (between nodes); a fused one-pass codec would cut its cost.")
    return out


def render(doc: dict) -> str:
    s, env = doc["summary"], doc["environment"]
    shape = doc["shape"]
    lines = [
        "# Expert parallelism (EP over gloo): EP1 vs EP2, int8 dispatch, EPLB", "",
        "```bash", doc["command"], "```", "",
        f"Run {doc['started']} on {env['cpu']} ({env['cpus']} cores; {env.get('cpu_features', '')}), torch "
        f"{env['torch']}, transformers {env.get('transformers')}, kvbaton {env['kvbaton_commit']}; seed "
        f"{doc['seed']}; {doc['wall_s'] / 60:.1f} min. Load average (1 min) seen: "
        f"{doc['loadavg_start'][0]:.2f} at the start, {doc['loadavg_end'][0]:.2f} at the end, "
        f"{min(doc['loadavg_groups']):.2f}-{max(doc['loadavg_groups']):.2f} before the groups; other processes used "
        f"{doc['other_load_cores_max']:.2f} cores at most during a group (shared machine: see the notes).", "",
        f"Model: random-weight Qwen3-MoE (transformers `Qwen3MoeConfig`, bf16): hidden {shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers (all MoE), {shape['num_experts']} experts, top-"
        f"{shape['num_experts_per_tok']} (normalized), moe_intermediate {shape['moe_intermediate_size']}, "
        f"{shape['num_attention_heads']} heads / {shape['num_key_value_heads']} KV heads of {shape['head_dim']}, "
        f"vocab {shape['vocab_size']}; {doc['params_m']:.0f}M parameters ({doc['expert_mb']:.0f} MiB of routed "
        f"experts per layer, {doc['expert_mb'] * shape['num_hidden_layers'] / 2:.0f} MiB of them per EP2 rank). "
        f"MoE layers run on {doc['moe_path']}.", "",
        "Set-ups: **EP1** = one process, 2 threads; **EP2** = two rank processes (gloo over 127.0.0.1), 1 thread "
        "each, each with its own requests and half of every layer's experts; **EP1 (1 rank's share)** = one "
        "process, 1 thread, one EP2 rank's batch: the same per-rank work without any exchange (but all 64 experts). "
        f"Decode: {DECODE_BATCH} sequences in the group ({DECODE_PROMPT}-token prompts, {doc['decode_tokens']} "
        f"tokens each, ignore_eos, greedy), the median of every step with the whole batch decoding; prefill: one "
        f"{PREFILL_LEN}-token prompt per rank (EP1: 2 in one step). {doc['rounds']} rounds (the set-ups "
        f"interleaved, each round its own prompts), {doc['repeats']} decode and {doc['repeats']} prefill phases "
        "per round, after an unmeasured warm-up; medians over all of them. all-to-all = time inside "
        "`all_to_all_single` (the dispatch's count, slot-id, row and combine exchanges of every MoE layer), which "
        "includes waiting for the other rank; lockstep = the per-step all-reduce of `join_step`.", "",
        "## EP1 vs EP2, exact vs int8 dispatch", "",
        "| set-up | decode ms/step | all-to-all ms (share) | lockstep ms | experts ms | prefill ms/step "
        "| all-to-all ms (share) | a2a bytes/step decode (bytes_sent, group) | prefill |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    labels = {"ep1": "EP1 (2 threads, batch 16 / 2 x 256)", "ep1_half": "EP1 (1 thread, 1 rank's share: 8 / 1 x 256)",
              "ep2": "EP2 exact (bf16 wire)", "ep2_int8": "EP2 int8 dispatch"}
    for key, label in labels.items():
        d, p = s.get(f"{key}_decode"), s.get(f"{key}_prefill")
        if d is None or p is None:
            lines.append(f"| {label} | {doc['errors'].get(key, 'not measured')} | | | | | | | |")
            continue
        ep = key.startswith("ep2")
        lines.append(
            f"| {label} | {fmt(d['step_ms'])} | {a2a_cell(d) if ep else '—'} "
            f"| {fmt(d['allreduce_ms'], '.2f') if ep else '—'} | {fmt(d['experts_ms']) if ep else '—'} "
            f"| {fmt(p['step_ms'])} | {a2a_cell(p) if ep else '—'} "
            f"| {kb(d['bytes_per_step']) if ep else '—'} | {kb(p['bytes_per_step']) if ep else '—'} |")
    r = s["ratios"]
    lines += [
        "", "Ratios (same run):", "",
        f"- EP1 / EP2 step time (> 1: EP2 faster): decode **{fmt(r.get('ep1_over_ep2_decode'), '.2f')}**, prefill "
        f"**{fmt(r.get('ep1_over_ep2_prefill'), '.2f')}**; per round, decode "
        f"{', '.join(fmt(x, '.2f') for x in r.get('ep1_over_ep2_decode_rounds', []))}.",
        f"- EP2 step minus EP1 at one rank's share (the subtraction estimate of what EP adds per step): decode "
        f"{fmt(r.get('ep2_minus_half_decode_ms'))} ms, prefill {fmt(r.get('ep2_minus_half_prefill_ms'))} ms "
        f"(instrumented all-to-all: {fmt((s.get('ep2_decode') or {}).get('a2a_ms'))} / "
        f"{fmt((s.get('ep2_prefill') or {}).get('a2a_ms'))} ms).",
        f"- int8 / exact all-to-all bytes: decode **{fmt(r.get('int8_over_exact_bytes_decode'), '.3f')}**, prefill "
        f"**{fmt(r.get('int8_over_exact_bytes_prefill'), '.3f')}** (the dispatch half shrinks to (H + 4) / 2H = "
        f"{(shape['hidden_size'] + 4) / (2 * shape['hidden_size']):.3f}; the combine half stays bf16); step time "
        f"int8 / exact: decode **{fmt(r.get('int8_over_exact_time_decode'), '.2f')}**, prefill "
        f"**{fmt(r.get('int8_over_exact_time_prefill'), '.2f')}** (int8 codec "
        f"{fmt((s.get('ep2_int8_decode') or {}).get('codec_ms'), '.2f')} ms per decode step).",
        f"- Wire bytes counted by the wrapper (rows + int64 slot ids + counts) over `bytes_sent` (rows only): "
        f"exact decode {fmt(r.get('wire_over_counter_exact_decode'), '.3f')}, int8 decode "
        f"{fmt(r.get('wire_over_counter_int8_decode'), '.3f')}: the slot ids and counts are not in `bytes_sent`.",
        f"- Expert work per rank in the EP2 runs of this (unskewed) model: balancedness "
        f"{fmt((s.get('ep2_decode') or {}).get('balancedness'), '.3f')} (decode).",
    ]
    q, le = s["quality"], s["layer_error"]
    lines += [
        "", "## int8 dispatch quality", "",
        f"Greedy agreement with exact EP2 over every decoded token of the measured decode phases: "
        f"**{q['int8_vs_ep2']['equal']}/{q['int8_vs_ep2']['tokens']} = {fmt(q['int8_vs_ep2']['agreement'], '.3f')}**"
        f" (identical prefix {fmt(q['int8_vs_ep2']['identical_prefix'], '.3f')}; first token "
        f"{q['int8_vs_ep2']['first_token_equal']}/{q['int8_vs_ep2']['sequences']}). For scale, exact EP2 against "
        f"EP1 on the same prompts: {q['ep2_vs_ep1']['equal']}/{q['ep2_vs_ep1']['tokens']} = "
        f"{fmt(q['ep2_vs_ep1']['agreement'], '.3f')}; int8 EP2 against EP1 {fmt(q['int8_vs_ep1']['agreement'], '.3f')}"
        ". (A random-weight model's next-token distribution is flat, so one flipped token changes the rest of the "
        "sequence: this is a harsh, pessimistic measure.)", "",
        f"One MoE layer's output (layer {le['layer']}, {le['tokens']} real hidden states: 4 x {PREFILL_LEN}-token "
        "prompts through the model, captured at the layer's input), kvbaton's `SparseMoeBlock` experts over the bf16 "
        "rows vs over `dequantize_rows(quantize_rows(rows))`:", "",
        "| | max abs error | mean abs error | relative RMS error | mean abs output |",
        "|---|---|---|---|---|",
        f"| int8 wire vs bf16 | {le['int8_max_abs_err']:.2e} | {le['int8_mean_abs_err']:.2e} "
        f"| {le['int8_rel_rms_err']:.2e} | {le['mean_abs_output']:.2e} |",
        f"| bf16 vs fp32 (bf16's own error, same inputs) | {le['bf16_vs_fp32_max_abs_err']:.2e} "
        f"| {le['bf16_vs_fp32_mean_abs_err']:.2e} | | |", "",
        f"Over all {len(s['layer_error_all'])} layers: int8 relative RMS error "
        f"{min(x['int8_rel_rms_err'] for x in s['layer_error_all']):.2e}-"
        f"{max(x['int8_rel_rms_err'] for x in s['layer_error_all']):.2e}, max abs error up to "
        f"{max(x['int8_max_abs_err'] for x in s['layer_error_all']):.2e}.",
    ]
    e = s.get("eplb")
    lines += ["", "## EPLB on a skewed workload (EP2, 64 experts + 4 redundant slots)", ""]
    if e is None:
        lines.append(f"Not measured: {doc['errors'].get('eplb', '?')}")
    else:
        lines += [
            f"The routers of a copy of the model favour experts {', '.join(map(str, HOT_EXPERTS))}: channel 0 of "
            f"its residual stream is a constant ({SKEW_CHANNEL_VALUE} in every embedding row, written by no "
            "attention or expert output, read by nothing but the routers) and their gate rows get a logit boost on "
            "it, calibrated per layer so that "
            f"about {doc['hot_share']:.0%} of the top-k choices go to them (on held-out prompts of the workload's "
            f"shape: {', '.join(f'{x:.2f}' for x in doc['hot_share_held_out'])} per layer). "
            "EP2's first placement (before any load is known: experts alternate between the ranks, the "
            "4 redundant slots copy experts 0-3) puts all six on rank 0. Each phase has fresh prompts, the shapes "
            f"above (decode: 8 sequences per rank; prefill: one {PREFILL_LEN}-token prompt per rank); "
            f"{doc['repeats']} decode and {doc['repeats']} prefill phases before and as many after "
            "`rebalance_now()` (plan from the load so far, copy the moved experts' weights: "
            f"{fmt(e['rebalance_s'], '.2f')} s).", "",
            "| phase | balancedness (mean / max rows_computed per rank) | rows per rank (all its steps) "
            "| expert slots hit per step, per rank (all layers) | experts ms per rank | ms/step "
            "| all-to-all ms (share) |", "|---|---|---|---|---|---|---|",
        ]
        for key, label in (("before", "decode, before EPLB"), ("after", "decode, after `rebalance_now()`"),
                           ("before_prefill", f"prefill ({PREFILL_LEN} tokens per rank), before"),
                           ("after_prefill", "prefill, after")):
            d = e[key]
            if d is None:
                continue
            rows = " / ".join(f"{p['rows_total']:,}" for p in d["per_rank"])
            slots = " / ".join(f"{p['slots_hit']:.0f}" for p in d["per_rank"])
            experts = " / ".join(f"{1e3 * p['experts']:.1f}" for p in d["per_rank"])
            lines.append(f"| {label} | {fmt(d['balancedness'], '.3f')} | {rows} | {slots} | {experts} "
                         f"| {fmt(d['step_ms'])} | {a2a_cell(d)} |")
        lines += [
            "", f"After / before: balancedness **{fmt(e['balancedness_ratio'], '.2f')}x**, decode step time "
            f"**{fmt(e['time_ratio'], '.2f')}** (< 1: faster after); prefill: balancedness "
            f"**{fmt(e['prefill_balancedness_ratio'], '.2f')}x**, step time **{fmt(e['prefill_time_ratio'], '.2f')}**. "
            "Rank 0's slots of layer 0 after: "
            f"{e['layer0_slots_rank0']}. Greedy outputs against EP1 on the same prompts: before "
            f"{fmt(e['agree_before'], '.3f')}, after {fmt(e['agree_after'], '.3f')} of the tokens; MoE layers on the "
            f"C kernel per rank at the start -> end: {e['kernel_layers']}.",
        ]
        per_slot = lambda d: max(p["rows"] / p["slots_hit"] for p in d["per_rank"] if p["slots_hit"])  # noqa: E731
        top = lambda d: max(p["slots_hit"] for p in d["per_rank"])  # noqa: E731
        if e["before"] and e["after"] and e["before_prefill"]:
            lines += ["", f"A decode step gives each expert slot it hits {per_slot(e['before']):.1f} rows on "
                      "average (the busier rank, median step), so a rank's expert time follows the slots it has to "
                      "read (the "
                      f"busiest rank: {top(e['before']):.0f} before, {top(e['after']):.0f} after), not its rows; "
                      f"prefill ({per_slot(e['before_prefill']):.0f} rows per slot) follows the rows. EPLB's default "
                      "objective balances tokens (`balance_objective=\"active_experts\"` is the other)."]
        if doc["eplb_moe_kernel"] == "off":
            lines += ["", f"These two groups (EP2 and its EP1 reference) ran with `{MOE_KERNEL_ENV}=0` "
                      "(`--eplb-moe-kernel off`, the default): PyTorch's expert loop before and after, so that both "
                      "phases run the same code. On the C MoE kernel (`--eplb-moe-kernel on`) the swap loses it: "
                      "the kernel packs each layer's expert weights in place, and the rebalanced experts are built "
                      "by `stacked_experts` without the kernel, over kept slots copied in packed layout and moved "
                      "ones read unpacked from the checkpoint, so after `rebalance_now()` the layers run PyTorch's "
                      "loop over partly packed weights (slower, and the outputs change). The other sections run on "
                      "the default compute path."]
    lines += [
        "", "## Reading it", "",
        *reading_ep(doc),
        *reading_exchanges(doc),
    ]
    lines += notes_section(doc["notes"])
    lines += ["", f"Raw figures (every step of every rank): `{doc['json_name']}`.", ""]
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------


def summarize(doc: dict, groups: dict[str, list[list[dict]]], per_rank_batch: dict[str, int]) -> dict:
    s: dict[str, Any] = {}
    for key, rounds in groups.items():
        if key in ("eplb", "ep1_skewed") or not rounds:
            continue
        ranks = [r for rnd in rounds for r in rnd]  # every round's ranks: rank records pooled
        pooled = _pool(rounds)
        s[f"{key}_decode"] = step_summary(pooled, "decode", per_rank_batch[key])
        s[f"{key}_prefill"] = step_summary(pooled, "prefill", per_rank_batch[key])
        s[f"{key}_decode_rounds"] = [step_summary(rnd, "decode", per_rank_batch[key]) for rnd in rounds]
        s[f"{key}_init_s"] = [r["init_s"] for r in ranks]
    g = lambda k, f: (s.get(k) or {}).get(f)  # noqa: E731
    ratios = {
        "ep1_over_ep2_decode": _r(g("ep1_decode", "step_ms"), g("ep2_decode", "step_ms")),
        "ep1_over_ep2_prefill": _r(g("ep1_prefill", "step_ms"), g("ep2_prefill", "step_ms")),
        "ep1_over_ep2_decode_rounds": [_r(a["step_ms"], b["step_ms"]) for a, b in
                                       zip(s.get("ep1_decode_rounds", []), s.get("ep2_decode_rounds", []))
                                       if a and b],
        "int8_over_exact_bytes_decode": _r(g("ep2_int8_decode", "bytes_per_step"), g("ep2_decode", "bytes_per_step")),
        "int8_over_exact_bytes_prefill": _r(g("ep2_int8_prefill", "bytes_per_step"),
                                            g("ep2_prefill", "bytes_per_step")),
        "int8_over_exact_time_decode": _r(g("ep2_int8_decode", "step_ms"), g("ep2_decode", "step_ms")),
        "int8_over_exact_time_prefill": _r(g("ep2_int8_prefill", "step_ms"), g("ep2_prefill", "step_ms")),
        "wire_over_counter_exact_decode": _r(g("ep2_decode", "wire_bytes_per_step"), g("ep2_decode", "bytes_per_step")),
        "wire_over_counter_int8_decode": _r(g("ep2_int8_decode", "wire_bytes_per_step"),
                                            g("ep2_int8_decode", "bytes_per_step")),
    }
    for kind in ("decode", "prefill"):
        a, b = g(f"ep2_{kind}", "step_ms"), g(f"ep1_half_{kind}", "step_ms")
        ratios[f"ep2_minus_half_{kind}_ms"] = a - b if a is not None and b is not None else None
    s["ratios"] = ratios
    names = [f"decode-{i}" for i in range(doc["repeats"])]
    s["quality"] = {
        "int8_vs_ep2": pooled_agreement(groups.get("ep2", []), groups.get("ep2_int8", []), names),
        "ep2_vs_ep1": pooled_agreement(groups.get("ep1", []), groups.get("ep2", []), names),
        "int8_vs_ep1": pooled_agreement(groups.get("ep1", []), groups.get("ep2_int8", []), names),
    }
    errs = doc["layer_error"]
    s["layer_error"], s["layer_error_all"] = errs[len(errs) // 2], errs
    eplb = (groups.get("eplb") or [None])[0]
    if eplb:
        before = step_summary(eplb, "decode", DECODE_BATCH // 2, ("before",))
        after = step_summary(eplb, "decode", DECODE_BATCH // 2, ("after",))
        before_pre = step_summary(eplb, "prefill", 1, ("before",))
        after_pre = step_summary(eplb, "prefill", 1, ("after",))
        ref = (groups.get("ep1_skewed") or [None])[0]
        agree = {}
        for phase in ("before", "after"):
            names = [f"{phase}-{i}" for i in range(doc["repeats"])]
            agree[phase] = (pooled_agreement([ref], [eplb], names)["agreement"] if ref else None)
        rebalance = [ph.get("rebalance_s") for r in eplb for ph in r["phases"] if "rebalance_s" in ph]
        s["eplb"] = {"before": before, "after": after, "before_prefill": before_pre, "after_prefill": after_pre,
                     "rebalance_s": max(rebalance) if rebalance else None,
                     "balancedness_ratio": _r(g2(after, "balancedness"), g2(before, "balancedness")),
                     "time_ratio": _r(g2(after, "step_ms"), g2(before, "step_ms")),
                     "prefill_balancedness_ratio": _r(g2(after_pre, "balancedness"), g2(before_pre, "balancedness")),
                     "prefill_time_ratio": _r(g2(after_pre, "step_ms"), g2(before_pre, "step_ms")),
                     "layer0_slots_rank0": eplb[0].get("layer0_slots_end"), "rebalances": eplb[0].get("rebalances"),
                     "agree_before": agree["before"], "agree_after": agree["after"],
                     "kernel_layers": " / ".join(f"{r['moe_kernel_layers']}->{r['moe_kernel_layers_end']}"
                                                 for r in eplb)}
    return s


def g2(d: dict | None, key: str) -> float | None:
    return None if d is None else d.get(key)


def _r(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _pool(rounds: list[list[dict]]) -> list[dict]:
    """Rank r's phases of every round, as one rank record (so medians pool the rounds)."""
    size = len(rounds[0])
    return [{"phases": [ph for rnd in rounds for ph in rnd[r]["phases"]]} for r in range(size)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 1 repeat, 16 decode tokens")
    parser.add_argument("--rounds", type=int, default=2, help="EP1 / EP2 / EP2-int8 groups, interleaved")
    parser.add_argument("--repeats", type=int, default=3, help="decode and prefill phases per group")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--hot-share", type=float, default=0.6, help="skewed model: top-k share of the hot experts")
    parser.add_argument("--sections", default="ep,eplb", help="ep (EP1 / EP2 / int8 rounds), eplb")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--group-timeout-s", type=float, default=180.0, help="one group of rank processes")
    parser.add_argument("--wait-idle", type=float, default=6.0, help="before each group, wait up to S s for quiet")
    parser.add_argument("--wait-lock", type=float, default=900.0,
                        help="wait up to S s for the benchmarks' run lock (another benchmark holding it)")
    parser.add_argument("--eplb-moe-kernel", choices=("on", "off"), default="off",
                        help="the EPLB groups on kvbaton's C MoE kernel (on) or PyTorch's expert loop (off, "
                             f"{MOE_KERNEL_ENV}=0; the default: see the EPLB section of the results)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--render", type=Path, help="write the summary of a results JSON again (no measuring)")
    parser.add_argument("--_rank", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._rank is not None:
        job = json.loads(args._rank.read_text())
        Path(job["result"]).write_text(json.dumps(rank_main(job)))
        return 0
    if args.render is not None:
        doc = json.loads(args.render.read_text())
        doc["summary"] = summarize(doc, doc["groups"], PER_RANK_BATCH)
        md = args.render.with_name(args.render.name.split("-20")[0] + ".md")
        md.write_text(render(doc))
        log(f"wrote {md}")
        return 0
    if args.quick:
        args.rounds, args.repeats, args.decode_tokens = 1, 1, 16

    def on_signal(signum, _frame):
        raise SystemExit(f"stopped by signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    seed = args.seed if args.seed is not None else fresh_seed()
    # NOTE: the lock is what keeps benchmarks apart (one that waits for it is a benchmarks/bench_ process too, so
    # waiting for those while holding it would deadlock); the others are recorded (OverlapWatch) and noted
    lock = take_lock(args.wait_lock)
    started = dt.datetime.now(dt.timezone.utc)
    t_start = time.perf_counter()
    notes: list[str] = []
    env = to_json(environment(with_transformers=True))
    log(f"CPU {env['cpu']} ({env['cpus']} cores), seed {seed}, load average {os.getloadavg()[0]:.2f}")
    doc: dict[str, Any] = {"command": command_line("bench_moe_ep.py", sys.argv[1:] if argv is None else argv),
                           "started": started.strftime("%Y-%m-%d %H:%M UTC"), "environment": env, "seed": seed,
                           "shape": SHAPE, "rounds": args.rounds, "repeats": args.repeats,
                           "decode_tokens": args.decode_tokens, "hot_share": args.hot_share,
                           "eplb_moe_kernel": args.eplb_moe_kernel,
                           "loadavg_start": list(os.getloadavg()), "loadavg_groups": [], "errors": {}, "notes": notes}
    h, i, e = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts"]
    doc["expert_mb"] = e * 3 * h * i * 2 / 2**20
    monitor = LoadMonitor()
    monitor.start()
    groups: dict[str, list[list[dict]]] = {k: [] for k in ("ep1", "ep2", "ep2_int8", "ep1_half", "eplb",
                                                           "ep1_skewed")}
    other_load = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvbaton-bench-moe-ep-") as tmp:
            work = Path(tmp)
            models = build_models(work, seed, args.hot_share)
            doc["layer_error"], doc["hot_share_per_layer"] = models["layer_error"], models["hot_share_per_layer"]
            doc["hot_share_held_out"] = models["hot_share_held_out"]
            doc["params_m"] = model_facts(str(models["uniform"])).params / 1e6

            def group(key: str, tag: str, **kw) -> None:
                doc["loadavg_groups"].append(os.getloadavg()[0])
                wait_idle(args.wait_idle, tag, notes)
                t = time.perf_counter()
                try:
                    with OverlapWatch(FOREIGN) as watch, monitor.window() as w:
                        groups[key].append(run_group(tag, work=work, seed=seed, timeout_s=args.group_timeout_s,
                                                     **kw))
                    res: dict = {}
                    note_load(res, tag, w, notes)
                    if watch.seen:
                        notes.append(f"another benchmark ran during {tag}: {watch.seen[0][:160]}")
                    other_load.append(res["other_load_cores"])
                    log(f"{tag}: {time.perf_counter() - t:.0f}s (other load {res['other_load_cores']:.2f} cores)")
                except RuntimeError as exc:
                    log(f"ERROR {tag}: {exc}")
                    doc["errors"][key] = str(exc).splitlines()[0]
                    notes.append(f"{tag} failed: {str(exc)[-600:]}")

            uniform = models["uniform"]
            sections = set(args.sections.split(","))
            for rnd in range(args.rounds if "ep" in sections else 0):
                order = ["ep1", "ep2", "ep2_int8"] if rnd % 2 == 0 else ["ep2_int8", "ep2", "ep1"]
                for key in order:
                    size = 1 if key == "ep1" else 2
                    n_dec, n_pre = DECODE_BATCH, 2
                    group(key, f"{key}-round{rnd}", model=uniform, size=size, threads=2 // size,
                          int8=key == "ep2_int8",
                          phases=uniform_phases(rnd, args.repeats, n_dec, n_pre, args.decode_tokens))
            if "ep" in sections:
                group("ep1_half", "ep1_half", model=uniform, size=1, threads=1,
                      phases=uniform_phases(0, args.repeats, DECODE_BATCH // 2, 1, args.decode_tokens))
            skewed = models["skewed"]
            eplb_env = {} if args.eplb_moe_kernel == "on" else {MOE_KERNEL_ENV: "0"}
            if "eplb" in sections:
                group("eplb", "eplb", model=skewed, size=2, threads=1, redundant=REDUNDANT, env=eplb_env,
                      phases=eplb_phases(args.repeats, args.decode_tokens, rebalance=True))
                group("ep1_skewed", "ep1_skewed", model=skewed, size=1, threads=1, env=eplb_env,
                      phases=eplb_phases(args.repeats, args.decode_tokens, rebalance=False))
    finally:
        lock.close()
    doc["loadavg_end"] = list(os.getloadavg())
    doc["other_load_cores"] = other_load
    doc["other_load_cores_max"] = max(other_load, default=0.0)
    first = next((rnd[0] for k in ("ep2", "ep1", "eplb") for rnd in groups[k]), None)
    kernel = first["moe_kernel_layers"] if first else 0
    doc["moe_path"] = (f"kvbaton's C MoE kernel ({kernel} of {SHAPE['num_hidden_layers']} layers; compute path "
                       f"{first['compute_path']})" if first and kernel else
                       f"PyTorch's expert loop (compute path {first['compute_path'] if first else '?'})")
    doc["summary"] = summarize(doc, groups, PER_RANK_BATCH)
    doc["groups"] = groups
    doc["wall_s"] = time.perf_counter() - t_start
    files = ResultFiles.of(args.out_dir, RESULT_PREFIX + ("-quick" if args.quick else ""), stamp(started))
    doc["json_name"] = files.json.name
    md = render(doc)
    files.json.write_text(json_text(doc))
    files.md.write_text(md)
    print(md)
    log(f"wrote {files.json} and {files.md} in {doc['wall_s'] / 60:.1f} min")
    return 1 if doc["errors"] else 0


def json_text(doc: dict) -> str:
    """The results JSON: indented, except the per-step records under "groups" (one line, 4 significant digits),
    which would otherwise take a line per number."""
    def compact(x: Any) -> Any:
        if isinstance(x, float):
            return float(f"{x:.4g}")
        if isinstance(x, list):
            return [compact(v) for v in x]
        if isinstance(x, dict):
            return {k: compact(v) for k, v in x.items()}
        return x

    head = json.dumps({k: v for k, v in doc.items() if k != "groups"}, indent=2, default=str)
    return head[:-2] + ',\n  "groups": ' + json.dumps(compact(doc["groups"])) + "\n}\n"


if __name__ == "__main__":
    raise SystemExit(main())
