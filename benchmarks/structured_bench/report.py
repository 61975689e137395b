"""bench_structured.py's report: the ratios between a run's best A, B and C per engine, the notes its runs call
for, and the Markdown tables."""

from __future__ import annotations

import statistics

from common.machine import MODEL_NAME
from common.report import fmt, notes_section, ratio
from structured_bench.workload import ENGINES, SCHEMAS

LABEL = {"kvbaton": "kvbaton serve", "vllm": "vLLM CPU"}
TARGET_RATIO = 0.9


def best(runs: list[dict], kind: str) -> dict | None:
    done = [r for r in runs if r["kind"] == kind and r.get("output_tok_s")]
    return max(done, key=lambda r: r["output_tok_s"]) if done else None


def summarize(results: dict) -> None:
    """Per engine: the ratios between the best runs of each kind, and the notes its runs call for."""
    for e, er in results["engines"].items():
        if "runs" not in er:
            continue
        for r in er["runs"]:
            if r.get("structured", {}).get("failures"):
                results["notes"].append(f"{LABEL[e]} B (seed {r['seed']}): structured failures "
                                        f"{r['structured']['failures'][:4]}")
            if r.get("errors"):
                results["notes"].append(f"{LABEL[e]} {r['kind']} (seed {r['seed']}): errors {r['errors'][:2]}")
            if r.get("overlap"):
                results["notes"].append(f"{LABEL[e]} {r['kind']}: another benchmark ran meanwhile: {r['overlap'][0]}")
        a, b, c = (best(er["runs"], k) for k in "ABC")
        tpot = lambda r: r and r["plain"]["tpot_p50_ms"]
        er["ratios"] = {"b_over_a_tok_s": ratio(b and b["output_tok_s"], a and a["output_tok_s"]),
                        "b_over_c_tok_s": ratio(b and b["output_tok_s"], c and c["output_tok_s"]),
                        "plain_tpot_b_over_a": ratio(tpot(b), tpot(a)), "plain_tpot_b_over_c": ratio(tpot(b), tpot(c))}


def run_rows(engine: str, er: dict) -> list[str]:
    rows = []
    for kind in "ABC":
        r = best(er["runs"], kind)
        if r is None:
            continue
        others = ", ".join(fmt(x["output_tok_s"]) for x in er["runs"] if x["kind"] == kind)
        st = r.get("structured")
        valid = (f"{st['valid']}/{st['n']} valid, {st['in_schema_order']} in schema key order, "
                 f"{st['padded']} with whitespace outside strings, {statistics.mean(st['tokens']):.0f} tokens avg"
                 if st and st["tokens"] else "")
        p = r["plain"]
        rows.append(f"| {LABEL[engine]} | {kind} | {r['completed']}/{r['requests']} | {fmt(r['output_tok_s'])} | "
                    f"{others} | {r['output_tokens']} | {r['wall_s']:.1f} | {fmt(p['tpot_p50_ms'])} | "
                    f"{fmt(p['max_gap_ms'], '.0f')} | {fmt(p['ttft_p50_ms'], '.0f')} | {valid} | "
                    f"{r.get('other_load_cores', 0):.2f} |")
    return rows


def compile_rows(engine: str, er: dict, inproc: dict | None) -> list[str]:
    rows = []
    for name, r in er.get("compile", {}).items():
        lib = (inproc or {}).get("schemas", {}).get(name) if engine == "kvbaton" else None
        lib_cell = f"{lib['compile_ms']:.1f} / {lib['first_mask_ms']:.1f}" if lib else "—"
        rows.append(f"| {LABEL[engine]} | {name} | {fmt(r['plain_p50_ms'])} | {fmt(r['cold_p50_ms'])} | "
                    f"{fmt(r['cached_p50_ms'])} | {fmt(r['compile_ms'])} | {lib_cell} |")
    return rows


def markdown(results: dict) -> str:
    """The report of a run: the set-up, the runs and their ratios, compile times, and the stall check."""
    eng = results["engines"]
    lines = [*head_lines(results), *runs_table(results), *ratio_lines(eng), *compile_table(results),
             *stall_table(eng)]
    return "\n".join(lines + notes_section(results["notes"])) + "\n"


def head_lines(results: dict) -> list[str]:
    """The command, seed, machine and versions, and what each server's log and processes said."""
    env, eng = results["environment"], results["engines"]
    lines = [f"# Structured outputs under batch load — {results['started']}", "",
             f"Command: `{results['command']}`  ",
             f"Seed {results['seed']} · model {MODEL_NAME} (bf16) · {results['threads']} threads per engine · "
             f"wall {results['wall_s'] / 60:.1f} min", "",
             f"Machine: {env['cpu']} ({env['cpus']} CPUs, torch capability {env['torch_cpu_capability']}); "
             f"kvbaton commit {env['kvbaton_commit']}; torch {env['torch']}"
             + "".join(f"; {k} {v}" for k, v in (env.get("peers") or {}).items())]
    for e, er in eng.items():
        keys = ("compute_path", "structured_outputs_config", "auto_backend", "grammar_libraries_before",
                "grammar_libraries")
        facts = {k: er[k] for k in keys if k in er}
        if facts:
            lines.append(f"- {LABEL[e]}: " + "; ".join(f"{k} `{v}`" for k, v in facts.items()))
    return lines


