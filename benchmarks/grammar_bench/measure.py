"""bench_grammar_engines.py's measurements: each part run on a quiet machine (repeated when other processes
disturbed it), compile times, documents walked token by token, requests in lock-step, the bitmask applied to
logits, and coverage probes."""

from __future__ import annotations

import os
import random
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common.contention import wait_idle
from common.log import log
from grammar_bench.engines import Engine, XGrammar, lut_apply, plain_apply
from grammar_bench.grammars import FORMAT_FEATURES, GRAMMARS, SCHEMA_FEATURES, WALKS, dumps

BATCH = 16


class OtherLoad:
    """`with OtherLoad() as w:` ... then `w.cores`: CPU cores that processes other than this one used
    meanwhile, machine-wide (/proc/stat less this process's own CPU time): on a shared 2-core machine
    other engineers' processes may not even be visible in this PID namespace."""

    @staticmethod
    def _busy_s() -> float:
        vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
        return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> OtherLoad:
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy_s(), sum(os.times()[:2])
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self.t0
        others = (self._busy_s() - self.busy0) - (sum(os.times()[:2]) - self.own0)
        self.cores = max(0.0, others / elapsed)


def measured(what: str, fn: Callable[[], Any], out: dict[str, Any], key: str, *, notes: list[str],
             wait_s: float, tries: int = 3) -> None:
    """out[key] = fn(), after waiting for the machine to go idle; a run that other processes disturbed
    (over 0.1 cores on average) is repeated, up to `tries` runs, and the quietest kept. The other load
    it saw is recorded in out["other_load_cores"][key], and noted when over 0.1 cores."""
    best: tuple[float, Any] | None = None
    for attempt in range(tries):
        wait_idle(wait_s, what, notes)
        with OtherLoad() as load:
            value = fn()
        if best is None or load.cores < best[0]:
            best = (load.cores, value)
        if load.cores <= 0.1:
            break
        log(f"other processes used {load.cores:.2f} cores during {what} (run {attempt + 1} of {tries})")
    assert best is not None
    out[key] = best[1]
    out.setdefault("other_load_cores", {})[key] = round(best[0], 3)
    if best[0] > 0.1:
        msg = f"other processes used {best[0]:.2f} cores on average during {what} (the quietest of {tries} runs)"
        log("WARNING: " + msg)
        notes.append(msg)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def stats_us(ns: list[int]) -> dict[str, float]:
    us = [v / 1e3 for v in ns]
    return {"n": len(us), "mean_us": statistics.fmean(us), "p50_us": pct(us, 0.5), "p99_us": pct(us, 0.99),
            "max_us": max(us)}


def allowed(mask_row: Any, token: int) -> bool:
    return bool((int(mask_row[token >> 5]) >> (token & 31)) & 1)


def ms(seconds: float) -> float:
    return seconds * 1e3


