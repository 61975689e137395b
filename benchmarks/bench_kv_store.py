"""The KV store's tiers against their raw media, fetch-or-recompute's crossover, cross-worker TTFT on a
shared-prefix workload, and failover recovery from a snapshot, in one run on the default model.

    .venv/bin/python benchmarks/bench_kv_store.py                  # every section (~10 min on 2 cores)
    .venv/bin/python benchmarks/bench_kv_store.py --sections tiers,crossover

Sections (results in benchmarks/results/kv-store.md, the raw figures in kv-store-<stamp>.json):
- tiers: load 256 blocks of the default model's layout (bf16: 360 KiB a block) from each tier into a pool
  through the store (`TieredStore.load`), against the raw medium in the same run: memcpy of the same
  bytes (shm), reading the same files into memory (disk, page cache warm), redis-py GET of same-size
  values from the same server (redis).
- crossover: the measured prefill time per token against each tier's time per block: loading wins while
  a block loads faster than its block_size tokens compute.
- shared_prefix: groups of requests sharing a 2k-token system prompt, alternating between two engines
  (replica A computes a group's first request, replica B gets the next): TTFT with the shm tier vs
  without, and, with nothing to reuse (fresh prompts), the store's overhead. HF transformers computes
  the same prompts from scratch as the peer.
- background_load: 4 requests decoding when a request whose 4k-token prefix is in redis (or on disk) arrives:
  the longest gap between the streams' tokens while it loads, and its TTFT, with the load on the loader
  thread (the default for tiers that wait on I/O) vs inside the step (`background_loads=False`).
- failover: a resumed attempt's first token (prompt + 16 generated tokens as its new prompt) on a fresh
  engine, loading the context from the shm tier vs recomputing it, at 1k and 4k tokens of context.
Every prompt is fresh (random token ids from a new seed per run), so no cache outside the one measured helps.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common.machine import cpu_name
from kvbaton import LLM, SamplingParams
from kvbaton.config import KVStoreConfig
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.pools import allocate_pools
from kvbaton.kv.redis_server import start_redis_server
from kvbaton.kv.store.disk_tier import DiskTier
from kvbaton.kv.store.factory import store_record_key
from kvbaton.kv.store.keys import StoreKeys
from kvbaton.kv.store.redis_tier import RedisTier
from kvbaton.kv.store.shm_tier import ShmTier, remove_arenas
from kvbaton.kv.store.tiered import TieredStore

RESULTS = Path(__file__).parent / "results"
LAYOUT = KVLayout.standard(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="bfloat16")
NUM_BLOCKS = 256
SECTIONS = ("tiers", "crossover", "shared_prefix", "multi_turn", "failover", "write_policy", "background_load")


def pctl(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# ---- tiers ---------------------------------------------------------------------------------------

def _filled_pools():
    pools = allocate_pools(LAYOUT, NUM_BLOCKS)
    gen = torch.Generator().manual_seed(0)
    for cache in pools.caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return pools


def _store_load_s(tier, pools) -> tuple[float, float]:
    """(seconds to write NUM_BLOCKS through the store, seconds to load them back into a second pool), best of 3."""
    keys = StoreKeys(b"benchkvs")
    hashes = [os.urandom(16) for _ in range(NUM_BLOCKS)]
    src = TieredStore([tier], keys, pools)
    start = time.perf_counter()
    src.save(list(zip(hashes, range(NUM_BLOCKS))))
    tier.flush(60)
    write_s = time.perf_counter() - start
    dst = TieredStore([tier], keys, allocate_pools(LAYOUT, NUM_BLOCKS))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        loaded = dst.load(hashes, list(range(NUM_BLOCKS)))
        best = min(best, time.perf_counter() - start)
        assert loaded == NUM_BLOCKS, f"{tier.name}: loaded {loaded} of {NUM_BLOCKS}"
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(dst.io.pools.caches[layer], pools.caches[layer]), "loaded blocks differ"
    return write_s, best


def _raw_memcpy_s(pools) -> float:
    buf = bytearray(LAYOUT.bytes_per_block * NUM_BLOCKS)
    dst = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    n = LAYOUT.block_bytes
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for b in range(NUM_BLOCKS):  # the same per-layer row copies a load does, from one buffer to the pool
            for layer in range(LAYOUT.num_layers):
                ctypes.memmove(pools.address(layer) + b * n, dst + (b * 30 + layer) * n, n)
        best = min(best, time.perf_counter() - start)
    return best


def _raw_file_read_s(directory: Path) -> float:
    files = sorted(directory.rglob("*.kvb"))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for f in files:
            with f.open("rb") as fh:
                fh.read()
        best = min(best, time.perf_counter() - start)
    return best


def _raw_redis_get_s(url: str) -> float:
    import redis

    client = redis.Redis.from_url(url)
    value = os.urandom(LAYOUT.bytes_per_block)
    for i in range(NUM_BLOCKS):
        client.set(f"raw:{i}", value)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for i in range(NUM_BLOCKS):
            client.get(f"raw:{i}")
        best = min(best, time.perf_counter() - start)
    client.close()
    return best


def section_tiers() -> dict:
    pools = _filled_pools()
    mb = LAYOUT.bytes_per_block * NUM_BLOCKS / 1e6
    out = {}
    name = f"bench-{os.getpid()}"
    shm = ShmTier(name, LAYOUT.bytes_per_block, 4 * NUM_BLOCKS * LAYOUT.bytes_per_block, 600)
    write_s, load_s = _store_load_s(shm, pools)
    raw = _raw_memcpy_s(pools)
    out["shm"] = {"write_s": write_s, "load_s": load_s, "raw_s": raw, "raw": "memcpy of the same rows"}
    shm.close()
    remove_arenas(name)
    with tempfile.TemporaryDirectory() as tmp:
        disk = DiskTier(Path(tmp), LAYOUT.bytes_per_block, 2 * NUM_BLOCKS * LAYOUT.bytes_per_block, 600,
                        record_key=store_record_key())
        write_s, load_s = _store_load_s(disk, pools)
        out["disk"] = {"write_s": write_s, "load_s": load_s, "raw_s": _raw_file_read_s(Path(tmp)),
                       "raw": "reading the same files (page cache)"}
        disk.close()
    server = start_redis_server(maxmemory_mb=512, maxmemory_policy="allkeys-lru")
    try:
        red = RedisTier(server.url, LAYOUT.bytes_per_block, 600, record_key=store_record_key())
        write_s, load_s = _store_load_s(red, pools)
        out["redis"] = {"write_s": write_s, "load_s": load_s, "raw_s": _raw_redis_get_s(server.url),
                        "raw": "redis-py GET of same-size values"}
        red.close()
    finally:
        server.stop()
    for tier, r in out.items():
        r["load_gb_s"] = mb / 1e3 / r["load_s"]
        r["raw_gb_s"] = mb / 1e3 / r["raw_s"]
        r["write_gb_s"] = mb / 1e3 / r["write_s"]
        r["load_per_block_ms"] = r["load_s"] / NUM_BLOCKS * 1e3
        print(f"tier {tier}: load {r['load_gb_s']:.2f} GB/s ({r['load_per_block_ms']:.3f} ms/block), raw "
              f"{r['raw_gb_s']:.2f} GB/s ({r['raw']}): store/raw {r['load_gb_s'] / r['raw_gb_s']:.2f}; "
              f"write {r['write_gb_s']:.2f} GB/s", flush=True)
    return out


# ---- engines -------------------------------------------------------------------------------------

def fresh_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token (one generated token), and the prompt tokens it found cached."""
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1))[0]
    return time.perf_counter() - start, out.metrics.num_cached_tokens


