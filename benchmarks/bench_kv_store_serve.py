"""The shared-prefix workload over HTTP, side by side with vLLM CPU: kvbaton serving two replicas with the
shm KV tier (a prefix one replica computed is loaded by the other), the same two replicas without it, and
vLLM with its own (local, automatic) prefix cache, all on the default model in bf16, in one run.

    export KVBATON_PEER_SCRIPTS=/work/shared/peers KVBATON_PEERS_DIR=/work/peers
    .venv/bin/python benchmarks/bench_kv_store_serve.py            # ~8 min on 2 cores

Workload: `--groups` groups of `--per-group` requests; a group's requests share a system prompt of
`--system-tokens` random token ids and add `--user-tokens` fresh ones; requests go one at a time, a group after
another, round robin over kvbaton's replicas (so a group's second request lands on the replica that did not
compute the prefix). Each request asks for one token: its latency is its TTFT. Every server gets its own fresh
prompts (a prefix cache must not see a prompt twice across servers). vLLM's peer script serves at most 2048
tokens, hence 1984 system tokens. Results: benchmarks/results/kv-store-serve.md and kv-store-serve-<stamp>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common.machine import MODEL_NAME, cpu_name
from common.peers import add_peer_args, resolve_peers
from common.procs import thread_env
from common.servers import Server, ServerSpec, free_port, kvbaton_server

RESULTS = Path(__file__).parent / "results"


def prompts_for(rng: random.Random, groups: int, per_group: int, system: int, user: int) -> list[list[int]]:
    out = []
    for _ in range(groups):
        prefix = [rng.randrange(100, 40000) for _ in range(system)]
        out += [prefix + [rng.randrange(100, 40000) for _ in range(user)] for _ in range(per_group)]
    return out


def run(base: str, prompts: list[list[int]]) -> list[dict]:
    """One request at a time; per request its latency (= TTFT: one token asked) and the cached tokens it reports."""
    rows = []
    with httpx.Client(timeout=600) as http:
        http.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": [7, 8, 9], "max_tokens": 1})  # warm
        for prompt in prompts:
            start = time.perf_counter()
            r = http.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1,
                                                          "temperature": 0})
            elapsed = time.perf_counter() - start
            r.raise_for_status()
            details = (r.json().get("usage") or {}).get("prompt_tokens_details") or {}
            rows.append({"ttft_s": elapsed, "cached_tokens": details.get("cached_tokens")})
    return rows


def summary(rows: list[dict], per_group: int) -> dict:
    """p50/p99 of every request, and of the requests after each group's first (the ones a prefix cache can help)."""
    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]

    all_s = [r["ttft_s"] for r in rows]
    reuse = [r["ttft_s"] for i, r in enumerate(rows) if i % per_group]
    second = [r["ttft_s"] for i, r in enumerate(rows) if i % per_group == 1]  # kvbaton: on the other replica
    return {"ttft_p50": statistics.median(all_s), "ttft_p99": pct(all_s, 0.99),
            "reuse_ttft_p50": statistics.median(reuse), "reuse_ttft_p99": pct(reuse, 0.99),
            "second_ttft_p50": statistics.median(second), "ttft_s": all_s,
            "cached_tokens": [r["cached_tokens"] for r in rows]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1984)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=None)
    add_peer_args(ap)
    args = ap.parse_args(argv)
    peers = resolve_peers(args, ["vllm"], leave_out="there is no run without vLLM here")
    assert peers is not None
    if missing := peers.missing("vllm"):
        raise SystemExit(missing)
    from kvbaton.models.registry import pull_default_model

    model_dir = str(pull_default_model())
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    doc: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "seed": seed, "command": " ".join(sys.argv),
                 "vllm_version": peers.vllm_version(),
                 "workload": vars(args) | {"peer_dir": None, "peer_scripts": None}}
    print(f"CPU {doc['cpu']} ({doc['cores']} cores), vLLM {doc['vllm_version']}, seed {seed}", flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="kvbaton-kv-store-serve-"))  # the kvbaton servers' logs
    print(f"server logs: {log_dir}", flush=True)
    replicas = ["--model", model_dir, "--served-model-name", MODEL_NAME, "--dtype", "bfloat16", "--decode", "2",
                "--routing", "round_robin", "--max-model-len", "2048", "--threads", str(args.threads)]
    specs: dict[str, ServerSpec] = {}
    for label, extra in (("kvbaton-shm", ["--kv-store", "shm"]), ("kvbaton-none", [])):
        port = free_port()
        specs[label] = kvbaton_server(name=label, port=port, serve_args=[*replicas, *extra],
                                      log_path=log_dir / f"{label}-{port}.log", env=thread_env(args.threads),
                                      timeout_s=600)
    port = free_port()
    specs["vllm"] = peers.vllm_server(model_dir=model_dir, port=port, dtype="bfloat16", threads=args.threads,
                                      timeout_s=900)
    for label, spec in specs.items():
        prompts = prompts_for(rng, args.groups, args.per_group, args.system_tokens, args.user_tokens)
        with Server(spec) as server:
            doc[label] = summary(run(server.base_url, prompts), args.per_group)
        s = doc[label]
        print(f"{label}: TTFT p50 {s['ttft_p50'] * 1e3:.0f} ms, p99 {s['ttft_p99'] * 1e3:.0f} ms; after a group's "
              f"first request p50 {s['reuse_ttft_p50'] * 1e3:.0f} ms, p99 {s['reuse_ttft_p99'] * 1e3:.0f} ms; a "
              f"group's second request p50 {s['second_ttft_p50'] * 1e3:.0f} ms (cached tokens "
              f"{s['cached_tokens'][1::args.per_group]})", flush=True)
    for label in ("kvbaton-shm", "kvbaton-none"):
        for metric in ("ttft_p50", "reuse_ttft_p50", "second_ttft_p50"):
            doc[f"vllm_over_{label}_{metric}"] = doc["vllm"][metric] / doc[label][metric]
    print(f"vLLM / kvbaton-shm: TTFT p50 {doc['vllm_over_kvbaton-shm_ttft_p50']:.2f}x, second requests "
          f"{doc['vllm_over_kvbaton-shm_second_ttft_p50']:.2f}x; kvbaton-none / kvbaton-shm second requests "
          f"{doc['kvbaton-none']['second_ttft_p50'] / doc['kvbaton-shm']['second_ttft_p50']:.2f}x", flush=True)
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    (RESULTS / f"kv-store-serve-{stamp}.json").write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {RESULTS / f'kv-store-serve-{stamp}.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
