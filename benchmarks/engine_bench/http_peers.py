"""The peers measured through their servers and tools: vLLM's OpenAI server, llama.cpp's
`llama-bench` (in-process timings) and `llama-server`."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.contention import note_load, wait_idle
from common.log import log
from common.procs import thread_env
from common.prompts import make_prompts
from common.records import Latency, LlamaBench, LlamaBenchRow, ServerMeasure, Throughput, to_json
from common.servers import Server, ServerSpec, free_port
from engine_bench.measure import PROBE_N, PROBE_OUT, best_of, latency_summary, log_latency, throughput_skip

SERVER_START_S = 420  # vLLM recompiles the model at every start: ~3 min on 2 cores


async def _stream_one(base: str, model: str, prompt: list[int], out_len: int, extra: dict) -> Latency:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    stamps: list[float] = []
    usage = None
    # trust_env=False: no proxy between us and 127.0.0.1
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), trust_env=False) as client:
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
    return latency_summary(t0, stamps, n, len(prompt), chunks=len(stamps))


async def _complete_many(base: str, model: str, prompts: list[list[int]], out_len: int, extra: dict) -> Throughput:
    import httpx

    async def one(prompt: list[int]) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0.0,
                "ignore_eos": True, **extra}
        # a fresh connection per request: reused keep-alive connections dropped requests (peers/README.md)
        async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), trust_env=False) as client:
            resp = await client.post(f"{base}/v1/completions", json=body)
            resp.raise_for_status()
            return resp.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    elapsed = time.perf_counter() - t0
    n_out = sum(counts)
    return Throughput(elapsed_s=elapsed, output_tokens=n_out, output_tok_s=n_out / elapsed,
                      total_tok_s=(n_out + sum(map(len, prompts))) / elapsed, concurrency=len(prompts))


def measure_server(server: Server, model: str, args: argparse.Namespace, vocab: int, tag: str,
                   throughput: bool, extra: dict) -> ServerMeasure:
    """Warm-up, batch-1 latency (streaming), and, when asked, throughput under concurrency."""
    s, base = args.sizes, server.base_url
    t = time.perf_counter()
    for p in make_prompts(args.seed, f"{tag}-warm", 1, s.prompt_len, vocab):
        asyncio.run(_stream_one(base, model, p, 4, extra))
    probe_s = None
    if throughput:
        probe = make_prompts(args.seed, f"{tag}-warmbatch", PROBE_N, s.prompt_len, vocab)
        probe_s = asyncio.run(_complete_many(base, model, probe, PROBE_OUT, extra)).elapsed_s
    warmup_s = time.perf_counter() - t
    prompts = make_prompts(args.seed, "latency", s.latency_repeats, s.prompt_len, vocab)
    latency = best_of([asyncio.run(_stream_one(base, model, p, s.out_len, extra)) for p in prompts])
    log_latency(tag, latency)
    tp: Throughput | None = None
    skip = throughput_skip(args, latency, probe_s) if throughput else None
    if throughput and skip is None:
        prompts = make_prompts(args.seed, "throughput", s.tp_prompts, s.prompt_len, vocab)
        tp = asyncio.run(_complete_many(base, model, prompts, s.out_len, extra))
        log(f"{tag} throughput: {tp.output_tok_s:.1f} output tok/s")
    return ServerMeasure(probe_s=probe_s, warmup_s=warmup_s, latency=latency, throughput=skip or tp)


def _measured_server(args: argparse.Namespace, spec: ServerSpec, what: str,
                     measure: Callable[[Server], ServerMeasure]) -> tuple[dict, str | None]:
    """Start the server, run `measure(server)` inside a load window, stop it by PID whatever
    happens. Returns (the figures with the server's start-up, a start failure or None)."""
    server = Server(spec)
    try:
        server.start()
    except RuntimeError as exc:
        return {}, str(exc)
    args.monitor.roots.add(server.pid)
    res: dict[str, Any] = {"startup_s": server.startup_s}
    try:
        with args.monitor.window() as window:
            res["measure"] = to_json(measure(server))
        note_load(res["measure"], what, window, args.busy_notes)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        server.stop()
    return res, None


def run_vllm(args: argparse.Namespace, dtype: str, vocab: int) -> dict:
    peers = args.peer_paths
    if missing := peers.missing("vllm"):
        return {"skipped": missing}
    version = peers.vllm_version()
    busy = wait_idle(args.wait_idle, f"vllm {dtype}", args.busy_notes)
    spec = peers.vllm_server(model_dir=args.model_dir, port=free_port(), dtype=dtype, threads=args.threads,
                             timeout_s=SERVER_START_S)
    got, failed = _measured_server(args, spec, f"vllm {dtype}", lambda server: measure_server(
        server, Path(args.model_dir).name, args, vocab, f"vllm-{dtype}", True, {}))
    if failed:
        return {"error": f"vllm serve failed: {failed}", "version": version}
    res = {"version": version, "startup_s": got["startup_s"], "busy_before": busy, "log": str(spec.log_path)}
    return res | got.get("measure", {}) | ({"error": got["error"]} if "error" in got else {})


def _llama_bench(args: argparse.Namespace, bench: Path, gguf: Path, dtype: str) -> dict:
    s = args.sizes
    # pp: prompt processing of prompt_len tokens; tg: out_len tokens generated after a prompt_len-token
    # context (-d), i.e. the same decode depth as the other engines' latency run.
    cmd = [str(bench), "-m", str(gguf), "-t", str(args.threads), "-p", str(s.prompt_len), "-n", str(s.out_len),
           "-r", str(max(2, s.latency_repeats)), "-o", "json"]
    if "-d, --n-depth" in subprocess.run([str(bench), "--help"], capture_output=True, text=True).stdout:
        cmd += ["-d", f"0,{s.prompt_len}"]
    res: dict[str, Any] = {"busy_before": wait_idle(args.wait_idle, f"llama.cpp {dtype}", args.busy_notes)}
    log(f"llama.cpp {dtype}: {' '.join(cmd[1:])}")
    with args.monitor.window() as window:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=thread_env(args.threads))
    note_load(res, f"llama-bench {dtype}", window, args.busy_notes)
    if proc.returncode != 0:
        return res | {"error": f"llama-bench failed: {proc.stderr[-1500:]}"}
    rows = json.loads(proc.stdout)
    pp = [r for r in rows if r["n_prompt"] == s.prompt_len and r["n_gen"] == 0 and not r.get("n_depth")]
    tg = [r for r in rows if r["n_gen"] == s.out_len]
    tg_deep = [r for r in tg if r.get("n_depth") == s.prompt_len] or tg
    bench_rows = [LlamaBenchRow(n_prompt=r.get("n_prompt"), n_gen=r.get("n_gen"), n_depth=r.get("n_depth"),
                                avg_ts=r.get("avg_ts"), stddev_ts=r.get("stddev_ts")) for r in rows]
    figures = LlamaBench(pp_tok_s=pp[0]["avg_ts"] if pp else None,
                         tg_tok_s_at_depth=tg_deep[0]["avg_ts"] if tg_deep else None,
                         tg_depth=tg_deep[0].get("n_depth", 0) if tg_deep else None,
                         tg_tok_s_depth0=next((r["avg_ts"] for r in tg if not r.get("n_depth")), None))
    return res | {"bench_cmd": shlex.join(cmd), "build_commit": rows[0].get("build_commit"),
                  "bench_rows": to_json(bench_rows), "bench": to_json(figures)}


def run_llamacpp(args: argparse.Namespace, dtype: str, vocab: int) -> dict:
    peers = args.peer_paths
    if missing := peers.missing("llamacpp", binary="llama-bench"):
        return {"skipped": missing}
    gguf = peers.gguf_path(dtype)
    res: dict[str, Any] = {"gguf": str(gguf)}
    try:
        peers.ensure_gguf(args.model_dir, dtype, args.threads)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return res | {"error": str(exc)}
    res |= _llama_bench(args, peers.llama_bin("llama-bench"), gguf, dtype)
    if "error" in res:
        return res
    # llama-server: the same streaming latency request as vLLM (one slot).
    spec = peers.llama_server(gguf=gguf, port=free_port(), slots=1, threads=args.threads, timeout_s=SERVER_START_S)
    got, failed = _measured_server(args, spec, f"llama-server {dtype}", lambda server: measure_server(
        server, gguf.stem, args, vocab, f"llama-server-{dtype}", False, {"cache_prompt": False}))
    if failed:
        return res | {"server_error": failed[-1500:]}
    if "measure" in got:
        res["server"] = got["measure"]
    if "error" in got:
        res["server_error"] = got["error"]
    return res