def engine(store: KVStoreConfig | None, max_model_len: int = 8192) -> LLM:
    kwargs = {"kv_store": store} if store is not None else {}
    return LLM(dtype="bfloat16", max_model_len=max_model_len, kv_cache_memory_gb=1.0, **kwargs)


def hf_prefill_s(model_dir: Path, prompt: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    with torch.no_grad():
        model(torch.tensor([prompt[:64]]))  # warm
        start = time.perf_counter()
        model(torch.tensor([prompt]))
        return time.perf_counter() - start


def section_crossover(tiers: dict | None, rng: random.Random) -> dict:
    llm = engine(None)
    ttft(llm, fresh_prompt(rng, 64))  # warm
    seconds, _ = ttft(llm, fresh_prompt(rng, 2048))
    token_s = seconds / 2048
    out = {"prefill_s_per_token": token_s, "block_compute_ms": token_s * 16 * 1e3}
    print(f"crossover: prefill {token_s * 1e3:.3f} ms/token = {token_s * 16 * 1e3:.2f} ms per 16-token block; "
          f"a tier pays while it loads a {LAYOUT.bytes_per_block // 1024} KiB block faster, i.e. above "
          f"{LAYOUT.bytes_per_block / (token_s * 16) / 1e9:.3f} GB/s", flush=True)
    for tier, r in (tiers or {}).items():
        out[tier] = r["load_per_block_ms"] / (token_s * 16 * 1e3)
        print(f"  {tier}: load/compute per block {out[tier]:.3f} ({'load' if out[tier] < 1 else 'recompute'})")
    return out


def section_shared_prefix(rng: random.Random, model_dir: Path, groups: int = 6, per_group: int = 4,
                          no_reuse_reps: int = 10) -> dict:
    """Both configurations run side by side, group after group, so the noise of a shared machine hits both alike."""
    arena = f"bench-sp-{os.getpid()}"
    configs = {"none": None, "shm": KVStoreConfig(tiers=("shm",), shm_name=arena, shm_gb=2.0)}
    pairs = {label: (engine(store), engine(store)) for label, store in configs.items()}
    for a, b in pairs.values():
        ttft(a, fresh_prompt(rng, 32)), ttft(b, fresh_prompt(rng, 32))  # warm
    cross: dict[str, list[float]] = {label: [] for label in pairs}
    cached: dict[str, list[int]] = {label: [] for label in pairs}
    for _ in range(groups):
        system = fresh_prompt(rng, 2048)
        for label, (a, b) in pairs.items():
            for i in range(per_group):  # A computes the first; then the replicas alternate
                s, c = ttft(a if i % 2 == 0 else b, system + fresh_prompt(rng, 32))
                if i == 1:  # the group's first request on replica B: a cross-worker hit, or none
                    cross[label].append(s)
                    cached[label].append(c)
    fresh: dict[str, list[float]] = {label: [] for label in pairs}
    for _ in range(no_reuse_reps):  # nothing to reuse: what looking up and writing through cost
        for label, (_, b) in pairs.items():
            fresh[label].append(ttft(b, fresh_prompt(rng, 1024))[0])
    results: dict = {}
    for label, (a, b) in pairs.items():
        results[label] = {"cross_worker_ttft_p50": pctl(cross[label], 50),
                          "cross_worker_ttft_p99": pctl(cross[label], 99),
                          "cached_tokens_mean": statistics.mean(cached[label]),
                          "no_reuse_ttft_p50": pctl(fresh[label], 50)}
        if configs[label] is not None:
            results[label]["tiers"] = [vars(t) for t in b.engine.core.store.stats()]
        for llm in (a, b):
            llm.engine.core.close()
        r = results[label]
        print(f"shared prefix [{label}]: cross-worker TTFT p50 {r['cross_worker_ttft_p50'] * 1e3:.0f} ms, "
              f"p99 {r['cross_worker_ttft_p99'] * 1e3:.0f} ms, cached {r['cached_tokens_mean']:.0f} tokens; "
              f"no-reuse 1k TTFT p50 {r['no_reuse_ttft_p50'] * 1e3:.0f} ms", flush=True)
    remove_arenas(arena)
    hf = hf_prefill_s(model_dir, fresh_prompt(rng, 2048 + 32))
    results["hf_prefill_2080_s"] = hf
    none, shm = results["none"], results["shm"]
    results["speedup_p50"] = none["cross_worker_ttft_p50"] / shm["cross_worker_ttft_p50"]
    results["no_reuse_overhead"] = shm["no_reuse_ttft_p50"] / none["no_reuse_ttft_p50"] - 1
    print(f"shared prefix: cross-worker TTFT p50 without/with the shm tier {results['speedup_p50']:.2f}x "
          f"(target >= 3); HF prefill of the same length {hf * 1e3:.0f} ms: HF/kvbaton-with-tier "
          f"{hf / shm['cross_worker_ttft_p50']:.2f}x; no-reuse overhead {results['no_reuse_overhead']:+.1%}",
          flush=True)
    return results


def section_multi_turn(rng: random.Random, conversations: int = 4, turns: int = 5) -> dict:
    """Chats whose turns alternate between two replicas (as a load balancer without session affinity does):
    each turn's prompt is the whole history (a 512-token start, then 64 user tokens and 32 answer tokens a
    turn), so every turn after the first finds its history on the other replica. TTFT of turns 2..n."""
    arena = f"bench-mt-{os.getpid()}"
    configs = {"none": None, "shm": KVStoreConfig(tiers=("shm",), shm_name=arena, shm_gb=2.0)}
    pairs = {label: (engine(store), engine(store)) for label, store in configs.items()}
    answer = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    times: dict[str, list[float]] = {label: [] for label in pairs}
    for _ in range(conversations):
        opening = fresh_prompt(rng, 512)
        user_turns = [fresh_prompt(rng, 64) for _ in range(turns)]
        for label, replicas in pairs.items():
            history = list(opening)
            for t in range(turns):
                llm = replicas[t % 2]
                history += user_turns[t]
                start = time.perf_counter()
                out = llm.generate([{"prompt_token_ids": history}], answer)[0]
                if t:
                    times[label].append(out.metrics.ttft if out.metrics and out.metrics.ttft is not None
                                        else time.perf_counter() - start)
                history += list(out.outputs[0].token_ids)
    results: dict = {}
    for label, replicas in pairs.items():
        results[label] = {"ttft_p50": pctl(times[label], 50), "ttft_p99": pctl(times[label], 99)}
        for llm in replicas:
            llm.engine.core.close()
    remove_arenas(arena)
    results["speedup_p50"] = results["none"]["ttft_p50"] / results["shm"]["ttft_p50"]
    print(f"multi-turn: TTFT p50 {results['none']['ttft_p50'] * 1e3:.0f} ms without the store, "
          f"{results['shm']['ttft_p50'] * 1e3:.0f} ms with shm ({results['speedup_p50']:.2f}x); p99 "
          f"{results['none']['ttft_p99'] * 1e3:.0f} vs {results['shm']['ttft_p99'] * 1e3:.0f} ms", flush=True)
    return results


def section_failover(rng: random.Random) -> dict:
    arena = f"bench-fo-{os.getpid()}"
    store = KVStoreConfig(tiers=("shm",), shm_name=arena, shm_gb=2.0)
    out = {}
    for context in (1024, 4096):
        first = engine(store)
        prompt = fresh_prompt(rng, context)
        gen = first.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=16,
                                                                              ignore_eos=True))[0]
        resumed = prompt + list(gen.outputs[0].token_ids)  # what the router sends the next worker
        first.engine.core.close()
        timings = {}
        for label, cfg in (("snapshot", store), ("re-prefill", None)):
            llm = engine(cfg)
            ttft(llm, fresh_prompt(rng, 32))  # warm
            timings[label], cached = ttft(llm, resumed)
            timings[f"{label}_cached"] = cached
            llm.engine.core.close()
        timings["speedup"] = timings["re-prefill"] / timings["snapshot"]
        out[context] = timings
        print(f"failover at {context} tokens: first token of the resumed attempt {timings['snapshot'] * 1e3:.0f} ms "
              f"from the snapshot ({timings['snapshot_cached']} tokens loaded) vs {timings['re-prefill'] * 1e3:.0f} ms "
              f"re-prefilling: {timings['speedup']:.1f}x (target >= 3)", flush=True)
    remove_arenas(arena)
    return out


