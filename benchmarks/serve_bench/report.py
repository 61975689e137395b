"""bench_serve's summary: one table per workload, kvbaton's figures over each peer's, the two
clients side by side (c), and served against offline (d)."""

from __future__ import annotations

from common.machine import MODEL_NAME
from common.report import fmt, notes_section, ratio
from serve_bench.plan import ENGINE_LABEL

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
    """Add (c)'s client ratios and (d)'s served-over-offline figures to `results`."""
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
    out += notes_section(results.get("notes") or [])
    return "\n".join(out) + "\n"
