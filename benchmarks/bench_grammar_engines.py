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
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from common.contention import take_lock, wait_idle
from common.log import log
from common.machine import MODEL_NAME, cpu_name, kvbaton_commit
from common.report import command_line, notes_section, write_json

DEFAULT_TOKENIZER = Path(os.environ.get("KVBATON_CACHE", Path.home() / ".cache" / "kvbaton")) / "models" / MODEL_NAME
BATCH = 16

# ---- the grammars ---------------------------------------------------------------------------------

SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}

_ADDRESS = {
    "type": "object",
    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                   "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                   "country": {"enum": ["DE", "FR", "GB", "US", "JP"]}},
    "required": ["street", "city", "postcode", "country"],
    "additionalProperties": False,
}
LARGE_SCHEMA: dict[str, Any] = {  # an order: 3 levels of objects, 29 properties, anyOf 4 times
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "created": {"type": "string"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "total": {"type": "number"},
        "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
        "paid": {"type": "boolean"},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                           "phone": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "address": _ADDRESS},
            "required": ["name", "email", "phone", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array", "minItems": 1,
            "items": {"type": "object",
                      "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                                     "price": {"type": "number"},
                                     "discount": {"anyOf": [{"type": "number"}, {"type": "null"}]}},
                      "required": ["sku", "qty", "price", "discount"], "additionalProperties": False},
        },
        "shipping": {"anyOf": [
            {"type": "object", "properties": {"method": {"const": "pickup"}, "store": {"type": "string"}},
             "required": ["method", "store"], "additionalProperties": False},
            {"type": "object", "properties": {"method": {"const": "courier"}, "carrier": {"type": "string"},
                                              "tracking": {"type": "string"}},
             "required": ["method", "carrier", "tracking"], "additionalProperties": False},
        ]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["id", "created", "status", "priority", "total", "currency", "paid", "notes", "customer",
                 "items", "shipping", "tags"],
    "additionalProperties": False,
}

CHOICES = ["positive", "negative", "neutral", "mixed", "unknown"]

# name -> (kind, grammar): the compile table's rows
GRAMMARS: dict[str, tuple[str, Any]] = {
    "any JSON object": ("json_object", None),
    "small schema": ("json", SMALL_SCHEMA),
    "large schema": ("json", LARGE_SCHEMA),
    r"regex \d{3}-\d{4}": ("regex", r"\d{3}-\d{4}"),
    "choice of 5": ("choice", CHOICES),
}

_WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett",
          "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango"]


def small_instance(rng: random.Random) -> dict[str, Any]:
    return {"name": f"{rng.choice(_WORDS).title()} {rng.choice(_WORDS).title()}", "age": rng.randint(18, 90),
            "role": rng.choice(["admin", "user", "guest"]), "tags": rng.sample(_WORDS, rng.randint(1, 4))}


def large_instance(rng: random.Random) -> dict[str, Any]:
    items = [{"sku": f"SKU-{rng.randint(1000, 9999)}", "qty": rng.randint(1, 9), "price": round(rng.uniform(1, 200), 2),
              "discount": rng.choice([None, round(rng.uniform(0, 0.3), 2)])} for _ in range(rng.randint(2, 4))]
    shipping = (
        {"method": "pickup", "store": f"{rng.choice(_WORDS).title()} Street store"} if rng.random() < 0.5 else
        {"method": "courier", "carrier": rng.choice(["DHL", "UPS", "FedEx"]),
         "tracking": f"TRK{rng.randint(10**8, 10**9)}"}
    )
    return {
        "id": f"ORD-{rng.randint(0, 999999):06d}", "created": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        "status": rng.choice(["pending", "paid", "shipped", "delivered", "cancelled"]), "priority": rng.randint(1, 5),
        "total": round(sum(i["qty"] * i["price"] for i in items), 2), "currency": rng.choice(["EUR", "USD", "GBP"]),
        "paid": rng.random() < 0.5, "notes": rng.choice([None, f"leave at the {rng.choice(_WORDS)} door"]),
        "customer": {"name": f"{rng.choice(_WORDS).title()} {rng.choice(_WORDS).title()}",
                     "email": f"{rng.choice(_WORDS)}@example.com",
                     "phone": rng.choice([None, f"+49 30 {rng.randint(1000000, 9999999)}"]),
                     "address": {"street": f"{rng.randint(1, 200)} {rng.choice(_WORDS).title()} Road",
                                 "city": rng.choice(_WORDS).title(), "postcode": f"{rng.randint(0, 99999):05d}",
                                 "country": rng.choice(["DE", "FR", "GB", "US", "JP"])}},
        "items": items, "shipping": shipping, "tags": rng.sample(_WORDS, rng.randint(0, 3)),
    }


