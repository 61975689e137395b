#!/usr/bin/env python
"""Cold start as a product figure: how long a worker takes to serve, phase by phase; how long `kvbaton serve` takes
to answer /health and its first token; how long a replaced decode worker (a fresh process) takes to serve again
after the old one was killed. HF transformers (load + first token) is the peer measured in the same run.

    .venv/bin/python benchmarks/bench_cold_start.py                   # this checkout; writes results/cold-start.md
    .venv/bin/python benchmarks/bench_cold_start.py --before 851dd12  # and the code of a commit, side by side

Each figure is the median of `--runs` starts (default 3), each a fresh process. "warm": the page cache holds the
model, the kernels are built and (this code) the packed weights are kept. "cold": the kernels and packed weights
are built anew (a fresh cache root that links the converted models) and, where this user may, the page cache is
dropped first. The phase breakdown runs the engine's own start in a subprocess (`PHASES` below), so any commit's
code can be measured the same way.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common.log import log
from common.machine import cpu_kind, cpu_name, kvbaton_commit
from common.report import RESULTS_DIR, command_line, fmt, ratio
from common.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"

# One engine start in a fresh interpreter, timed in phases that every commit has (the newer code also reports its
# own laps): the imports a worker does, the EOS ids (the old code built transformers' tokenizer for them), the
# engine core (weights, compute plan, KV pools), and one short request.
PHASES = r"""
import json, sys, time
t0 = time.perf_counter()
import kvbaton.worker.main  # what a worker imports
from kvbaton.config import EngineConfig, ModelConfig
from kvbaton.engine.core import EngineCore
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.models.registry import resolve_model
from kvbaton.platform.process import set_compute_threads
import kvbaton.text.tokenizer as tok
t1 = time.perf_counter()
set_compute_threads(2)
model_dir = resolve_model(sys.argv[1])
cfg = ModelConfig.from_dir(model_dir)
try:
    eos = tok.eos_token_ids(cfg, model_dir)
except (TypeError, AttributeError):
    eos = tok.eos_token_ids(cfg, tok.Tokenizer(model_dir))  # the older signature
t2 = time.perf_counter()
core = EngineCore(EngineConfig(model=str(model_dir)), model_dir, eos)
t3 = time.perf_counter()
req = core.new_request("r", list(range(100, 164)), SamplingParams(max_tokens=1, temperature=0))
core.add_request(req)
while core.has_unfinished_requests():
    core.step()
t4 = time.perf_counter()
laps = getattr(getattr(core, "startup", None), "phases", {})
print("PHASES " + json.dumps({"interpreter": None, "imports": t1 - t0, "eos ids": t2 - t1, "engine core": t3 - t2,
                              "first request": t4 - t3, "core laps": laps}))
