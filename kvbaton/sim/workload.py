"""The simulator's input: the very requests `kvbaton bench serve` would send, or a recorded run.

Synthetic loads come from the bench's own dataset generators and arrival process with the same
seed, so a simulated run and a measured run of one seed see the same lengths at the same times.
The prompts are word prompts (one word = one token); each word becomes a token id by a fixed hash,
so prompts that share a prefix (the `shared-prefix` dataset) share their first blocks' hashes and
hit the simulated prefix cache as they hit the real one.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import numpy as np

from kvbaton.config import ConfigError
from kvbaton.sim.spec import SimRequest
from kvbaton.workload.arrivals import ArrivalConfig, arrival_offsets
from kvbaton.workload.datasets import DatasetConfig, WordPrompts, build_requests

VOCAB = 49152  # token ids are drawn below this (the default model's vocabulary size; any size works)


def word_token(word: str) -> int:
    return zlib.crc32(word.encode()) % VOCAB


def synthetic_requests(dataset: DatasetConfig, arrivals: ArrivalConfig, seed: int) -> list[SimRequest]:
    """What `kvbaton bench serve --seed SEED` sends at `arrivals`' rate, with its send offsets."""
    bench = build_requests(dataset, WordPrompts(), seed)
    offsets = arrival_offsets(len(bench), arrivals, np.random.default_rng([seed, 1]))
    return [SimRequest(r.request_id, float(t), tuple(word_token(w) for w in r.completion_text().split()),
                       r.output_len) for r, t in zip(bench, offsets)]


def trace_requests(path: str | Path, run_index: int = 0, seed: int = 0) -> tuple[list[SimRequest], float]:
    """The requests of a `kvbaton bench serve --result-json` file (one rate of it): send times, measured prompt
    and output lengths. Its prompts' content is not recorded, so each gets distinct random token ids (no
    prefix sharing). Returns the requests and the run's request rate."""
    try:
        doc = json.loads(Path(path).read_text())
        run = doc["runs"][run_index]
        records = run["records"]
        rate = float(run["request_rate"])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ConfigError(f"{path}: not a `kvbaton bench serve --result-json` file with run {run_index}: {exc}") \
            from exc
    rng = np.random.default_rng([seed, 2])
    requests = []
    for rec in records:
        if rec.get("status") == "cancelled":
            continue
        output_len = rec["output_tokens"] if rec.get("status") == "ok" and rec.get("output_tokens") else \
            rec["output_len"]
        prompt = tuple(int(t) for t in rng.integers(0, VOCAB, int(rec["prompt_len"])))
        requests.append(SimRequest(int(rec["request_id"]), float(rec["send_s"]), prompt, int(output_len)))
    return requests, rate if math.isfinite(rate) else math.inf


def trace_ttfts(path: str | Path, run_index: int = 0) -> dict[int, float]:
    """The measured TTFT in seconds of every request of a `kvbaton bench serve --result-json` run that got a first
    token, by request id: what calibration compares its replay with."""
    try:
        records = json.loads(Path(path).read_text())["runs"][run_index]["records"]
        return {int(r["request_id"]): float(r["ttft_s"]) for r in records
                if r.get("status") == "ok" and r.get("ttft_s") is not None}
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ConfigError(f"{path}: no measured requests in run {run_index}: {exc}") from exc


def trace_medians(path: str | Path, run_index: int = 0) -> tuple[float, float]:
    """(TTFT p50, TPOT p50) in ms that a `kvbaton bench serve --result-json` run measured: what calibration fits."""
    try:
        summary = json.loads(Path(path).read_text())["runs"][run_index]["summary"]
        return float(summary["ttft_ms"]["p50"]), float(summary["tpot_ms"]["p50"])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ConfigError(f"{path}: no measured TTFT and TPOT medians in run {run_index}: {exc}") from exc
