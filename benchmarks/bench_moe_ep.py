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
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.contention import LoadMonitor, OverlapWatch, note_load, take_lock, wait_idle
from common.log import log
from common.machine import environment, model_facts
from common.procs import stop_pids, thread_env
from common.prompts import fresh_seed
from common.records import to_json
from common.report import RESULTS_DIR, ResultFiles, command_line, stamp
from moe_ep_bench.models import DECODE_BATCH, DECODE_PROMPT, MOE_KERNEL_ENV, PREFILL_LEN, SHAPE, build_models
from moe_ep_bench.rank import rank_main
from moe_ep_bench.report import render
from moe_ep_bench.summary import summarize

REDUNDANT = 4  # EPLB slots: (64 + 4) / 2 = 34 per rank
RESULT_PREFIX = "moe-ep"
PER_RANK_BATCH = {"ep1": DECODE_BATCH, "ep2": DECODE_BATCH // 2, "ep2_int8": DECODE_BATCH // 2,
                  "ep1_half": DECODE_BATCH // 2}  # decode sequences per rank, per set-up
FOREIGN = "benchmarks/bench_"  # other benchmark processes (command lines) seen during a group are noted


# ---- the groups ---------------------------------------------------------------------------------


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


@dataclass
class Run:
    """What every group of a run shares: its settings, where the ranks work, the load monitor, and what the groups
    leave (the results JSON's document, the rank records per set-up, the other load during each group)."""

    args: argparse.Namespace
    doc: dict[str, Any]
    seed: int
    monitor: LoadMonitor
    work: Path
    groups: dict[str, list[list[dict]]] = field(default_factory=lambda: {k: [] for k in (
        "ep1", "ep2", "ep2_int8", "ep1_half", "eplb", "ep1_skewed")})
    other_load: list[float] = field(default_factory=list)

    def group(self, key: str, tag: str, **kw: Any) -> None:
        """One group of rank processes after waiting for a quiet machine; its ranks go to `groups[key]`, the other
        load during it to the notes, and a failure to the errors (the run goes on)."""
        doc, notes = self.doc, self.doc["notes"]
        doc["loadavg_groups"].append(os.getloadavg()[0])
        wait_idle(self.args.wait_idle, tag, notes)
        t = time.perf_counter()
        try:
            with OverlapWatch(FOREIGN) as watch, self.monitor.window() as w:
                self.groups[key].append(run_group(tag, work=self.work, seed=self.seed,
                                                  timeout_s=self.args.group_timeout_s, **kw))
            res: dict = {}
            note_load(res, tag, w, notes)
            if watch.seen:
                notes.append(f"another benchmark ran during {tag}: {watch.seen[0][:160]}")
            self.other_load.append(res["other_load_cores"])
            log(f"{tag}: {time.perf_counter() - t:.0f}s (other load {res['other_load_cores']:.2f} cores)")
        except RuntimeError as exc:
            log(f"ERROR {tag}: {exc}")
            doc["errors"][key] = str(exc).splitlines()[0]
            notes.append(f"{tag} failed: {str(exc)[-600:]}")


def measure(run: Run) -> None:
    """Build the models, then the sections' groups: EP1 / EP2 / EP2-int8 rounds (interleaved, the order reversed
    every other round) and EP1 at one rank's share; EPLB on the skewed model and its EP1 reference."""
    args, doc = run.args, run.doc
    models = build_models(run.work, run.seed, args.hot_share)
    doc["layer_error"], doc["hot_share_per_layer"] = models["layer_error"], models["hot_share_per_layer"]
    doc["hot_share_held_out"] = models["hot_share_held_out"]
    doc["params_m"] = model_facts(str(models["uniform"])).params / 1e6
    uniform = models["uniform"]
    sections = set(args.sections.split(","))
    for rnd in range(args.rounds if "ep" in sections else 0):
        order = ["ep1", "ep2", "ep2_int8"] if rnd % 2 == 0 else ["ep2_int8", "ep2", "ep1"]
        for key in order:
            size = 1 if key == "ep1" else 2
            n_dec, n_pre = DECODE_BATCH, 2
            run.group(key, f"{key}-round{rnd}", model=uniform, size=size, threads=2 // size,
                      int8=key == "ep2_int8",
                      phases=uniform_phases(rnd, args.repeats, n_dec, n_pre, args.decode_tokens))
    if "ep" in sections:
        run.group("ep1_half", "ep1_half", model=uniform, size=1, threads=1,
                  phases=uniform_phases(0, args.repeats, DECODE_BATCH // 2, 1, args.decode_tokens))
    skewed = models["skewed"]
    eplb_env = {} if args.eplb_moe_kernel == "on" else {MOE_KERNEL_ENV: "0"}
    if "eplb" in sections:
        run.group("eplb", "eplb", model=skewed, size=2, threads=1, redundant=REDUNDANT, env=eplb_env,
                  phases=eplb_phases(args.repeats, args.decode_tokens, rebalance=True))
        run.group("ep1_skewed", "ep1_skewed", model=skewed, size=1, threads=1, env=eplb_env,
                  phases=eplb_phases(args.repeats, args.decode_tokens, rebalance=False))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    return parser.parse_args(argv)


def new_doc(args: argparse.Namespace, argv: list[str] | None, seed: int, started: dt.datetime) -> dict[str, Any]:
    """The results JSON's document as a run starts: its command, machine, seed and settings."""
    env = to_json(environment(with_transformers=True))
    log(f"CPU {env['cpu']} ({env['cpus']} cores), seed {seed}, load average {os.getloadavg()[0]:.2f}")
    doc: dict[str, Any] = {"command": command_line("bench_moe_ep.py", sys.argv[1:] if argv is None else argv),
                           "started": started.strftime("%Y-%m-%d %H:%M UTC"), "environment": env, "seed": seed,
                           "shape": SHAPE, "rounds": args.rounds, "repeats": args.repeats,
                           "decode_tokens": args.decode_tokens, "hot_share": args.hot_share,
                           "eplb_moe_kernel": args.eplb_moe_kernel,
                           "loadavg_start": list(os.getloadavg()), "loadavg_groups": [], "errors": {}, "notes": []}
    h, i, e = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts"]
    doc["expert_mb"] = e * 3 * h * i * 2 / 2**20
    return doc


def write_results(run: Run, started: dt.datetime, t_start: float) -> int:
    """The run's summary, JSON and Markdown report; 1 if a group failed."""
    doc, groups, other_load = run.doc, run.groups, run.other_load
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
    files = ResultFiles.of(run.args.out_dir, RESULT_PREFIX + ("-quick" if run.args.quick else ""), stamp(started))
    doc["json_name"] = files.json.name
    md = render(doc)
    files.json.write_text(json_text(doc))
    files.md.write_text(md)
    print(md)
    log(f"wrote {files.json} and {files.md} in {doc['wall_s'] / 60:.1f} min")
    return 1 if doc["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    doc = new_doc(args, argv, seed, started)
    monitor = LoadMonitor()
    monitor.start()
    try:
        with tempfile.TemporaryDirectory(prefix="kvbaton-bench-moe-ep-") as tmp:
            run = Run(args=args, doc=doc, seed=seed, monitor=monitor, work=Path(tmp))
            measure(run)
    finally:
        lock.close()
    return write_results(run, started, t_start)


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