def section_write_policy(rng: random.Random, num_prompts: int = 24, length: int = 512) -> dict:
    """Engine A runs fresh prompts (its pool small enough to evict), then engine B the same prompts: A's time
    per policy (the writes' cost) and the prompt tokens B loads (what another worker gets to reuse)."""
    prompts = [fresh_prompt(rng, length) for _ in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = {}
    for policy in ("none", "write-through", "write-back"):
        arena = f"bench-wp-{os.getpid()}-{policy}"
        store = None if policy == "none" else KVStoreConfig(tiers=("shm",), shm_name=arena, shm_gb=2.0,
                                                            write_policy=policy)
        kwargs = {"kv_store": store} if store is not None else {}
        a = LLM(dtype="bfloat16", max_model_len=2048, num_blocks=8 * length // 16, max_num_seqs=8, **kwargs)
        a.generate([{"prompt_token_ids": fresh_prompt(rng, 32)}], params)  # warm
        start = time.perf_counter()
        a.generate([{"prompt_token_ids": p} for p in prompts], params)
        a_s = time.perf_counter() - start
        a.engine.core.close()
        loaded = 0
        if store is not None:
            b = LLM(dtype="bfloat16", max_model_len=2048, kv_cache_memory_gb=1.0, **kwargs)
            outs = b.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1))
            loaded = sum(o.metrics.num_cached_tokens for o in outs)
            b.engine.core.close()
            remove_arenas(arena)
        out[policy] = {"engine_a_s": a_s, "tokens_b_reused": loaded, "tokens_total": num_prompts * length}
        print(f"write policy {policy}: engine A {a_s:.2f} s for {num_prompts} x {length}-token prompts; engine B "
              f"reused {loaded} of {num_prompts * length} prompt tokens", flush=True)
    for policy in ("write-through", "write-back"):
        out[policy]["overhead"] = out[policy]["engine_a_s"] / out["none"]["engine_a_s"] - 1
    return out


