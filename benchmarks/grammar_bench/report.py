"""bench_grammar_engines.py's report: every table of a run, as Markdown."""

from __future__ import annotations

from typing import Any

from common.report import notes_section
from grammar_bench.grammars import GRAMMARS, WALKS
from grammar_bench.measure import BATCH, ms


def f1(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def markdown(doc: dict[str, Any]) -> str:
    """The report of a run: every table, the other load during each part, and the notes."""
    res = doc["engines"]
    names = [n for n in res if "error" not in res[n]]
    lines = [*setup_table(doc, names), *compile_table(res, names), *walk_table(res, names),
             *batch_table(res, names), *apply_table(doc), *coverage_tables(res, names)]
    loads = {f"{n} {k}": v for n in names for k, v in res[n].get("other_load_cores", {}).items()}
    loads.update({f"bitmask {k}": v for k, v in doc.get("other_load_cores", {}).items()})
    lines += ["", "Other load (CPU cores used by other processes, machine-wide) during each part: "
              + ", ".join(f"{k} {v:.2f}" for k, v in loads.items())]
    lines += notes_section(doc["notes"])
    return "\n".join(lines) + "\n"


def setup_table(doc: dict[str, Any], names: list[str]) -> list[str]:
    """The run (command, machine, versions, tokenizer), the engines skipped, and each engine's setup time."""
    env, res = doc["environment"], doc["engines"]
    lines = [f"# Grammar engines — {doc['started']}", "",
             f"Command: `{doc['command']}`  ",
             f"Machine: {env['cpu']} ({env['cpus']} CPUs), {env['threads']} threads; python {env['python']}, "
             f"torch {env['torch']}, transformers {env['transformers']}; "
             + ", ".join(f"{n} {res[n]['version']}" for n in names)
             + f"; kvbaton commit {env['kvbaton_commit']}  ",
             f"Tokenizer: {env['tokenizer']} (vocab {env['vocab_size']}, EOS {env['eos']})", ""]
    for n in res:
        if "error" in res[n]:
            lines.append(f"- {n}: skipped — {res[n]['error']}")
    lines += ["", "## Setup (once per tokenizer)", "", "| engine | step | ms |", "|---|---|---:|",
              f"| (shared) | transformers AutoTokenizer.from_pretrained | {ms(env['hf_tokenizer_s']):.0f} |"]
    for n in names:
        for step, s in res[n]["setup_s"].items():
            lines.append(f"| {n} | {step} | {f1(ms(s))} |")
    return lines


def compile_table(res: dict[str, Any], names: list[str]) -> list[str]:
    """First compile, again, a new matcher and the first mask, per grammar and engine."""
    lines = ["", "## Compile", "",
             "first = compile from scratch (xgrammar: cache cleared; median of the runs); again = the same grammar "
             "once more (xgrammar: its compiler cache; llguidance: no cache, a new `LLMatcher` from the grammar "
             "string); new matcher = a request's matcher from the compiled grammar (llguidance `deep_copy`, "
             "xgrammar `GrammarMatcher(compiled)`); first mask = a fresh compile's first matcher + its first "
             "mask fill (llguidance builds its lexer lazily, so part of its compile lands here).", "",
             "| grammar | engine | first ms | again ms | new matcher µs | first mask ms | compiled size KB |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for g in GRAMMARS:
        for n in names:
            c = res[n]["compile"][g]
            mem = "—" if c["memory_bytes"] is None else f"{c['memory_bytes'] / 1024:.0f}"
            lines.append(f"| {g} | {n} | {f1(c['first_compile_ms'])} | {f1(c['again_ms'])} | "
                         f"{f1(c['new_matcher_us'])} | {f1(c['first_mask_ms'])} | {mem} |")
    return lines


def walk_table(res: dict[str, Any], names: list[str]) -> list[str]:
    """Fill and consume per token, one request walking a valid document."""
    lines = ["", "## Mask speed, one request", "",
             "A valid document walked token by token: fill the [1, V/32] bitmask, check the next token is allowed, "
             "consume it; EOS last. µs per token over every document but the first (a fresh matcher each), and "
             "the first document alone (its matcher the first one of a fresh compile).", "",
             "| schema | engine | docs × tokens | fill mean | fill p50 | fill p99 | consume mean | consume p50 | "
             "consume p99 | 1st doc fill mean | 1st doc fill max |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in WALKS:
        for n in names:
            w = res[n]["walk"][s]
            fl, co, ff = w["fill"], w["consume"], w["first_walk_fill"]
            lines.append(f"| {s} | {n} | {w['docs']} × {w['tokens_per_doc']:.0f} | {f1(fl['mean_us'])} | "
                         f"{f1(fl['p50_us'])} | {f1(fl['p99_us'])} | {f1(co['mean_us'])} | {f1(co['p50_us'])} | "
                         f"{f1(co['p99_us'])} | {f1(ff['mean_us'])} | {f1(ff['max_us'])} |")
    return lines


def batch_table(res: dict[str, Any], names: list[str]) -> list[str]:
    """Batch fill against one by one, and the batch consume, BATCH requests in lock-step."""
    lines = ["", f"## Mask speed, {BATCH} requests in lock-step", "",
             f"µs per step for all {BATCH} (each request on its own document; a warm-up round not counted): "
             "the engine's batch fill, the same masks filled one by one (checked equal), and the batch consume.", "",
             "| schema | engine | steps | batch fill mean | p50 | p99 | one-by-one fill mean | p50 | "
             "batch consume mean | p99 |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in WALKS:
        for n in names:
            b = res[n]["batch"][s]
            bf, sf, bc = b["batch_fill"], b["one_by_one_fill"], b["batch_consume"]
            lines.append(f"| {s} | {n} | {b['steps']} | {f1(bf['mean_us'])} | {f1(bf['p50_us'])} | "
                         f"{f1(bf['p99_us'])} | {f1(sf['mean_us'])} | {f1(sf['p50_us'])} | {f1(bc['mean_us'])} | "
                         f"{f1(bc['p99_us'])} |")
    return lines


def apply_table(doc: dict[str, Any]) -> list[str]:
    """Each way of applying the bitmask to logits, one row and BATCH rows."""
    env = doc["environment"]
    lines = ["", "## Applying the bitmask to float32 logits", "",
             "µs per call after warm-up (the first call, with any compile, separately).", "",
             f"| method | [1, {env['vocab_size']}] p50 | p99 | [{BATCH}, {env['vocab_size']}] p50 | p99 | "
             "first call ms |", "|---|---:|---:|---:|---:|---:|"]
    for name, by_rows in doc["apply"].items():
        one, many = by_rows["1"], by_rows[str(BATCH)]
        lines.append(f"| {name} | {f1(one['p50_us'])} | {f1(one['p99_us'])} | {f1(many['p50_us'])} | "
                     f"{f1(many['p99_us'])} | {f1(one['first_call_ms'])} |")
    return lines


def coverage_tables(res: dict[str, Any], names: list[str]) -> list[str]:
    """What each engine does with each JSON-schema keyword and grammar format (xgrammar also without strict_mode)."""
    lines: list[str] = []
    cols = [(n, "json_schema", n) for n in names]
    if "xgrammar" in names:
        cols.append(("xgrammar", "json_schema_strict_mode_false", "xgrammar strict_mode=False"))
    for section, title in (("json_schema", "JSON-schema keywords"), ("formats", "Grammar formats")):
        shown = cols if section == "json_schema" else [(n, "formats", n) for n in names]
        lines += ["", f"## Coverage: {title}", "",
                  "Each compiled and given a valid and an invalid instance (tokenized by the model's tokenizer, "
                  "then EOS): enforced = the valid passes and the invalid does not.", "",
                  "| feature | " + " | ".join(c[2] for c in shown) + " |", "|---|" + "---|" * len(shown)]
        for feat in res[names[0]]["coverage"][section] if names else []:
            lines.append(f"| {feat} | " + " | ".join(res[n]["coverage"][sec][feat] for n, sec, _ in shown) + " |")
    return lines
