"""bench_moe_ep.py's summaries: per-step medians of each set-up, the ratios between set-ups, greedy agreement,
and EPLB before and after."""

from __future__ import annotations

import statistics
from typing import Any

from moe_ep_bench.models import DECODE_BATCH

# step record columns
TOK, SEQ, WALL, A2A, RED, CODEC, EXP, BYTES, ROWS, W_ROWS, W_IDS, W_COUNTS, SLOTS = range(13)


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def step_summary(ranks: list[dict], kind: str, per_rank_seqs: int, names: tuple[str, ...] = ()) -> dict | None:
    """Medians over the measured steps of `kind` (decode: steps of exactly `per_rank_seqs` sequences, one token
    each; prefill: the prompt's step); times averaged over the ranks (lockstep: one group step), bytes and rows
    summed over them."""
    per_rank = []
    for r in ranks:
        rows = [s for ph in r["phases"] if ph["kind"] == kind and ph["name"] != "warm"
                and (not names or ph["name"].startswith(names)) for s in ph["steps"]
                if (kind == "prefill" or (s[SEQ] == per_rank_seqs and s[TOK] == per_rank_seqs))]
        if not rows:
            return None
        per_rank.append({c: med([s[i] for s in rows]) for c, i in
                         (("wall", WALL), ("a2a", A2A), ("allreduce", RED), ("codec", CODEC), ("experts", EXP),
                          ("bytes", BYTES), ("rows", ROWS), ("wire_rows", W_ROWS), ("wire_ids", W_IDS),
                          ("wire_counts", W_COUNTS), ("slots_hit", SLOTS))}
                        | {"a2a_share": med([s[A2A] / s[WALL] for s in rows]), "steps": len(rows),
                           "rows_total": sum(s[ROWS] for s in rows)})
    mean = lambda key: statistics.fmean(p[key] for p in per_rank)  # noqa: E731
    total = lambda key: sum(p[key] for p in per_rank)  # noqa: E731
    rows_total = [p["rows_total"] for p in per_rank]
    return {"step_ms": 1e3 * mean("wall"), "a2a_ms": 1e3 * mean("a2a"), "a2a_share": mean("a2a_share"),
            "allreduce_ms": 1e3 * mean("allreduce"), "codec_ms": 1e3 * mean("codec"),
            "experts_ms": 1e3 * mean("experts"), "bytes_per_step": total("bytes"), "rows_per_step": total("rows"),
            "wire_bytes_per_step": total("wire_rows") + total("wire_ids") + total("wire_counts"),
            "wire_row_bytes_per_step": total("wire_rows"), "steps_per_rank": per_rank[0]["steps"],
            "balancedness": statistics.fmean(rows_total) / max(rows_total) if max(rows_total) else None,
            "per_rank": per_rank}


def outputs_of(ranks: list[dict], name: str) -> list[list[int]]:
    """A phase's greedy outputs in prompt order (rank r held the r-th share)."""
    return [o for r in ranks for ph in r["phases"] if ph["name"] == name for o in ph["outputs"]]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y))
    total = sum(len(x) for x in ref)
    prefix = 0
    for x, y in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
        prefix += n
    first = sum(bool(x) and bool(y) and x[0] == y[0] for x, y in zip(ref, got))
    return {"tokens": total, "equal": same, "agreement": same / total if total else None,
            "identical_prefix": prefix / total if total else None, "first_token_equal": first, "sequences": len(ref)}


def pooled_agreement(a: list[list[dict]], b: list[list[dict]], names: list[str]) -> dict:
    """Agreement of set-up b with set-up a over the decode phases of every round (same prompts per round)."""
    ref, got = [], []
    for ra, rb in zip(a, b):
        for name in names:
            ref += outputs_of(ra, name)
            got += outputs_of(rb, name)
    return agreement(ref, got)


