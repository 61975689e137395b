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
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NoReturn

import httpx

from common.contention import LoadMonitor, OverlapWatch, note_load, take_lock, wait_foreign, wait_idle
from common.log import log
from common.machine import MODEL_NAME, environment
from common.peers import add_peer_args, resolve_peers
from common.procs import descendants, thread_env
from common.prompts import fresh_seed
from common.records import to_json
from common.report import RESULTS_DIR, ResultFiles, command_line, fmt, stamp
from common.servers import Server, ServerSpec, free_port, kvbaton_server
from kvbaton.bench.client import Target, make_client
from kvbaton.client.sse import SSEDecoder, parse_event
from kvbaton.workload.metrics import percentile
from structured_bench.report import markdown, summarize
from structured_bench.workload import (
    ENGINES,
    FULL,
    QUICK,
    SCHEMAS,
    Item,
    Reply,
    Sizes,
    check_json,
    in_schema_order,
    json_prompt,
    matched_lengths,
    padding,
    plain_prompt,
    plan_run,
    schema_variant,
)

FOREIGN = r"benchmarks/bench_(engine|serve|pd|structured)\.py"


# ---- one streamed chat request ---------------------------------------------------------------------------


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


# ---- a run's figures -------------------------------------------------------------------------------------


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
    from kvbaton.sched.grammar_spec import StructuredOutput
    from kvbaton.text.tokenizer import Tokenizer

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