def runs_table(results: dict) -> list[str]:
    """The workload, and a row per engine and run kind (its best run, every run's tok/s beside it)."""
    s, eng = results["sizes"], results["engines"]
    lines = ["", f"Workload: {s['concurrency']} streaming chat requests at once, temperature 1, top_p 1, a seed each, "
             f"max_tokens {s['max_tokens']}; A = all plain (ignore_eos), B = {s['concurrency'] - s['structured']} "
             f"plain + {s['structured']} `response_format` json_schema over {len(SCHEMAS)} schemas new to the "
             f"server each run, C = B's plain half + plain requests cut to B's structured lengths. out tok/s = "
             f"output tokens / (first send → last token); TPOT = (last − first token) / (tokens − 1) per plain "
             f"request; max gap = the longest pause between two chunks of any plain request. Best of "
             f"{s['repeats']} (by out tok/s; all runs listed).", "",
             "| engine | run | completed | out tok/s | all runs | out tokens | wall s | plain TPOT p50 ms | "
             "plain max gap ms | plain TTFT p50 ms | structured | other load (cores) |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for e, er in eng.items():
        lines += run_rows(e, er) if "runs" in er else [f"| {LABEL[e]} | | | | | | | | | | "
                                                      f"{er.get('skipped') or er.get('error')} | |"]
    return lines


def ratio_lines(eng: dict) -> list[str]:
    """B against A and C per engine (against the targets), and kvbaton against vLLM."""
    lines = ["", f"Ratios (best runs; target: out tok/s ≥ {TARGET_RATIO}, plain TPOT ≤ 1/{TARGET_RATIO}):", "",
             "| engine | B/A out tok/s | B/C out tok/s (same tokens, no grammar) | plain TPOT B/A | plain TPOT B/C |",
             "|---|---:|---:|---:|---:|"]
    for e, er in eng.items():
        if r := er.get("ratios"):
            lines.append(f"| {LABEL[e]} | {fmt(r['b_over_a_tok_s'], '.2f')} | {fmt(r['b_over_c_tok_s'], '.2f')} | "
                         f"{fmt(r['plain_tpot_b_over_a'], '.2f')} | {fmt(r['plain_tpot_b_over_c'], '.2f')} |")
    lines.append("\nB has fewer output tokens than A (a grammar ends its output when the JSON closes) in about the "
                 "same wall time (the plain half's max_tokens steps set it), so B/A is below 1 even at no grammar "
                 "cost; B/C compares the same token work with and without grammars.")
    if all("ratios" in eng.get(e, {}) for e in ENGINES):
        kv, vl = eng["kvbaton"], eng["vllm"]
        lines.append("\nkvbaton ÷ vLLM out tok/s: " + ", ".join(
            f"{k} {fmt(ratio((best(kv['runs'], k) or {}).get('output_tok_s'), (best(vl['runs'], k) or {}).get('output_tok_s')), '.2f')}"  # noqa: E501
            for k in "ABC"))
    return lines


def compile_table(results: dict) -> list[str]:
    """Cold against cached TTFT per schema, and llguidance's compile in this process."""
    s, eng = results["sizes"], results["engines"]
    inproc = results.get("inproc_compile")
    lines = ["", f"Compile time: one request at a time, max_tokens 2, TTFT p50 over {s['compile_rounds']} fresh "
             "variant(s) per schema; compile ≈ cold − cached. llguidance in-process: kvbaton's GrammarCompiler "
             "in this process, compile / first mask of a fresh matcher"
             + (f" (its tokenizer: {inproc['tokenizer_s']:.1f} s)" if inproc and "tokenizer_s" in inproc else ""),
             "", "| engine | schema | plain TTFT ms | cold TTFT ms | cached TTFT ms | cold − cached ms | "
             "llguidance in-process compile / first mask ms |", "|---|---|---:|---:|---:|---:|---|"]
    for e, er in eng.items():
        lines += compile_rows(e, er, inproc)
    return lines


def stall_table(eng: dict) -> list[str]:
    """The plain streams' gaps while a structured request with a new schema waits for its first token."""
    lines = ["", "Stall check: 4 plain streams decoding when a structured request with a new schema arrives "
             "(first: the first structured request after start; later: another new schema after it):", "",
             "| engine | when | structured TTFT ms | plain gap p50 ms | plain gap max ms, until its first token |",
             "|---|---|---:|---:|---:|"]
    for e, er in eng.items():
        for when, st in (er.get("stall") or {}).items():
            lines.append(f"| {LABEL[e]} | {when} | {fmt(st['json_ttft_ms'])} | {fmt(st['plain_gap_p50_ms'])} | "
                         f"{fmt(st['plain_gap_max_ms'], '.0f')} |")
    return lines