def _step_until_first_token(eng, request_id: str, streams: list[str], limit: int = 2000) -> tuple[float, float]:
    """Step `eng` until `request_id` has its first token: (its TTFT, the longest gap between two tokens of any
    of `streams` meanwhile), in seconds."""
    start = last = time.perf_counter()
    longest = 0.0
    for _ in range(limit):
        outs = eng.step()
        now = time.perf_counter()
        if any(o.request_id in streams for o in outs):
            longest, last = max(longest, now - last), now
        if any(o.request_id == request_id for o in outs):
            return now - start, max(longest, now - last)
    raise RuntimeError(f"{request_id} had no token after {limit} steps")


def section_background_load(rng: random.Random, context: int = 4096, num_streams: int = 4) -> dict:
    from kvbaton.kv.redis_server import start_redis_server

    server = start_redis_server(maxmemory_mb=2048, maxmemory_policy="allkeys-lru")
    out: dict = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:  # the tiers a load waits on: shm loads stay in the step
            for tier, store in (("redis", KVStoreConfig(tiers=("redis",), redis_url=server.url)),
                                ("disk", KVStoreConfig(tiers=("disk",), disk_dir=tmp, disk_gb=2.0))):
                out[tier] = _background_load(rng, store, tier, context, num_streams)
    finally:
        server.stop()
    return out


