#!/usr/bin/env python
"""Structured outputs under batch load: does the JSON-schema half cost the plain half?

Each engine (`kvbaton serve`, and vLLM CPU with `--peers vllm`) serves the default model
(SmolLM2-135M-Instruct, bf16, 2 threads, --max-model-len 2048) and gets, over streaming
/v1/chat/completions, all at once (temperature 1, top_p 1, a seed per request, max_tokens 128):

  A  32 plain requests (ignore_eos: each exactly max_tokens tokens)
  B  16 plain (as in A) + 16 with `response_format` {"type": "json_schema"} over 4 schemas
     (objects with bounded strings, integers, enums, arrays, nested objects); the schemas are new
     to the server in every run (one property renamed), so each run compiles 4 and reuses each 3x
  C  16 plain + 16 plain cut (ignore_eos, max_tokens) to the lengths B's structured requests had:
     B's token work without grammars. A grammar ends its output when the JSON closes, so B has
     fewer tokens than A and its batch shrinks midway; B/C isolates the grammar's own cost.

Reported per run: output tok/s = all output tokens / (first send -> last token), TPOT p50 and
the largest inter-token gap of the plain half, and how many structured outputs parse and
validate (jsonschema), in the schema's key order; the runs go A B C, A B C, ... (--repeats) and
the best of each (by output tok/s) is compared: B/A and B/C (target >= 0.9), and the plain
half's TPOT in B over A and C (it must not slow down).

Compile time: one request at a time, max_tokens 2: TTFT of a plain request, of a request with a
schema the server has never seen, and of the same schema again (its compiled grammar cached),
per schema, over --compile-rounds fresh variants; plus, for kvbaton, llguidance's compile time
in this process (kvbaton's GrammarCompiler) and the first mask (llguidance builds lazily). And a
stall check: 4 plain streams decoding while the first structured request after start arrives
(then another new schema): the plain streams' largest gap against their median.

Prompts are random words from a seed (fresh unless --seed, printed), distinct per request and
run, so no prefix cache helps; vLLM is the peers/ script's server (`vllm-cpu.sh serve`, its
default structured-outputs backend `auto`, which its log does not resolve: the backend is given by
vLLM's own rule, run in its venv on these schemas, next to the grammar libraries its processes map).

    .venv/bin/python benchmarks/bench_structured.py --quick            # kvbaton smoke run (~1.5 min)
    .venv/bin/python benchmarks/bench_structured.py                    # kvbaton (~4 min on 2 cores)
    .venv/bin/python benchmarks/bench_structured.py --peers vllm       # and vLLM CPU (+ ~3 min start)

Results: benchmarks/results/structured-<stamp>.json and structured.md (`--quick`:
structured-quick-*); server logs in --raw-dir (default: the temporary directory).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime as dt
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import httpx
import jsonschema

from common.contention import LoadMonitor, OverlapWatch, note_load, take_lock, wait_foreign, wait_idle
from common.log import log
from common.machine import MODEL_NAME, environment
from common.peers import add_peer_args, resolve_peers
from common.procs import descendants, thread_env
from common.prompts import fresh_seed
from common.records import to_json
from common.report import RESULTS_DIR, ResultFiles, command_line, fmt, notes_section, ratio, stamp
from common.servers import Server, ServerSpec, free_port, kvbaton_server
from kvbaton.bench.client import Target, make_client
from kvbaton.bench.metrics import percentile
from kvbaton.bench.sse import SSEDecoder, parse_event

ENGINES = ("kvbaton", "vllm")
LABEL = {"kvbaton": "kvbaton serve", "vllm": "vLLM CPU"}
FOREIGN = r"benchmarks/bench_(engine|serve|pd|structured)\.py"
TARGET_RATIO = 0.9

# ---- the schemas: realistic sizes, every string and array bounded so a valid output fits 128 tokens ----

def _S(max_len: int) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": max_len}


def _I(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj({"name": _S(24), "age": _I(0, 120), "role": {"enum": ["admin", "editor", "viewer", "guest"]},
                    "email": _S(32), "tags": {"type": "array", "items": _S(12), "maxItems": 3}}),
    "product": _obj({"sku": _S(12), "title": _S(32), "price_cents": _I(0, 1_000_000),
                     "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]}, "in_stock": {"type": "boolean"},
                     "categories": {"type": "array", "minItems": 1, "maxItems": 3,
                                    "items": {"enum": ["books", "garden", "toys", "food", "tools", "music"]}}}),
    "event": _obj({"title": _S(32), "day": _I(1, 31),
                   "month": {"enum": ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov",
                                      "dec"]},
                   "online": {"type": "boolean"},
                   "location": _obj({"city": _S(20), "country": {"enum": ["DE", "FR", "GB", "US", "JP"]}}),
                   "attendees": {"type": "array", "maxItems": 2,
                                 "items": _obj({"name": _S(16), "rsvp": {"enum": ["yes", "no", "maybe"]}})}}),
    "order": _obj({"order_id": _S(8), "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
                   "customer": _obj({"name": _S(12), "vip": {"type": "boolean"},
                                     "tier": {"enum": ["bronze", "silver", "gold"]}}),
                   "shipping": _obj({"city": _S(16), "country": {"enum": ["DE", "FR", "GB", "US", "JP"]}}),
                   "items": {"type": "array", "minItems": 1, "maxItems": 2,
                             "items": _obj({"sku": _S(8), "qty": _I(1, 9)})},
                   "total_cents": _I(0, 1_000_000), "gift": {"type": "boolean"}}),
}


def schema_variant(name: str, nonce: str) -> dict[str, Any]:
    """SCHEMAS[name] with its first property renamed `<key>_<nonce>`: another grammar, so no cache knows it."""
    schema = copy.deepcopy(SCHEMAS[name])
    first = next(iter(schema["properties"]))
    schema["properties"] = {(f"{k}_{nonce}" if k == first else k): v for k, v in schema["properties"].items()}
    schema["required"] = list(schema["properties"])
    return schema


# ---- prompts: random words, distinct per request -------------------------------------------------------

_WORDS = tuple("""
river stone lamp orbit violet cedar harbor falcon copper meadow signal lantern basalt quartz willow ember
canyon glacier pepper saddle marble thistle nectar comet tundra prism anchor bramble cobalt dune fern
garnet hollow island jasper kettle lagoon mango nickel oasis pebble quill raven sable tulip umber velvet
walnut yarrow zephyr beacon cider delta fable grove hazel ivory juniper kiwi linen maple noble opal
""".split())
_TOPICS = ("a lighthouse keeper", "a night market", "an old map", "a rainy station", "a chess club",
           "a mountain bakery", "a lost robot", "a desert garden")
_ASK = {"person": "a person", "product": "a product in a shop", "event": "an event", "order": "a customer order"}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def plain_prompt(rng: random.Random) -> str:
    return f"{words(rng, 6)}. Write a short story about {rng.choice(_TOPICS)} using these words: {words(rng, 6)}."


def json_prompt(rng: random.Random, schema_name: str) -> str:
    return f"{words(rng, 6)}. Describe {_ASK[schema_name]} as JSON. Use these words: {words(rng, 4)}."


# ---- one streamed chat request ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Item:
    """One request of a run: `kind` plain, json (a schema) or matched (plain, cut to a json reply's length)."""

    kind: str
    prompt: str
    max_tokens: int
    seed: int
    schema_name: str | None = None
    schema: dict[str, Any] | None = None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": self.prompt}],
                                "max_tokens": self.max_tokens, "temperature": 1.0, "top_p": 1.0, "seed": self.seed,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.schema is None:
            body["ignore_eos"] = True
        else:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": self.schema_name, "schema": self.schema}}
        return body


@dataclass(frozen=True, kw_only=True)
class Reply:
    ok: bool
    send_s: float  # perf_counter at send
    chunk_s: tuple[float, ...] = ()  # perf_counter of each content chunk
    output_tokens: int = 0  # usage.completion_tokens, else content chunks
    finish_reason: str | None = None
    text: str = ""
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.send_s if self.chunk_s else None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or len(self.chunk_s) < 2 or self.output_tokens < 2:
            return None
        return (self.chunk_s[-1] - self.chunk_s[0]) / (self.output_tokens - 1)

    @property
    def max_gap_s(self) -> float | None:
        gaps = [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]
        return max(gaps) if gaps else None


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The response's lines as SSE ends them (LF, CRLF). NOTE: not httpx's `aiter_lines`, which splits like
    `str.splitlines`, also at U+2028, U+0085 and other separators a server may send raw inside a JSON string
    (vLLM does): that cut an event in two and failed the request as "malformed chunk"."""
    buffer = ""
    async for text in resp.aiter_text():
        buffer += text
        *lines, buffer = buffer.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if buffer:
        yield buffer.removesuffix("\r")


async def stream_chat(client: httpx.AsyncClient, target: Target, item: Item) -> Reply:
    """Send `item`, stream its answer; never raises except on cancellation."""
    send, chunks, text, usage, finish = time.perf_counter(), [], [], None, None
    try:
        async with client.stream("POST", target.url, json=item.body(), headers=target.headers()) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                return Reply(ok=False, send_s=send, error=f"HTTP {resp.status_code}: {body[:300]}")
            decoder = SSEDecoder()
            async for line in sse_lines(resp):
                data = decoder.feed(line)
                if data is None:
                    continue
                event = parse_event(data)
                if event.error:
                    return Reply(ok=False, send_s=send, chunk_s=tuple(chunks), error=event.error[:300])
                if event.text:
                    chunks.append(time.perf_counter())
                    text.append(event.text)
                usage, finish = event.usage or usage, event.finish_reason or finish
    except httpx.HTTPError as exc:
        return Reply(ok=False, send_s=send, chunk_s=tuple(chunks), error=f"{type(exc).__name__}: {exc}"[:300])
    n = (usage or {}).get("completion_tokens") or len(chunks)
    return Reply(ok=finish is not None, send_s=send, chunk_s=tuple(chunks), output_tokens=n, finish_reason=finish,
                 text="".join(text), error="" if finish else "stream ended without a finish_reason")


async def send_all(base_url: str, items: list[Item], cap_s: float) -> tuple[list[Reply | None], float]:
    """All `items` at once, each on its own connection; those not done after `cap_s` are cancelled (None).
    Returns the replies and the wall time from the first send to the last token."""
    target = Target(base_url=base_url, endpoint="/v1/chat/completions", model=MODEL_NAME, timeout_s=cap_s)
    async with make_client(target) as client:
        tasks = [asyncio.create_task(stream_chat(client, target, it)) for it in items]
        done, pending = await asyncio.wait(tasks, timeout=cap_s)
        for t in pending:
            t.cancel()
        replies = [t.result() if t in done else None for t in tasks]
    stamps = [r.send_s for r in replies if r] + [r.chunk_s[-1] for r in replies if r and r.chunk_s]
    return replies, (max(stamps) - min(stamps)) if stamps else 0.0


# ---- workload runs A, B, C --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Sizes:
    concurrency: int
    structured: int  # of the concurrency, in B
    max_tokens: int
    repeats: int
    compile_rounds: int
    stall_tokens: int
    run_cap_s: int


FULL = Sizes(concurrency=32, structured=16, max_tokens=128, repeats=3, compile_rounds=3, stall_tokens=256,
             run_cap_s=600)
QUICK = Sizes(concurrency=8, structured=4, max_tokens=128, repeats=1, compile_rounds=1, stall_tokens=256,
              run_cap_s=300)


def plan_run(kind: str, seed: int, s: Sizes, matched: list[int] | None = None) -> list[Item]:
    """Run `kind` (A, B or C) from `seed`; C's second half is cut to `matched` (B's structured lengths)."""
    rng = random.Random(seed)
    nonce = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5))
    n_plain = s.concurrency if kind == "A" else s.concurrency - s.structured
    items = [Item(kind="plain", prompt=plain_prompt(rng), max_tokens=s.max_tokens, seed=seed + i)
             for i in range(n_plain)]
    names = list(SCHEMAS)
    for j in range(s.concurrency - n_plain):
        name = names[j % len(names)]
        if kind == "B":
            items.append(Item(kind="json", prompt=json_prompt(rng, name), max_tokens=s.max_tokens,
                              seed=seed + n_plain + j, schema_name=name, schema=schema_variant(name, nonce)))
        else:
            items.append(Item(kind="matched", prompt=json_prompt(rng, name), max_tokens=max(1, matched[j]),
                              seed=seed + n_plain + j))
    order = list(range(len(items)))
    rng.shuffle(order)  # plain and structured requests interleaved in arrival order
    return [items[i] for i in order]


def check_json(item: Item, reply: Reply) -> str | None:
    """Why a structured reply is not a valid instance of its schema, or None."""
    if reply.finish_reason == "length":
        return "truncated at max_tokens"
    try:
        doc = json.loads(reply.text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    try:
        jsonschema.validate(doc, item.schema)
    except jsonschema.ValidationError as exc:
        return f"schema: {exc.message[:200]}"
    return None


def padding(text: str) -> int:
    """Whitespace characters outside JSON strings (a grammar that allows any whitespace lets a model spend its
    tokens there; kvbaton's is compact)."""
    count, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            in_string, escaped = (escaped or ch != '"'), (not escaped and ch == "\\")
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            count += 1
    return count


def in_schema_order(item: Item, text: str) -> bool:
    """The top-level keys came in the order the schema lists its properties (OpenAI's and vLLM's order)."""
    return list(json.loads(text)) == list(item.schema["properties"])


def _p50(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return percentile(vals, 50) if vals else None


def summarize_run(kind: str, items: list[Item], replies: list[Reply | None], wall_s: float) -> dict[str, Any]:
    pairs = list(zip(items, replies))
    ok = [(it, r) for it, r in pairs if r is not None and r.ok]
    plain = [r for it, r in ok if it.kind == "plain"]
    structured = [(it, r) for it, r in ok if it.kind == "json"]
    failures = [(it.schema_name, why) for it, r in structured if (why := check_json(it, r))]
    tokens = sum(r.output_tokens for _, r in ok)
    ms = lambda x: None if x is None else 1e3 * x
    res: dict[str, Any] = {
        "kind": kind, "requests": len(items), "completed": len(ok), "wall_s": wall_s, "output_tokens": tokens,
        "output_tok_s": tokens / wall_s if wall_s else None,
        "plain": {"n": len(plain), "tokens": sum(r.output_tokens for r in plain),
                  "tpot_p50_ms": ms(_p50([r.tpot_s for r in plain])),
                  "ttft_p50_ms": ms(_p50([r.ttft_s for r in plain])),
                  "max_gap_ms": ms(max((r.max_gap_s or 0 for r in plain), default=None))},
        "errors": [r.error if r else "cancelled at the run cap" for _, r in pairs if r is None or not r.ok][:5],
        "records": [request_record(it, r) for it, r in pairs],
    }
    if kind == "B":
        valid = [(it, r) for it, r in structured if check_json(it, r) is None]
        res["structured"] = {
            "n": sum(it.kind == "json" for it in items),
            "completed": len(structured), "valid": len(valid), "failures": failures,
            "in_schema_order": sum(in_schema_order(it, r.text) for it, r in valid),
            "padded": sum(padding(r.text) > 0 for _, r in structured),
            "tokens": [r.output_tokens for _, r in structured],
            "ttft_p50_ms": ms(_p50([r.ttft_s for _, r in structured])),
            "tpot_p50_ms": ms(_p50([r.tpot_s for _, r in structured])),
            "examples": [r.text for _, r in structured[:2]]}
    return res


def request_record(item: Item, reply: Reply | None) -> dict[str, Any]:
    """One request's figures for the JSON (the text only for structured ones, to be checked by eye)."""
    rec: dict[str, Any] = {"kind": item.kind, "schema": item.schema_name, "max_tokens": item.max_tokens,
                           "seed": item.seed}
    if reply is None:
        return rec | {"error": "cancelled at the run cap"}
    ms = lambda x: None if x is None else round(1e3 * x, 1)
    rec |= {"ttft_ms": ms(reply.ttft_s), "tpot_ms": ms(reply.tpot_s), "max_gap_ms": ms(reply.max_gap_s),
            "output_tokens": reply.output_tokens, "chunks": len(reply.chunk_s), "finish_reason": reply.finish_reason}
    if reply.error:
        rec["error"] = reply.error
    if item.schema is not None and reply.ok:
        rec |= {"text": reply.text, "invalid": check_json(item, reply)}
    return rec


def matched_lengths(items: list[Item], replies: list[Reply | None], s: Sizes) -> list[int]:
    """B's structured output lengths, in its schema order (a failed one counts max_tokens)."""
    out = [r.output_tokens if r is not None and r.ok else s.max_tokens
           for it, r in zip(items, replies) if it.kind == "json"]
    by_name: dict[str, list[int]] = {}
    for it, n in zip([it for it in items if it.kind == "json"], out):
        by_name.setdefault(it.schema_name, []).append(n)
    names = list(SCHEMAS)
    return [by_name[names[j % len(names)]].pop(0) for j in range(s.structured)]


# ---- compile time and the stall check ------------------------------------------------------------------------


async def one_ttft(base_url: str, item: Item) -> Reply:
    return (await send_all(base_url, [item], 120))[0][0] or Reply(ok=False, send_s=0, error="timed out")


def ttft_ms(reply: Reply) -> float | None:
    return None if reply.ttft_s is None else 1e3 * reply.ttft_s


def compile_probe(base_url: str, seed: int, rounds: int) -> dict[str, Any]:
    """Per schema: TTFT of plain, never-seen schema (cold) and the same again (cached), one at a time."""
    rng = random.Random(seed)
    rows: dict[str, dict[str, list]] = {n: {"plain": [], "cold": [], "cached": [], "errors": []} for n in SCHEMAS}
    for r in range(rounds):
        for name in SCHEMAS:
            schema = schema_variant(name, f"c{seed % 10_000}r{r}")
            for label, sch in (("plain", None), ("cold", schema), ("cached", schema), ("cached", schema)):
                item = Item(kind="json" if sch else "plain", prompt=json_prompt(rng, name), max_tokens=2,
                            seed=rng.randrange(2**31), schema_name=name, schema=sch)
                reply = asyncio.run(one_ttft(base_url, item))
                rows[name][label].append(ttft_ms(reply))
                if not reply.ok:
                    rows[name]["errors"].append(reply.error)
    for row in rows.values():
        for label in ("plain", "cold", "cached"):
            row[f"{label}_p50_ms"] = _p50(row[label])
        row["compile_ms"] = (row["cold_p50_ms"] - row["cached_p50_ms"]
                             if row["cold_p50_ms"] is not None and row["cached_p50_ms"] is not None else None)
    return rows


async def _stall(base_url: str, seed: int, s: Sizes, schema_name: str, nonce: str) -> dict[str, Any]:
    rng = random.Random(seed)
    plain = [Item(kind="plain", prompt=plain_prompt(rng), max_tokens=s.stall_tokens, seed=seed + i) for i in range(4)]
    job = asyncio.create_task(send_all(base_url, plain, 300))
    await asyncio.sleep(1.0)  # the plain streams are decoding
    item = Item(kind="json", prompt=json_prompt(rng, schema_name), max_tokens=8, seed=seed + 9,
                schema_name=schema_name, schema=schema_variant(schema_name, nonce))
    reply = await one_ttft(base_url, item)
    replies, _ = await job
    # the plain streams' gaps, and those ending while the structured request waited for its first token
    window = (reply.send_s, (reply.chunk_s[0] if reply.chunk_s else reply.send_s) + 0.5)
    gaps = [(b - a, b) for r in replies if r for a, b in zip(r.chunk_s, r.chunk_s[1:])]
    during = [g for g, b in gaps if window[0] <= b <= window[1]]
    return {"schema": schema_name, "json_ttft_ms": ttft_ms(reply), "json_error": reply.error or None,
            "plain_gap_p50_ms": 1e3 * statistics.median(g for g, _ in gaps) if gaps else None,
            "plain_gap_max_ms": 1e3 * max(during) if during else None,
            "plain_done_before": all(r and r.chunk_s and r.chunk_s[-1] < window[0] for r in replies)}


def stall_probe(base_url: str, seed: int, s: Sizes) -> dict[str, Any]:
    """The first structured request after start (a grammar library's one-time set-up), then a later new schema,
    each while 4 plain requests decode: does either stall them?"""
    return {"first": asyncio.run(_stall(base_url, seed, s, "person", f"f{seed % 10_000}")),
            "later": asyncio.run(_stall(base_url, seed + 50, s, "order", f"l{seed % 10_000}"))}


def inproc_compile(model_dir: str) -> dict[str, Any]:
    """llguidance through kvbaton's GrammarCompiler in this process: the tokenizer, each schema's compile,
    and a fresh matcher's first mask (the first one of the process pays llguidance's lazy set-up)."""
    import llguidance.torch as llt

    from kvbaton.engine.structured.grammar import GrammarCompiler
    from kvbaton.engine.structured.spec import StructuredOutput
    from kvbaton.engine.tokenizer import Tokenizer

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    t = time.perf_counter()
    compiler = GrammarCompiler.for_tokenizer(lambda: Tokenizer(model_dir).backend.to_str(), cfg["vocab_size"],
                                             (cfg.get("eos_token_id", 2),))
    compiler.compile(StructuredOutput.json_schema({"type": "object"})).result()
    out: dict[str, Any] = {"tokenizer_s": time.perf_counter() - t, "schemas": {}}
    for name in SCHEMAS:
        t = time.perf_counter()
        matcher = compiler.compile(StructuredOutput.json_schema(schema_variant(name, "inproc"))).result()
        compile_s = time.perf_counter() - t
        t = time.perf_counter()
        llt.fill_next_token_bitmask(matcher.deep_copy(), llt.allocate_token_bitmask(1, cfg["vocab_size"]), 0)
        out["schemas"][name] = {"compile_ms": 1e3 * compile_s, "first_mask_ms": 1e3 * (time.perf_counter() - t)}
    compiler.close()
    return out


# ---- one engine ------------------------------------------------------------------------------------------


def server_spec(args: argparse.Namespace, engine: str, port: int) -> ServerSpec:
    if engine == "kvbaton":
        serve_args = ["--model", args.model_dir, "--max-model-len", "2048", "--threads", str(args.threads),
                      "--served-model-name", MODEL_NAME]
        return kvbaton_server(name="kvbaton", port=port, serve_args=serve_args, env=thread_env(args.threads),
                              log_path=args.raw_dir / f"kvbaton-serve-{port}.log", timeout_s=args.server_start_s)
    return args.peer_paths.vllm_server(model_dir=args.model_dir, port=port, dtype="bfloat16", threads=args.threads,
                                       timeout_s=args.server_start_s)


def grammar_libraries(pid: int | None) -> dict[str, list[str]]:
    """Which grammar libraries each of the server's processes has loaded (its /proc maps): vLLM's `auto`
    backend loads xgrammar or llguidance only when a request needs it."""
    found = {}
    for p in [pid, *descendants(pid)] if pid else []:
        try:
            maps = Path(f"/proc/{p}/maps").read_text()
            comm = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        libs = sorted({lib for lib in ("xgrammar", "llguidance", "outlines_core") if f"/{lib}/" in maps})
        found[f"{p} {comm}"] = libs
    return found


_VLLM_AUTO = """
import json, sys
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar
out = {}
for name, schema in json.load(sys.stdin).items():
    try:
        validate_xgrammar_grammar(SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
        out[name] = "xgrammar"
    except Exception as exc:
        out[name] = f"not xgrammar, so guidance or outlines ({type(exc).__name__}: {exc})"[:300]
print(json.dumps(out))
"""


def vllm_auto_backend(args: argparse.Namespace) -> dict[str, str]:
    """The backend vLLM's `auto` picks for each schema, by its own rule (xgrammar unless xgrammar refuses the
    schema; sampling_params.py): its log names none, and its processes load both libraries."""
    schemas = json.dumps({n: schema_variant(n, "probe") for n in SCHEMAS})
    proc = subprocess.run([str(args.peer_paths.vllm_python), "-c", _VLLM_AUTO], input=schemas, capture_output=True,
                          text=True, env=thread_env(args.threads) | {"VLLM_TARGET_DEVICE": "cpu"}, timeout=300)
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": proc.stderr[-500:]}


def log_facts(engine: str, log_path: Path) -> dict[str, str]:
    """What the server's log says about its compute path (kvbaton) or structured-outputs config (vLLM)."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    pattern = r"compute path ([^;\n]+)" if engine == "kvbaton" else r"structured_outputs_config=(\w+\([^)]*\))"
    m = re.search(pattern, text)
    facts = {"log": str(log_path), ("compute_path" if engine == "kvbaton" else "structured_outputs_config"):
             m.group(1) if m else "?"}
    warnings = [ln[-300:] for ln in text.splitlines() if re.search(r"xgrammar|guidance|grammar", ln, re.I)
                and re.search(r"warn|error", ln, re.I)]
    if warnings:
        facts["grammar_log_lines"] = "\n".join(warnings[:5])
    return facts


class Turns:
    """Before each measurement: no other benchmark, the CPUs idle (up to --wait-idle), and enough of this
    engine's --budget-min left for a run as long as the last one."""

    def __init__(self, args: argparse.Namespace, engine: str) -> None:
        self.args, self.engine, self.t0, self.waited, self.last_s = args, engine, time.perf_counter(), 0.0, 0.0

    def wait(self, what: str) -> float:
        t = time.perf_counter()
        wait_foreign(FOREIGN, self.args.wait_foreign, what)
        busy = wait_idle(self.args.wait_idle, f"{self.engine} {what}", self.args.notes)
        self.waited += time.perf_counter() - t
        return busy

    def over_budget(self) -> bool:
        used = time.perf_counter() - self.t0 - self.waited
        return used + 1.2 * self.last_s > self.args.budget_min * 60


def measure_run(args: argparse.Namespace, base_url: str, turns: Turns, kind: str, seed: int,
                matched: list[int] | None) -> tuple[dict[str, Any], list[Item], list[Reply | None]]:
    items = plan_run(kind, seed, args.sizes, matched)
    busy = turns.wait(f"run {kind}")
    with OverlapWatch(FOREIGN) as watch, args.monitor.window() as window:
        replies, wall = asyncio.run(send_all(base_url, items, args.sizes.run_cap_s))
    res = summarize_run(kind, items, replies, wall) | {"seed": seed, "busy_before": round(busy, 3),
                                                       "overlap": watch.seen}
    note_load(res, f"{turns.engine} run {kind} (seed {seed})", window, args.notes)
    turns.last_s = wall
    log(f"{turns.engine} {kind}: {res['completed']}/{res['requests']} ok, {res['output_tokens']} tokens in "
        f"{wall:.1f}s = {fmt(res['output_tok_s'])} tok/s, plain TPOT p50 {fmt(res['plain']['tpot_p50_ms'])} ms"
        + (f", structured valid {res['structured']['valid']}/{res['structured']['n']}" if kind == "B" else ""))
    return res, items, replies


def workload_runs(args: argparse.Namespace, base_url: str, turns: Turns, seed: int) -> list[dict[str, Any]]:
    """A B C, --repeats times; C is cut to the lengths of the B just before it."""
    runs: list[dict[str, Any]] = []
    for rep in range(args.sizes.repeats):
        b_run: tuple[list[Item], list[Reply | None]] | None = None
        for kind in "ABC":
            if turns.over_budget():
                args.notes.append(f"{turns.engine}: repeat {rep + 1} from run {kind} on skipped: --budget-min "
                                  f"{args.budget_min:g} would run out")
                return runs
            matched = matched_lengths(*b_run, args.sizes) if kind == "C" and b_run else None
            run_seed = seed + 10_000 * (rep + 1) + 1000 * "ABC".index(kind)
            run, items, replies = measure_run(args, base_url, turns, kind, run_seed, matched)
            runs.append(run | {"repeat": rep + 1})
            if kind == "B":
                b_run = (items, replies)
    return runs


def run_engine(args: argparse.Namespace, engine: str) -> dict[str, Any]:
    if engine == "vllm" and (missing := args.peer_paths.missing("vllm")):
        return {"skipped": missing}
    turns = Turns(args, engine)
    turns.wait("the server start")
    spec = server_spec(args, engine, free_port())
    res: dict[str, Any] = {}
    with Server(spec) as server:
        res["startup_s"] = server.startup_s
        args.monitor.roots.add(server.pid)  # a peer's server is no child of ours: its CPU is not "other load"
        base, seed = server.base_url, args.seed + (0 if engine == "kvbaton" else 500_000)
        warm = [Item(kind="plain", prompt=plain_prompt(random.Random(seed + k)), max_tokens=16, seed=k)
                for k in range(8)]
        asyncio.run(send_all(base, warm, 300))  # unmeasured: a batch through every path once
        res["grammar_libraries_before"] = grammar_libraries(server.pid)
        turns.wait("the stall check")
        res["stall"] = stall_probe(base, seed + 1000, args.sizes)
        log(f"{engine} stall check: {json.dumps(res['stall'])}")
        turns.wait("the compile probe")
        res["compile"] = compile_probe(base, seed + 2000, args.sizes.compile_rounds)
        log(f"{engine} compile (cold - cached TTFT, ms): "
            + ", ".join(f"{n} {fmt(r['compile_ms'])}" for n, r in res["compile"].items()))
        res["runs"] = workload_runs(args, base, turns, seed)
        res["grammar_libraries"] = grammar_libraries(server.pid)
    res |= log_facts(engine, spec.log_path)
    if engine == "vllm":
        res["auto_backend"] = vllm_auto_backend(args)
    return res


# ---- the report ------------------------------------------------------------------------------------------


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
    env, s, eng = results["environment"], results["sizes"], results["engines"]
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
    lines += ["", f"Workload: {s['concurrency']} streaming chat requests at once, temperature 1, top_p 1, a seed each, "
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
    lines += ["", f"Ratios (best runs; target: out tok/s ≥ {TARGET_RATIO}, plain TPOT ≤ 1/{TARGET_RATIO}):", "",
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
    inproc = results.get("inproc_compile")
    lines += ["", f"Compile time: one request at a time, max_tokens 2, TTFT p50 over {s['compile_rounds']} fresh "
              "variant(s) per schema; compile ≈ cold − cached. llguidance in-process: kvbaton's GrammarCompiler "
              "in this process, compile / first mask of a fresh matcher"
              + (f" (its tokenizer: {inproc['tokenizer_s']:.1f} s)" if inproc and "tokenizer_s" in inproc else ""),
              "", "| engine | schema | plain TTFT ms | cold TTFT ms | cached TTFT ms | cold − cached ms | "
              "llguidance in-process compile / first mask ms |", "|---|---|---:|---:|---:|---:|---|"]
    for e, er in eng.items():
        lines += compile_rows(e, er, inproc)
    lines += ["", "Stall check: 4 plain streams decoding when a structured request with a new schema arrives "
              "(first: the first structured request after start; later: another new schema after it):", "",
              "| engine | when | structured TTFT ms | plain gap p50 ms | plain gap max ms, until its first token |",
              "|---|---|---:|---:|---:|"]
    for e, er in eng.items():
        for when, st in (er.get("stall") or {}).items():
            lines.append(f"| {LABEL[e]} | {when} | {fmt(st['json_ttft_ms'])} | {fmt(st['plain_gap_p50_ms'])} | "
                         f"{fmt(st['plain_gap_max_ms'], '.0f')} |")
    return "\n".join(lines + notes_section(results["notes"])) + "\n"


# ---- main --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="", help="'vllm' to measure vLLM CPU too (default: kvbaton only)")
    ap.add_argument("--quick", action="store_true", help="smoke sizes: 8 requests, one repeat, one compile round")
    ap.add_argument("--seed", type=int, default=None, help="base seed (default: fresh, printed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=None, help="A B C rounds (default 3; quick 1)")
    ap.add_argument("--concurrency", type=int, default=None, help="requests per run (default 32)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 128")
    ap.add_argument("--compile-rounds", type=int, default=None, help="fresh variants per schema (default 3)")
    ap.add_argument("--model-dir", default=None, help="default: kvbaton's pulled default model")
    add_peer_args(ap)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--raw-dir", type=Path, default=None, help="server logs (default: the temporary directory)")
    ap.add_argument("--server-start-s", type=float, default=420.0, help="vLLM recompiles at every start: ~3 min")
    ap.add_argument("--budget-min", type=float, default=10.0,
                    help="per engine, minutes of measuring (waits not counted): later runs are skipped with a note")
    ap.add_argument("--wait-idle", type=float, default=60.0, help="before each measurement, wait up to S s for idle")
    ap.add_argument("--wait-foreign", type=float, default=3600.0, help="wait up to S s for another benchmark")
    args = ap.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    over = {"repeats": args.repeats, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "compile_rounds": args.compile_rounds}
    args.sizes = replace(sizes, **{k: v for k, v in over.items() if v is not None})
    if args.concurrency is not None:  # half of them structured
        args.sizes = replace(args.sizes, structured=args.concurrency // 2)
    args.notes = []
    return args


def _terminate(signum: int, frame: object) -> NoReturn:  # SIGTERM / SIGHUP: unwind, so every server is stopped
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)
    engines = ["kvbaton", *[p for p in args.peers.replace(" ", "").split(",") if p and p != "none"]]
    if set(engines) - set(ENGINES):
        raise SystemExit(f"unknown peers: {sorted(set(engines) - set(ENGINES))}; choose from vllm")
    args.peer_paths = resolve_peers(args, engines, leave_out="leave --peers out")
    if args.model_dir is None:
        from kvbaton.models.registry import pull_default_model

        args.model_dir = str(pull_default_model())
    args.seed = fresh_seed(10**6) if args.seed is None else args.seed
    started = dt.datetime.now()
    args.raw_dir = (args.raw_dir or Path(tempfile.gettempdir()) / f"kvbaton-bench-structured-{stamp(started)}")
    args.raw_dir.mkdir(parents=True, exist_ok=True)
    lock = take_lock(args.wait_foreign)
    print(f"bench_structured: seed {args.seed}", flush=True)
    log(f"engines {engines} · sizes {asdict(args.sizes)} · logs in {args.raw_dir}")
    t0 = time.perf_counter()
    args.monitor = LoadMonitor()
    args.monitor.start()
    peers = args.peer_paths.versions() if args.peer_paths and "vllm" in engines else {}
    results: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"), "seed": args.seed, "threads": args.threads,
        "command": command_line("bench_structured.py", argv if argv is not None else sys.argv[1:]),
        "sizes": asdict(args.sizes), "schemas": SCHEMAS, "environment": to_json(environment(peers=peers or None)),
        "engines": {}, "notes": args.notes}
    wait_idle(args.wait_idle, "the in-process compile timing", args.notes)
    results["inproc_compile"] = inproc_compile(args.model_dir)
    files = ResultFiles.of(args.out_dir, "structured-quick" if args.quick else "structured", stamp(started))
    for engine in engines:
        log(f"== {engine}")
        try:
            results["engines"][engine] = run_engine(args, engine)
        except Exception as exc:  # recorded; the next engine still runs
            results["engines"][engine] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
            args.notes.append(f"{engine}: {type(exc).__name__}: {str(exc)[:300]}")
            log(f"{engine} failed: {exc}")
        files.write_json(results)  # a checkpoint
    results["wall_s"] = time.perf_counter() - t0
    summarize(results)
    results["other_load_s"] = round(args.monitor.others_s, 1)
    md = markdown(results)
    files.write(results, md, results["wall_s"])
    lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