"""

HF_PEER = r"""
import sys, time
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
ids = tok("Hello", return_tensors="pt").input_ids
model.generate(ids, max_new_tokens=1, do_sample=False)
print(f"HF {time.perf_counter() - t0}")
"""


def python_env(code_root: Path, cache_root: Path | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(code_root), "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    if cache_root is not None:
        env["KVBATON_CACHE"] = str(cache_root)
    return env


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def fresh_cache_root(parent: Path) -> Path:
    """A cache root with no kernels and no packed weights, whose models/ is the real one (no re-conversion)."""
    from kvbaton.paths import models_dir

    root = Path(tempfile.mkdtemp(prefix="cold-", dir=parent))
    (root / "models").symlink_to(models_dir())
    return root


def phases(code_root: Path, cold: bool, scratch: Path) -> dict:
    cache = fresh_cache_root(scratch) if cold else None
    if cold:
        drop_page_cache()
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PHASES, MODEL], env=python_env(code_root, cache), cwd=scratch,
                         capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PHASES ")), None)
    if line is None:
        raise RuntimeError(f"phase run failed: {out.stderr[-2000:]}")
    doc = json.loads(line[len("PHASES "):])
    doc["interpreter"] = wall - sum(v for k, v in doc.items() if isinstance(v, float))
    doc["total"] = wall
    return doc


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


class Serve:
    """`kvbaton serve` of `code_root` on a free loopback port, stopped by PID (its workers go with it)."""

    def __init__(self, code_root: Path, args: list[str], cache: Path | None, log_path: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--port", str(self.port), *args]
        self.started = time.perf_counter()
        with open(log_path, "w") as fh:
            self.proc = subprocess.Popen(cmd, env=python_env(code_root, cache), stdout=fh, stderr=subprocess.STDOUT,
                                         cwd=log_path.parent)

    def wait_healthy(self, timeout_s: float = 300) -> float:
        deadline = time.perf_counter() + timeout_s
        while not http_ok(f"{self.base}/health"):
            if self.proc.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError("kvbaton serve did not become healthy")
            time.sleep(0.02)
        return time.perf_counter() - self.started

    def first_token(self) -> float:
        t = time.perf_counter()
        post(f"{self.base}/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0})
        return time.perf_counter() - t

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve_start(code_root: Path, cold: bool, scratch: Path) -> dict:
    cache = fresh_cache_root(scratch) if cold else None
    if cold:
        drop_page_cache()
    server = Serve(code_root, [], cache, scratch / "serve.log")
    try:
        healthy = server.wait_healthy()
        return {"healthy": healthy, "first token": server.first_token(), "ready after health + 1 token":
                healthy + server.first_token()}
    finally:
        server.stop()


def failover(code_root: Path, scratch: Path) -> dict:
    """1 prefill + 1 decode worker; SIGKILL the decode worker; the time until a new decode process serves."""
    server = Serve(code_root, ["--prefill", "1", "--decode", "1"], None, scratch / "failover.log")
    try:
        server.wait_healthy()
        server.first_token()
        old = next(w for w in get(f"{server.base}/workers")["workers"] if w["role"] == "decode")
        os.kill(old["pid"], signal.SIGKILL)
        killed = time.perf_counter()
        while True:
            workers = get(f"{server.base}/workers")["workers"]
            new = next((w for w in workers if w["role"] == "decode" and w["pid"] != old["pid"] and w["healthy"]),
                       None)
            if new is not None:
                break
            if time.perf_counter() - killed > 300:
                raise RuntimeError("no replacement decode worker in 300 s")
            time.sleep(0.02)
        back = time.perf_counter() - killed
        serving = back + server.first_token()
        return {"kill to replacement joined": back, "kill to first token": serving,
                "replacement launch to ready": new.get("ready_after_s")}
    finally:
        server.stop()


def hf_peer(scratch: Path) -> float:
    from kvbaton.models.registry import resolve_model

    out = subprocess.run([sys.executable, "-c", HF_PEER, str(resolve_model(MODEL))], capture_output=True, text=True,
                         env=python_env(ROOT, None), cwd=scratch, timeout=600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("HF ")), None)
    if line is None:
        raise RuntimeError(f"HF peer failed: {out.stderr[-2000:]}")
    return float(line.split()[1])


def median_of(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    out: dict = {k: statistics.median(r[k] for r in runs if r.get(k) is not None) for k in keys}
    laps = [r["core laps"] for r in runs if r.get("core laps")]
    if laps:
        out["core laps"] = {k: statistics.median(lap.get(k, 0.0) for lap in laps) for k in laps[0]}
    return out


def measure(code_root: Path, args: argparse.Namespace, scratch: Path) -> dict:
    result: dict = {}
    for kind in ("cold", "warm"):
        cold = kind == "cold"
        if not cold:
            phases(code_root, False, scratch)  # fill the page cache, build what a warm start finds built
        log(f"{code_root}: phases, {kind}")
        result[f"phases {kind}"] = median_of([phases(code_root, cold, scratch) for _ in range(args.runs)])
        log(f"{code_root}: kvbaton serve, {kind}")
        result[f"serve {kind}"] = median_of([serve_start(code_root, cold, scratch) for _ in range(args.runs)])
    if args.failover:
        log(f"{code_root}: failover")
        result["failover"] = median_of([failover(code_root, scratch) for _ in range(args.runs)])
    return result


def worktree(ref: str, scratch: Path) -> Path:
    path = scratch / f"before-{ref}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref], check=True,
                   capture_output=True)
    return path


def table(results: dict[str, dict], section: str) -> list[str]:
    names = list(results)
    rows = sorted({k for r in results.values() for k, v in r.get(section, {}).items() if isinstance(v, float)},
                  key=lambda k: list(next(iter(results.values()))[section]).index(k)
                  if k in next(iter(results.values()))[section] else 99)
    out = [f"| {section} (s) | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for row in rows:
        out.append(f"| {row} | " + " | ".join(fmt(results[n].get(section, {}).get(row), ".2f") for n in names) + " |")
    return out


def report(results: dict[str, dict], hf_s: float, args: argparse.Namespace, argv: list[str]) -> str:
    now = results["this checkout"]
    lines = [f"# Cold start — {dt.datetime.now().isoformat(timespec='seconds')}", "",
             f"CPU: {cpu_name()} ({cpu_kind()}), {os.cpu_count()} cores; commit {kvbaton_commit()}; "
             f"median of {args.runs} starts each.", "", f"Command: `{command_line('bench_cold_start.py', argv)}`", ""]
    for section in ("serve warm", "serve cold", "phases warm", "phases cold", "failover"):
        if any(section in r for r in results.values()):
            lines += table(results, section) + [""]
    laps = now.get("phases warm", {}).get("core laps")
    if laps:
        lines += ["Engine core laps, warm (this checkout): " + ", ".join(f"{k} {v:.2f} s" for k, v in laps.items()),
                  ""]
    healthy = now["serve warm"]["healthy"]
    lines += [f"Peer, same run: HF transformers load + first token {hf_s:.2f} s; kvbaton serve healthy (warm) "
              f"{healthy:.2f} s = {fmt(ratio(healthy, hf_s), '.2f')}x HF's time."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--before", default=None, help="also measure this git commit's code (a temporary worktree)")
    ap.add_argument("--no-failover", dest="failover", action="store_false")
    ap.add_argument("--out", default=str(RESULTS_DIR / f"cold-start-{cpu_kind()}.md"))
    args = ap.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvbaton-cold-") as tmp:
        scratch = Path(tmp)
        roots = {"this checkout": ROOT}
        if args.before:
            roots[f"before ({args.before})"] = worktree(args.before, scratch)
        try:
            for name, root in roots.items():
                results[name] = measure(root, args, scratch)
            hf_s = statistics.median(hf_peer(scratch) for _ in range(args.runs))
        finally:
            for root in roots.values():
                if root != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(root)],
                                   capture_output=True)
    md = report(results, hf_s, args, sys.argv[1:])
    Path(args.out).write_text(md)
    Path(args.out).with_suffix(".json").write_text(json.dumps({"results": results, "hf_s": hf_s}, indent=2))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