def _background_load(rng: random.Random, store: KVStoreConfig, tier: str, context: int, num_streams: int) -> dict:
    prompts = {mode: fresh_prompt(rng, context) for mode in ("background", "inline")}
    a = engine(store)
    a.generate([{"prompt_token_ids": p} for p in prompts.values()], SamplingParams(temperature=0, max_tokens=1))
    a.engine.core.store.flush(60.0)
    a.engine.core.close()
    out: dict = {}
    for mode, prompt in prompts.items():
        eng = engine(dataclasses.replace(store, background_loads=mode == "background")).engine
        streams = [f"s{i}" for i in range(num_streams)]
        for rid in streams:
            eng.add_request(rid, {"prompt_token_ids": fresh_prompt(rng, 64)},
                            SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        for _ in range(8):  # their prompts, then steady decoding
            eng.step()
        steady = [time.perf_counter()]
        for _ in range(8):
            eng.step()
            steady.append(time.perf_counter())
        eng.add_request("hit", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
        ttft_s, gap_s = _step_until_first_token(eng, "hit", streams)
        cached = eng.core.scheduler.num_store_hit_tokens
        out[mode] = {"ttft_s": ttft_s, "max_stream_gap_s": gap_s, "loaded_tokens": cached,
                     "steady_step_s": statistics.median(np.diff(steady).tolist())}
        print(f"background_load {tier} {mode}: {num_streams} streams' longest gap {gap_s * 1e3:.0f} ms (steady step "
              f"{out[mode]['steady_step_s'] * 1e3:.0f} ms) while a {context}-token prefix loads ({cached} tokens); "
              f"its TTFT {ttft_s * 1e3:.0f} ms", flush=True)
        eng.core.close()
    out["gap_ratio"] = out["inline"]["max_stream_gap_s"] / out["background"]["max_stream_gap_s"]
    out["ttft_ratio"] = out["background"]["ttft_s"] / out["inline"]["ttft_s"]
    print(f"background_load {tier}: the streams' longest gap {out['gap_ratio']:.2f}x shorter in the background; "
          f"the loaded request's TTFT {out['ttft_ratio']:.2f}x", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    torch.set_num_threads(os.cpu_count() or 1)
    from kvbaton.models.registry import pull_default_model

    model_dir = pull_default_model()
    doc: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "seed": seed, "command": " ".join(sys.argv)}
    print(f"CPU {doc['cpu']} ({doc['cores']} cores), seed {seed}", flush=True)
    if "tiers" in sections:
        doc["tiers"] = section_tiers()
    if "crossover" in sections:
        doc["crossover"] = section_crossover(doc.get("tiers"), rng)
    if "shared_prefix" in sections:
        doc["shared_prefix"] = section_shared_prefix(rng, model_dir)
    if "multi_turn" in sections:
        doc["multi_turn"] = section_multi_turn(rng)
    if "failover" in sections:
        doc["failover"] = section_failover(rng)
    if "write_policy" in sections:
        doc["write_policy"] = section_write_policy(rng)
    if "background_load" in sections:
        doc["background_load"] = section_background_load(rng)
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    (RESULTS / f"kv-store-{stamp}.json").write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {RESULTS / f'kv-store-{stamp}.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
