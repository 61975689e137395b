"""Interleaved rounds (`bench_engine.py --rounds N`): every engine runs once per round, in the same order, and
the memory bandwidth is measured at each round's start. This host's speed drifts by tens of percent over
minutes, so one engine's run can land in a slow stretch its peers escaped; taking each engine's best figure over
the rounds, and the roofline from the highest bandwidth seen, compares every engine at its best moment against
the most demanding roofline."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

# (path into one engine's record, which value is best)
_METRICS: tuple[tuple[tuple[str, ...], Callable[[list[float]], float]], ...] = (
    (("latency", "decode_ms_per_tok"), min),
    (("latency", "prefill_tok_s"), max),
    (("throughput", "output_tok_s"), max),
    (("bench", "pp_tok_s"), max),  # llama-bench
    (("bench", "tg_tok_s_at_depth"), max),
    (("server", "latency", "decode_ms_per_tok"), min),  # llama-server
    (("server", "latency", "prefill_tok_s"), max),
)


def _get(record: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(record, dict) or key not in record:
            return None
        record = record[key]
    return record if isinstance(record, int | float) else None


def _set(record: dict, path: tuple[str, ...], value: float) -> None:
    for key in path[:-1]:
        record = record[key]
    record[path[-1]] = value


def best_record(records: Sequence[dict | None]) -> dict | None:
    """One engine's record with each metric at its best over the rounds that measured it; `rounds`: how many did."""
    measured = [r for r in records if r and "skipped" not in r and ("latency" in r or "bench" in r)]
    if not measured:
        return next((r for r in records if r), None)
    best = copy.deepcopy(measured[0])
    best["rounds"] = len(measured)
    for path, pick in _METRICS:
        values = [v for v in (_get(r, path) for r in measured) if v is not None]
        if values and _get(best, path) is not None:
            _set(best, path, pick(values))
    return best


def best_of_rounds(rounds: Sequence[dict], roofline: dict) -> dict:
    """Per-dtype results of several rounds -> one, each engine at its best, with the given `roofline`."""
    engines = [key for key in rounds[0] if key != "roofline"]
    merged: dict = {"roofline": roofline}
    for key in engines:
        merged[key] = best_record([r.get(key) for r in rounds])
    return merged


def best_bandwidth(measures: Sequence[dict]) -> dict:
    """The round's bandwidth measurement with the highest read bandwidth (the most demanding roofline)."""
    return max(measures, key=lambda bw: bw.get("read_gb_s") or 0.0)


def reads_around(rounds: Sequence[dict]) -> list[float]:
    """The read bandwidths measured just before and after each of kvbaton's decode runs, in GB/s."""
    return [gb for r in rounds for dres in r["dtypes"].values()
            for run in (((dres.get("kvbaton") or {}).get("latency") or {}).get("runs") or ())
            for gb in run.get("read_gb_s_around") or ()]


def highest_read(rounds: Sequence[dict]) -> float:
    """The highest read bandwidth seen in the run: at the rounds' starts and around each of kvbaton's decode runs.
    NOTE: a host whose bandwidth changes state within minutes (ENVIRONMENT.md: 45-50 against 75-85 GB/s on the Zen
    4 kind) can measure the slow state at every round's start and run kvbaton in the fast one; a roofline from
    the round starts alone then reads above 100%."""
    seen = [r["bandwidth"].get("read_gb_s") or 0.0 for r in rounds] + reads_around(rounds)
    return max(seen, default=0.0) or float("nan")
