"""bench_structured.py's workload: the schemas and prompts, one request and its streamed reply, the requests of
runs A, B and C, and what a structured reply is checked for."""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from typing import Any

import jsonschema

from common.machine import MODEL_NAME

ENGINES = ("kvbaton", "vllm")

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


def matched_lengths(items: list[Item], replies: list[Reply | None], s: Sizes) -> list[int]:
    """B's structured output lengths, in its schema order (a failed one counts max_tokens)."""
    out = [r.output_tokens if r is not None and r.ok else s.max_tokens
           for it, r in zip(items, replies) if it.kind == "json"]
    by_name: dict[str, list[int]] = {}
    for it, n in zip([it for it in items if it.kind == "json"], out):
        by_name.setdefault(it.schema_name, []).append(n)
    names = list(SCHEMAS)
    return [by_name[names[j % len(names)]].pop(0) for j in range(s.structured)]
