"""What bench_grammar_engines.py compiles and walks: JSON schemas, a regex and a choice, seeded valid documents of
the schemas, and the coverage probes (JSON-schema keywords and grammar formats, each with a valid and an invalid
instance)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

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
