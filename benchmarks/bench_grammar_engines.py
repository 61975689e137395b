#!/usr/bin/env python
"""The two grammar engines for structured outputs, side by side on this CPU: llguidance and xgrammar.

With the default model's tokenizer (SmolLM2-135M-Instruct, vocab 49152) it measures, per engine:

- setup: building the engine's tokenizer view (llguidance `LLTokenizer` from tokenizer.json, as kvbaton
  does; xgrammar `TokenizerInfo.from_huggingface` + `GrammarCompiler`);
- compile: any-JSON object, a small and a large JSON schema, a regex, a choice of 5 strings — the first
  compile (xgrammar: cache cleared), again (xgrammar: its compiler cache; llguidance has none, so a new
  `LLMatcher` from the grammar string), a new matcher for a request (llguidance `deep_copy` of the compiled
  matcher, xgrammar `GrammarMatcher(compiled)`), and the first mask of a fresh matcher (llguidance builds
  its lexer lazily, so part of its compile shows there);
- mask speed: a valid JSON document of the small and the large schema walked token by token (fill the
  [1, V/32] int32 bitmask, check the next token is allowed, consume it; EOS last), µs per token; then 16
  matchers in lock-step (llguidance `LLExecutor` + `fill_next_token_bitmask_par` / `consume_token_par`,
  xgrammar `BatchGrammarMatcher`), µs per step for the batch, against filling the 16 masks one by one;
- applying a bitmask to [1, V] and [16, V] float32 logits: llguidance's torch.compile'd kernel, a plain
  torch version (unpack the bits with `>> arange(32)`, `masked_fill_`) and xgrammar's CPU kernel;
- coverage: JSON-schema keywords and grammar formats, each compiled and given a valid and an invalid
  instance: is the keyword enforced, ignored (the invalid one passes), refused, or too strict?

An engine that does not import is skipped with a message. Both engines in one process need a venv with
both (xgrammar's Linux wheel pulls triton, ~1 GB; see benchmarks/results/grammar-engines.md):

    .venv/bin/python benchmarks/bench_grammar_engines.py                       # llguidance only (kvbaton's venv)
    /tmp/gramvenv/bin/python benchmarks/bench_grammar_engines.py --json /tmp/grammar-engines.json
    ... --engines xgrammar --quick                                             # one engine, smoke sizes
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.metadata
import json
import os
import platform
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from common.contention import take_lock
from common.log import log
from common.machine import MODEL_NAME, cpu_name, kvbaton_commit
from common.report import command_line, write_json
from grammar_bench.engines import ENGINES, Engine
from grammar_bench.measure import (
    measure_apply,
    measure_batch,
    measure_compile,
    measure_coverage,
    measure_walks,
    measured,
)
from grammar_bench.report import markdown

DEFAULT_TOKENIZER = Path(os.environ.get("KVBATON_CACHE", Path.home() / ".cache" / "kvbaton")) / "models" / MODEL_NAME


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER,
                    help="HF model/tokenizer dir (tokenizer.json; config.json for the vocab size)")
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--threads", type=int, default=2, help="torch, LLExecutor, xgrammar compiler and batch threads")
    ap.add_argument("--quick", action="store_true", help="smoke sizes (fewer reps and tokens)")
    ap.add_argument("--wait-idle", type=float, default=600,
                    help="seconds to wait for other load to go before each part (measured anyway after that)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--md", type=Path, help="also write the markdown report here")
    args = ap.parse_args()
    if unknown := set(args.engines.split(",")) - set(ENGINES):
        ap.error(f"unknown engine(s) {sorted(unknown)}; choose from {sorted(ENGINES)}")
    return args


def load_tokenizer(path: Path) -> tuple[Any, float, int, int]:
    """The model's transformers tokenizer (what xgrammar's setup and the documents' tokens need), the seconds it
    took to load, the vocabulary size (config.json's, else the tokenizer's) and the EOS id."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    hf_tokenizer = AutoTokenizer.from_pretrained(path)
    hf_s = time.perf_counter() - t0
    config = path / "config.json"
    vocab = json.loads(config.read_text())["vocab_size"] if config.exists() else len(hf_tokenizer)
    return hf_tokenizer, hf_s, vocab, hf_tokenizer.eos_token_id


def measure_engine(name: str, args: argparse.Namespace, run: Any, hf_tokenizer: Any, vocab: int, eos: int,
                   sizes: tuple[int, int, int]) -> tuple[dict[str, Any], Engine | None]:
    """One engine's figures (setup, compile, walks, batches, coverage) and the engine; an engine that does not
    import is skipped with a message (its figures: the error, no engine)."""
    reps, min_tokens, rounds = sizes
    try:
        importlib.import_module(ENGINES[name].module)
    except ImportError as exc:
        msg = f"not importable here ({type(exc).__name__}: {exc})"
        print(f"skipping {name}: {msg}", file=sys.stderr)
        return {"error": msg}, None
    log(f"{name}: setting up")
    res: dict[str, Any] = {"version": importlib.metadata.version(ENGINES[name].module)}
    run(f"{name} setup", lambda n=name: ENGINES[n](args.tokenizer, hf_tokenizer, vocab, eos, args.threads),
        res, "engine")
    eng = res.pop("engine")
    res["setup_s"] = eng.setup_s
    run(f"{name} compiles", lambda e=eng: measure_compile(e, reps), res, "compile")
    run(f"{name} walks", lambda e=eng: measure_walks(e, hf_tokenizer, min_tokens), res, "walk")
    run(f"{name} batches", lambda e=eng: measure_batch(e, hf_tokenizer, rounds), res, "batch")
    res["coverage"] = measure_coverage(eng, hf_tokenizer)
    return res, eng


def main() -> int:
    args = parse_args()
    started = dt.datetime.now()
    torch.set_num_threads(args.threads)
    reps, min_tokens, rounds, apply_reps = (2, 300, 1, 50) if args.quick else (5, 2000, 3, 300)
    hf_tokenizer, hf_s, vocab, eos = load_tokenizer(args.tokenizer)

    lock = take_lock(900)  # other benchmarks that take it never overlap this run
    notes: list[str] = []
    env = {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": args.threads, "python": platform.python_version(),
           "torch": torch.__version__, "transformers": importlib.metadata.version("transformers"),
           "kvbaton_commit": kvbaton_commit(), "tokenizer": str(args.tokenizer), "vocab_size": vocab, "eos": eos,
           "hf_tokenizer_s": hf_s}
    run = partial(measured, notes=notes, wait_s=args.wait_idle)
    results: dict[str, Any] = {}
    engines: list[Engine] = []
    for name in args.engines.split(","):
        results[name], eng = measure_engine(name, args, run, hf_tokenizer, vocab, eos, (reps, min_tokens, rounds))
        if eng is not None:
            engines.append(eng)
    doc: dict[str, Any] = {"started": started.isoformat(timespec="seconds"),
                           "command": command_line("bench_grammar_engines.py", sys.argv[1:]), "environment": env,
                           "engines": results, "notes": notes}
    run("bitmask apply", lambda: measure_apply(engines, vocab, apply_reps), doc, "apply")
    md = markdown(doc)
    print(md)
    if args.json:
        write_json(args.json, doc)
        log(f"wrote {args.json}")
    if args.md:
        args.md.write_text(md)
        log(f"wrote {args.md}")
    lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