def measure_compile(eng: Engine, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mask = torch.full((1, (eng.vocab_size + 31) // 32), -1, dtype=torch.int32)
    for name, (kind, grammar) in GRAMMARS.items():
        first, again, new, first_mask = [], [], [], []
        compiled = None
        for _ in range(reps):
            eng.clear_cache()
            t0 = time.perf_counter()
            compiled = eng.compile(kind, grammar)
            first.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            m = eng.matcher(compiled)
            eng.fill(m, mask)
            first_mask.append(time.perf_counter() - t0)  # a fresh compile's first matcher and mask
        for _ in range(reps * 3):
            t0 = time.perf_counter()
            compiled = eng.compile_again(kind, grammar)
            again.append(time.perf_counter() - t0)
        for _ in range(50):
            t0 = time.perf_counter()
            eng.matcher(compiled)
            new.append(time.perf_counter() - t0)
        out[name] = {"first_compile_ms": ms(statistics.median(first)), "first_compile_runs_ms": [ms(x) for x in first],
                     "again_ms": ms(statistics.median(again)), "new_matcher_us": statistics.median(new) * 1e6,
                     "first_mask_ms": ms(statistics.median(first_mask)),
                     "first_mask_runs_ms": [ms(x) for x in first_mask], "memory_bytes": eng.memory_bytes(compiled)}
        log(f"{eng.name}: compile {name}: {out[name]['first_compile_ms']:.2f} ms first, "
            f"{out[name]['again_ms']:.3f} ms again, first mask {out[name]['first_mask_ms']:.2f} ms")
    return out


def tokens_of(hf_tokenizer: Any, text: str) -> list[int]:
    return hf_tokenizer.encode(text, add_special_tokens=False)


def walk(eng: Engine, compiled: Any, tokens: list[int], mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """One request: fill, check the next token is allowed, consume; EOS last. (fill ns, consume ns) per token."""
    m = eng.matcher(compiled)
    rows = mask.numpy()
    fill, consume = [], []
    for tok in [*tokens, eng.eos]:
        t0 = time.perf_counter_ns()
        eng.fill(m, mask)
        t1 = time.perf_counter_ns()
        if not allowed(rows[0], tok):
            raise AssertionError(f"{eng.name}: token {tok} not allowed by the mask after {len(fill)} tokens")
        t2 = time.perf_counter_ns()
        ok = eng.consume(m, tok)
        t3 = time.perf_counter_ns()
        if not ok:
            raise AssertionError(f"{eng.name}: token {tok} refused after {len(fill)} tokens")
        fill.append(t1 - t0)
        consume.append(t3 - t2)
    return fill, consume


def measure_walks(eng: Engine, hf_tokenizer: Any, min_tokens: int) -> dict[str, Any]:
    out = {}
    mask = torch.full((1, (eng.vocab_size + 31) // 32), -1, dtype=torch.int32)
    for name, (schema, make) in WALKS.items():
        compiled = eng.compile("json", schema)
        rng = random.Random(f"walk-{name}")
        docs = []
        while sum(len(d) + 1 for d in docs) < min_tokens or len(docs) < 4:
            docs.append(tokens_of(hf_tokenizer, dumps(make(rng))))
        first_fill, first_consume = walk(eng, compiled, docs[0], mask)
        fill, consume = [], []
        for doc in docs[1:]:
            f, c = walk(eng, compiled, doc, mask)
            fill += f
            consume += c
        out[name] = {"docs": len(docs), "tokens_per_doc": statistics.fmean(len(d) + 1 for d in docs),
                     "first_walk_fill": stats_us(first_fill), "first_walk_consume": stats_us(first_consume),
                     "fill": stats_us(fill), "consume": stats_us(consume)}
        log(f"{eng.name}: walk {name}: fill {out[name]['fill']['mean_us']:.1f} µs/token mean, "
            f"consume {out[name]['consume']['mean_us']:.1f}")
    return out


def measure_batch(eng: Engine, hf_tokenizer: Any, rounds: int) -> dict[str, Any]:
    """16 requests of one schema in lock-step, each on its own document; a warm-up round first."""
    out = {}
    width = (eng.vocab_size + 31) // 32
    for name, (schema, make) in WALKS.items():
        compiled = eng.compile("json", schema)
        rng = random.Random(f"batch-{name}")
        batch_ns, seq_ns, consume_ns, steps = [], [], [], 0
        for r in range(rounds + 1):
            docs = [tokens_of(hf_tokenizer, dumps(make(rng))) for _ in range(BATCH)]
            n = min(len(d) for d in docs)
            matchers = [eng.matcher(compiled) for _ in range(BATCH)]
            mask = torch.full((BATCH, width), -1, dtype=torch.int32)
            rows = mask.numpy()
            seq = torch.full((BATCH, width), -1, dtype=torch.int32)
            for step in range(n):
                toks = [d[step] for d in docs]
                t0 = time.perf_counter_ns()
                eng.batch_fill(matchers, mask)
                t1 = time.perf_counter_ns()
                for i, m in enumerate(matchers):
                    eng.fill(m, seq, i)
                t2 = time.perf_counter_ns()
                ok = eng.batch_consume(matchers, toks)
                t3 = time.perf_counter_ns()
                if not all(ok) or not all(allowed(rows[i], t) for i, t in enumerate(toks)):
                    raise AssertionError(f"{eng.name}: batch step {step} refused a valid token")
                if not torch.equal(mask, seq):
                    raise AssertionError(f"{eng.name}: batched and one-by-one masks differ at step {step}")
                if r:
                    batch_ns.append(t1 - t0)
                    seq_ns.append(t2 - t1)
                    consume_ns.append(t3 - t2)
            steps += n if r else 0
        out[name] = {"batch": BATCH, "steps": steps, "batch_fill": stats_us(batch_ns),
                     "one_by_one_fill": stats_us(seq_ns), "batch_consume": stats_us(consume_ns)}
        log(f"{eng.name}: batch {name}: batched fill {out[name]['batch_fill']['mean_us']:.0f} µs/step, "
            f"one by one {out[name]['one_by_one_fill']['mean_us']:.0f}")
    return out


_FIRST_CALL_S: dict[tuple[str, int], float] = {}  # the process's first call (a retried run's is warm)


def measure_apply(engines: list[Engine], vocab: int, reps: int) -> dict[str, Any]:
    methods: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
        "plain torch (>> arange(32), masked_fill_)": plain_apply,
        "plain torch (byte table, index_select + add_)": lut_apply}
    for eng in engines:
        methods.update(eng.apply_mask())
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    for rows in (1, BATCH):
        base = torch.randn(rows, vocab, generator=gen)
        mask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
        want = base.clone()
        plain_apply(want, mask)
        for name, fn in methods.items():
            logits = base.clone()
            t0 = time.perf_counter()
            fn(logits, mask)
            first = _FIRST_CALL_S.setdefault((name, rows), time.perf_counter() - t0)
            if not torch.equal(logits, want):
                raise AssertionError(f"{name} masks differently from the plain torch version")
            for _ in range(5):
                logits.copy_(base)
                fn(logits, mask)
            times = []
            for _ in range(reps):
                logits.copy_(base)
                t0 = time.perf_counter_ns()
                fn(logits, mask)
                times.append(time.perf_counter_ns() - t0)
            out.setdefault(name, {})[str(rows)] = {"first_call_ms": ms(first), **stats_us(times)}
            log(f"apply {name} [{rows}, {vocab}]: {out[name][str(rows)]['p50_us']:.1f} µs p50")
    return out


def accepts(eng: Engine, compiled: Any, tokens: list[int]) -> bool:
    m = eng.matcher(compiled)
    return all(eng.consume(m, t) for t in [*tokens, eng.eos])


def probe(eng: Engine, hf_tokenizer: Any, kind: str, grammar: Any, valid: str, invalid: str) -> str:
    try:
        compiled = eng.compile(kind, grammar)
    except Exception as exc:  # any refusal is the answer
        text = re.sub(r"^\[[0-9:]+\] \S+: ", "", " ".join(str(exc).split()))  # xgrammar's log prefix
        return "refused: " + text[:110]
    ok_valid = accepts(eng, compiled, tokens_of(hf_tokenizer, valid))
    ok_invalid = accepts(eng, compiled, tokens_of(hf_tokenizer, invalid))
    if ok_valid and not ok_invalid:
        return "enforced"
    if ok_valid:
        return "ignored (accepts the invalid instance)"
    return "too strict (refuses the valid instance)" + ("" if not ok_invalid else ", accepts the invalid one")


def measure_coverage(eng: Engine, hf_tokenizer: Any) -> dict[str, dict[str, str]]:
    def schemas() -> dict[str, str]:
        return {feat: probe(eng, hf_tokenizer, "json", schema, dumps(valid), dumps(invalid))
                for feat, schema, valid, invalid in SCHEMA_FEATURES}

    out = {"json_schema": schemas(),
           "formats": {feat: probe(eng, hf_tokenizer, kind, grammar, valid, invalid)
                       for feat, kind, grammar, valid, invalid in FORMAT_FEATURES}}
    if isinstance(eng, XGrammar):
        eng.strict_mode = False
        out["json_schema_strict_mode_false"] = schemas()
        eng.strict_mode = True
    return out