WALKS: dict[str, tuple[dict[str, Any], Callable[[random.Random], dict[str, Any]]]] = {
    "small schema": (SMALL_SCHEMA, small_instance),
    "large schema": (LARGE_SCHEMA, large_instance),
}


def dumps(value: Any) -> str:
    """Compact JSON: what both engines are configured to produce (no free whitespace, "," and ":")."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# JSON-schema keywords: (feature, schema, a valid instance, an invalid instance)
SCHEMA_FEATURES: list[tuple[str, Any, Any, Any]] = [
    ("pattern", {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}, "ab-12", "AB-1"),
    ("pattern, unanchored (a search, per JSON Schema)", {"type": "string", "pattern": "[0-9]"}, "a1b", "abc"),
    (r"pattern \d is ASCII (ECMA-262)", {"type": "string", "pattern": r"^\d+$"}, "123", "١٢٣"),
    ("minLength / maxLength", {"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcdef"),
    ("format: date-time", {"type": "string", "format": "date-time"}, "2026-01-02T03:04:05Z", "yesterday"),
    ("format: date", {"type": "string", "format": "date"}, "2026-01-02", "2026-13-45x"),
    ("format: email", {"type": "string", "format": "email"}, "a.b@example.com", "not an email"),
    ("format: uuid", {"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "123"),
    ("integer minimum / maximum", {"type": "integer", "minimum": 10, "maximum": 20}, 15, 25),
    ("number exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, 0.5, -1),
    ("number minimum / maximum (float)", {"type": "number", "minimum": 0.5, "maximum": 1.5}, 1.25, 2.5),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 15, 7),
    ("minItems / maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     [1, 2], [1]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    ("prefixItems (tuple)", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                             "items": False}, ["a", 1], [1, "a"]),
    ("contains", {"type": "array", "contains": {"type": "string"}}, [1, "x"], [1, 2]),
    ("enum (mixed types)", {"enum": ["a", 1, None, True]}, None, 2),
    ("const", {"const": "fixed"}, "fixed", "other"),
    ("type list [string, null]", {"type": ["string", "null"]}, None, 1),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x", True),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, 1, True),
    ("allOf (merged objects)", {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     {"a": 1, "b": "x"}, {"a": 1}),
    ("$ref / $defs", {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                                       "additionalProperties": False}},
                      "type": "array", "items": {"$ref": "#/$defs/pt"}}, [{"x": 1}], [{"y": 1}]),
    ("recursive $ref", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v", "kids"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
     {"v": 1, "kids": [{"v": 2, "kids": []}]}, {"v": 1, "kids": [{"v": "x", "kids": []}]}),
    ("required (declared order)", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                   "required": ["a", "b"]}, {"a": 1, "b": 2}, {"a": 1}),
    ("properties in another order", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                      "b": {"type": "integer"}},
                                     "required": ["a", "b"]}, {"b": 2, "a": 1}, {"b": 2}),
    ("additionalProperties default (true)", {"type": "object", "properties": {"a": {"type": "integer"}}},
     {"a": 1, "zz": 2}, {"a": "x"}),
    ("additionalProperties: schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     {"x": 1}, {"x": "a"}),
    ("patternProperties (unanchored ^n_)", {"type": "object", "patternProperties": {"^n_": {"type": "integer"}},
                           "additionalProperties": False}, {"n_a": 1}, {"m": 1}),
    ("patternProperties (anchored ^n_.*$)", {"type": "object", "patternProperties": {"^n_.*$": {"type": "integer"}},
                                             "additionalProperties": False}, {"n_a": 1}, {"m": 1}),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, {"ab": 1}, {"AB": 1}),
    ("minProperties / maxProperties", {"type": "object", "minProperties": 1, "maxProperties": 2}, {"a": 1}, {}),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1}),
    ("if / then / else", {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}}, 3, -3),
    ("not", {"not": {"type": "string"}}, 1, "a"),
]

# grammar formats: (feature, kind, grammar, a valid text, an invalid text)
FORMAT_FEATURES: list[tuple[str, str, Any, str, str]] = [
    ("any JSON object", "json_object", None, '{"a":[1,{"b":null}]}', '{"a":}'),
    ("regex", "regex", r"[a-z]+@[a-z]+\.(com|org)", "ab@cd.org", "ab@cd.net"),
    (r"regex \d is ASCII", "regex", r"\d{3}", "123", "١٢٣"),
    ("regex lookahead", "regex", r"(?=a)[a-z]+", "abc", "bcd"),
    ("choice", "choice", CHOICES, "neutral", "neutra"),
    ("Lark grammar", "lark", 'start: "x=" NUM ("+" NUM)*\nNUM: /[0-9]+/', "x=1+22", "x=+"),
    ("GBNF / EBNF grammar", "gbnf", 'root ::= "x=" num ("+" num)*\nnum ::= [0-9]+', "x=1+22", "x=+"),
    ("Lark with a JSON-schema rule", "lark", 'start: "ans: " j\nj: %json {"type": "integer"}', "ans: 12", "ans: x"),
]


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


# ---- the engines, behind one interface ----------------------------------------------------------


class Engine:
    """One grammar engine. `compile` returns an engine-specific compiled grammar, `matcher` a fresh
    matcher for one request from it."""

    name = ""
    module = ""

    def __init__(self, tokenizer_dir: Path, hf_tokenizer: Any, vocab_size: int, eos: int, threads: int) -> None:
        self.vocab_size, self.eos, self.threads = vocab_size, eos, threads

    def compile(self, kind: str, grammar: Any) -> Any: ...
    def compile_again(self, kind: str, grammar: Any) -> Any: ...
    def clear_cache(self) -> None: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any, mask: torch.Tensor, index: int = 0) -> None: ...
    def consume(self, matcher: Any, token: int) -> bool: ...
    def batch_fill(self, matchers: list[Any], mask: torch.Tensor) -> None: ...
    def batch_consume(self, matchers: list[Any], tokens: list[int]) -> list[bool]: ...
    def apply_mask(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]: ...
    def memory_bytes(self, compiled: Any) -> int | None:
        return None


class LLGuidance(Engine):
    name = module = "llguidance"

    def __init__(self, tokenizer_dir: Path, hf_tokenizer: Any, vocab_size: int, eos: int, threads: int) -> None:
        super().__init__(tokenizer_dir, hf_tokenizer, vocab_size, eos, threads)
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        text = (tokenizer_dir / "tokenizer.json").read_text()
        t0 = time.perf_counter()
        # as kvbaton does it (kvbaton/engine/structured/grammar.py): from tokenizer.json, no transformers
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=[eos])
        self.setup_s = {"LLTokenizer(tokenizer.json)": time.perf_counter() - t0}
        t0 = time.perf_counter()
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.setup_s["LLExecutor"] = time.perf_counter() - t0

    def grammar_text(self, kind: str, grammar: Any) -> str:
        m = self.llg.LLMatcher
        if kind == "json_object":  # what vLLM's guidance backend compiles for response_format json_object
            return m.grammar_from_json_schema('{"type": "object"}', defaults={"whitespace_flexible": False})
        if kind == "json":
            return m.grammar_from_json_schema(json.dumps(grammar), defaults={"whitespace_flexible": False})
        if kind == "regex":
            return m.grammar_from_regex(grammar)
        if kind == "choice":  # kvbaton's (and vLLM's) choice: a Lark alternation of JSON-quoted strings
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in grammar))
        if kind == "lark":
            return m.grammar_from_lark(grammar)
        if kind == "gbnf":
            return self.llg.grammar_from("gbnf", grammar)
        raise ValueError(kind)

    def compile(self, kind: str, grammar: Any) -> Any:
        matcher = self.llg.LLMatcher(self.tokenizer, self.grammar_text(kind, grammar), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    compile_again = compile  # no cache: every compile builds the grammar from its text

    def clear_cache(self) -> None:
        pass

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, mask: torch.Tensor, index: int = 0) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, mask, index)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def batch_fill(self, matchers: list[Any], mask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def batch_consume(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return self.llg.torch.consume_token_par(self.executor, list(zip(matchers, tokens)))

    def apply_mask(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
        return {"llguidance.torch.apply_token_bitmask_inplace (torch.compile)":
                self.llg.torch.apply_token_bitmask_inplace}


class XGrammar(Engine):
    name = module = "xgrammar"

    def __init__(self, tokenizer_dir: Path, hf_tokenizer: Any, vocab_size: int, eos: int, threads: int) -> None:
        super().__init__(tokenizer_dir, hf_tokenizer, vocab_size, eos, threads)
        import xgrammar

        self.xgr = xgrammar
        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        self.setup_s = {"TokenizerInfo.from_huggingface": time.perf_counter() - t0}
        t0 = time.perf_counter()
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.setup_s["GrammarCompiler"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.setup_s["BatchGrammarMatcher"] = time.perf_counter() - t0
        self.strict_mode = True  # xgrammar's default (and vLLM's): no properties or items the schema does not name

    def compile(self, kind: str, grammar: Any) -> Any:
        c = self.compiler
        if kind == "json_object":  # what vLLM's xgrammar backend compiles for response_format json_object
            return c.compile_builtin_json_grammar()
        if kind == "json":
            return c.compile_json_schema(json.dumps(grammar), any_whitespace=False, separators=(",", ":"),
                                         strict_mode=self.strict_mode)
        if kind == "regex":
            return c.compile_regex(grammar)
        if kind == "choice":  # vLLM's xgrammar choice: an EBNF alternation of quoted strings
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in grammar))
        if kind == "lark":
            return c.compile_lark(grammar)
        if kind == "gbnf":
            return c.compile_grammar(grammar)
        raise ValueError(kind)

    compile_again = compile  # the compiler's cache answers

    def clear_cache(self) -> None:
        self.compiler.clear_cache()

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, mask: torch.Tensor, index: int = 0) -> None:
        matcher.fill_next_token_bitmask(mask, index)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def batch_fill(self, matchers: list[Any], mask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def batch_consume(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def apply_mask(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
        return {"xgrammar.apply_token_bitmask_inplace (CPU kernel)": self.xgr.apply_token_bitmask_inplace}

    def memory_bytes(self, compiled: Any) -> int | None:
        return compiled.memory_size_bytes


ENGINES: dict[str, type[Engine]] = {"llguidance": LLGuidance, "xgrammar": XGrammar}


def plain_apply(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """The bitmask applied with plain torch ops (kvbaton's sampler does the same, out of place)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((mask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, : logits.shape[1]]
    logits.masked_fill_(bits == 0, float("-inf"))


_BYTE_BITS = torch.where(((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def lut_apply(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """The bitmask applied with plain torch ops, by byte: a [256, 8] table of 0 / -inf rows, gathered for
    each mask byte and added to the logits (bit j of byte k is token 8k + j on a little-endian CPU)."""
    rows = mask.shape[0]
    add = _BYTE_BITS.index_select(0, mask.contiguous().view(torch.uint8).flatten().long())
    logits.add_(add.view(rows, -1)[:, : logits.shape[1]])


# ---- the measurements ---------------------------------------------------------------------------


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


# ---- the report ---------------------------------------------------------------------------------


def f1(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def markdown(doc: dict[str, Any]) -> str:
    env, res = doc["environment"], doc["engines"]
    names = [n for n in res if "error" not in res[n]]
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

    lines += ["", "## Compile", "",
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

    lines += ["", "## Mask speed, one request", "",
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

    lines += ["", f"## Mask speed, {BATCH} requests in lock-step", "",
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

    lines += ["", "## Applying the bitmask to float32 logits", "",
              "µs per call after warm-up (the first call, with any compile, separately).", "",
              f"| method | [1, {env['vocab_size']}] p50 | p99 | [{BATCH}, {env['vocab_size']}] p50 | p99 | "
              "first call ms |", "|---|---:|---:|---:|---:|---:|"]
    for name, by_rows in doc["apply"].items():
        one, many = by_rows["1"], by_rows[str(BATCH)]
        lines.append(f"| {name} | {f1(one['p50_us'])} | {f1(one['p99_us'])} | {f1(many['p50_us'])} | "
                     f"{f1(many['p99_us'])} | {f1(one['first_call_ms'])} |")

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
    loads = {f"{n} {k}": v for n in names for k, v in res[n].get("other_load_cores", {}).items()}
    loads.update({f"bitmask {k}": v for k, v in doc.get("other_load_cores", {}).items()})
    lines += ["", "Other load (CPU cores used by other processes, machine-wide) during each part: "
              + ", ".join(f"{k} {v:.2f}" for k, v in loads.items())]
    lines += notes_section(doc["notes"])
    return "\n".join(lines) + "\n"


def main() -> int:
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
    started = dt.datetime.now()
    torch.set_num_threads(args.threads)
    reps, min_tokens, rounds, apply_reps = (2, 300, 1, 50) if args.quick else (5, 2000, 3, 300)

    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    hf_tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    hf_s = time.perf_counter() - t0
    config = args.tokenizer / "config.json"
    vocab = json.loads(config.read_text())["vocab_size"] if config.exists() else len(hf_tokenizer)
    eos = hf_tokenizer.eos_token_id

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
        try:
            importlib.import_module(ENGINES[name].module)
        except ImportError as exc:
            msg = f"not importable here ({type(exc).__name__}: {exc})"
            print(f"skipping {name}: {msg}", file=sys.stderr)
            results[name] = {"error": msg}
            continue
        log(f"{name}: setting up")
        res: dict[str, Any] = {"version": importlib.metadata.version(ENGINES[name].module)}
        run(f"{name} setup", lambda n=name: ENGINES[n](args.tokenizer, hf_tokenizer, vocab, eos, args.threads),
            res, "engine")
        eng = res.pop("engine")
        engines.append(eng)
        res["setup_s"] = eng.setup_s
        run(f"{name} compiles", lambda e=eng: measure_compile(e, reps), res, "compile")
        run(f"{name} walks", lambda e=eng: measure_walks(e, hf_tokenizer, min_tokens), res, "walk")
        run(f"{name} batches", lambda e=eng: measure_batch(e, hf_tokenizer, rounds), res, "batch")
        res["coverage"] = measure_coverage(eng, hf_tokenizer)
        results[name] = res
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
