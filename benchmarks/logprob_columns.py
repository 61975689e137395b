"""What a request's logprobs cost the frontend: vLLM's shape (a dict of `Logprob` objects with their
decoded text per position, as kvbaton kept them before issue 27) against `LogprobColumns` (flat
arrays, rendered when read), on the default model's tokenizer with fresh random entries.

    .venv/bin/python benchmarks/logprob_columns.py [--positions 2000] [--top 20]

Printed: bytes per position held (tracemalloc) for each and their ratio, the per-step copies the old
`RequestOutput` made over a request's life, and the time to render and serialize every position of
a whole response from the columns (what `RENDER_OFF_LOOP_ENTRIES` in kvbaton/server/api.py is set by).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from common.machine import cpu_kind, cpu_name, kvbaton_commit
from kvbaton.models.registry import resolve_model
from kvbaton.sched.outputs import TokenLogprobs
from kvbaton.server.responses import chat_logprobs
from kvbaton.text.logprob_columns import LogprobColumns, LogprobsView
from kvbaton.text.request_output import Logprob
from kvbaton.text.tokenizer import Tokenizer


def vllm_shape(entry: TokenLogprobs, text: Callable[[int], str]) -> dict[int, Logprob]:
    ranked = {entry.token_id: Logprob(entry.logprob, entry.rank, text(entry.token_id))}
    for rank, (token_id, logprob) in enumerate(entry.top, start=1):
        ranked.setdefault(token_id, Logprob(logprob, rank, text(token_id)))
    return ranked


def held_bytes(build: Callable[[], Any]) -> tuple[int, Any]:
    gc.collect()
    tracemalloc.start()
    kept = build()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return held, kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--positions", type=int, default=2000)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--seed", type=int, default=None, help="entries' seed (default: fresh)")
    args = p.parse_args()
    tokenizer = Tokenizer(resolve_model("default"))
    rng = random.Random(args.seed)
    vocab = tokenizer.vocab_size
    entries = [TokenLogprobs(rng.randrange(vocab), -rng.random(), rng.randrange(1, 5),
                             [(rng.randrange(vocab), -rng.random()) for _ in range(args.top)])
               for _ in range(args.positions)]
    for entry in entries:  # the token texts are cached in both cases: count what a position itself holds
        vllm_shape(entry, tokenizer.token_text)
    old_bytes, _ = held_bytes(lambda: [vllm_shape(e, tokenizer.token_text) for e in entries])

    def columns() -> LogprobColumns:
        made = LogprobColumns()
        for entry in entries:
            made.append(entry)
        return made

    new_bytes, made = held_bytes(columns)
    n = args.positions
    start = time.perf_counter()
    body = json.dumps(chat_logprobs(LogprobsView(made, n, tokenizer.token_text), args.top))
    render_s = time.perf_counter() - start
    print(f"CPU: {cpu_name()} ({cpu_kind()}); kvbaton {kvbaton_commit()}")
    print(f"{n} positions x top {args.top}: vLLM's shape {old_bytes / n:.0f} B/position, columns "
          f"{new_bytes / n:.0f} B/position: {old_bytes / new_bytes:.1f}x less held")
    print(f"per-step copies of the old list over the request: {n * (n + 1) // 2:,} entries (now none)")
    print(f"render + serialize all from the columns: {render_s * 1e3:.0f} ms, "
          f"{render_s * 1e6 / (n * (1 + args.top)):.1f} us per entry, body {len(body) / n:.0f} B/position")


if __name__ == "__main__":
    main()