def summarize(doc: dict, groups: dict[str, list[list[dict]]], per_rank_batch: dict[str, int]) -> dict:
    """Every set-up's decode and prefill medians (rounds pooled, and per round), the ratios between set-ups, greedy
    agreement, the int8 layer error and EPLB's before and after."""
    s: dict[str, Any] = {}
    for key, rounds in groups.items():
        if key in ("eplb", "ep1_skewed") or not rounds:
            continue
        ranks = [r for rnd in rounds for r in rnd]  # every round's ranks: rank records pooled
        pooled = _pool(rounds)
        s[f"{key}_decode"] = step_summary(pooled, "decode", per_rank_batch[key])
        s[f"{key}_prefill"] = step_summary(pooled, "prefill", per_rank_batch[key])
        s[f"{key}_decode_rounds"] = [step_summary(rnd, "decode", per_rank_batch[key]) for rnd in rounds]
        s[f"{key}_init_s"] = [r["init_s"] for r in ranks]
    s["ratios"] = ratios(s)
    names = [f"decode-{i}" for i in range(doc["repeats"])]
    s["quality"] = {
        "int8_vs_ep2": pooled_agreement(groups.get("ep2", []), groups.get("ep2_int8", []), names),
        "ep2_vs_ep1": pooled_agreement(groups.get("ep1", []), groups.get("ep2", []), names),
        "int8_vs_ep1": pooled_agreement(groups.get("ep1", []), groups.get("ep2_int8", []), names),
    }
    errs = doc["layer_error"]
    s["layer_error"], s["layer_error_all"] = errs[len(errs) // 2], errs
    eplb = (groups.get("eplb") or [None])[0]
    if eplb:
        s["eplb"] = eplb_summary(eplb, (groups.get("ep1_skewed") or [None])[0], doc["repeats"])
    return s


def ratios(s: dict) -> dict:
    """The set-ups against each other: EP1 / EP2, int8 / exact (bytes and time), wire / counted bytes, and what
    EP2 adds over EP1 at one rank's share."""
    g = lambda k, f: (s.get(k) or {}).get(f)  # noqa: E731
    out = {
        "ep1_over_ep2_decode": _r(g("ep1_decode", "step_ms"), g("ep2_decode", "step_ms")),
        "ep1_over_ep2_prefill": _r(g("ep1_prefill", "step_ms"), g("ep2_prefill", "step_ms")),
        "ep1_over_ep2_decode_rounds": [_r(a["step_ms"], b["step_ms"]) for a, b in
                                       zip(s.get("ep1_decode_rounds", []), s.get("ep2_decode_rounds", []))
                                       if a and b],
        "int8_over_exact_bytes_decode": _r(g("ep2_int8_decode", "bytes_per_step"), g("ep2_decode", "bytes_per_step")),
        "int8_over_exact_bytes_prefill": _r(g("ep2_int8_prefill", "bytes_per_step"),
                                            g("ep2_prefill", "bytes_per_step")),
        "int8_over_exact_time_decode": _r(g("ep2_int8_decode", "step_ms"), g("ep2_decode", "step_ms")),
        "int8_over_exact_time_prefill": _r(g("ep2_int8_prefill", "step_ms"), g("ep2_prefill", "step_ms")),
        "wire_over_counter_exact_decode": _r(g("ep2_decode", "wire_bytes_per_step"), g("ep2_decode", "bytes_per_step")),
        "wire_over_counter_int8_decode": _r(g("ep2_int8_decode", "wire_bytes_per_step"),
                                            g("ep2_int8_decode", "bytes_per_step")),
    }
    for kind in ("decode", "prefill"):
        a, b = g(f"ep2_{kind}", "step_ms"), g(f"ep1_half_{kind}", "step_ms")
        out[f"ep2_minus_half_{kind}_ms"] = a - b if a is not None and b is not None else None
    return out


def eplb_summary(eplb: list[dict], ref: list[dict] | None, repeats: int) -> dict:
    """The skewed model on EP2 before and after `rebalance_now()`: steps, balancedness and their ratios, the new
    placement, and greedy agreement with EP1 (`ref`) on the same prompts."""
    before = step_summary(eplb, "decode", DECODE_BATCH // 2, ("before",))
    after = step_summary(eplb, "decode", DECODE_BATCH // 2, ("after",))
    before_pre = step_summary(eplb, "prefill", 1, ("before",))
    after_pre = step_summary(eplb, "prefill", 1, ("after",))
    agree = {}
    for phase in ("before", "after"):
        names = [f"{phase}-{i}" for i in range(repeats)]
        agree[phase] = (pooled_agreement([ref], [eplb], names)["agreement"] if ref else None)
    rebalance = [ph.get("rebalance_s") for r in eplb for ph in r["phases"] if "rebalance_s" in ph]
    return {"before": before, "after": after, "before_prefill": before_pre, "after_prefill": after_pre,
            "rebalance_s": max(rebalance) if rebalance else None,
            "balancedness_ratio": _r(g2(after, "balancedness"), g2(before, "balancedness")),
            "time_ratio": _r(g2(after, "step_ms"), g2(before, "step_ms")),
            "prefill_balancedness_ratio": _r(g2(after_pre, "balancedness"), g2(before_pre, "balancedness")),
            "prefill_time_ratio": _r(g2(after_pre, "step_ms"), g2(before_pre, "step_ms")),
            "layer0_slots_rank0": eplb[0].get("layer0_slots_end"), "rebalances": eplb[0].get("rebalances"),
            "agree_before": agree["before"], "agree_after": agree["after"],
            "kernel_layers": " / ".join(f"{r['moe_kernel_layers']}->{r['moe_kernel_layers_end']}" for r in eplb)}


def g2(d: dict | None, key: str) -> float | None:
    return None if d is None else d.get(key)


def _r(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _pool(rounds: list[list[dict]]) -> list[dict]:
    """Rank r's phases of every round, as one rank record (so medians pool the rounds)."""
    size = len(rounds[0])
    return [{"phases": [ph for rnd in rounds for ph in rnd[r]["phases"]]} for r in range(size)]
