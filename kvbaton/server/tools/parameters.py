"""A function's `parameters`: a JSON Schema (Draft 2020-12) for its arguments object, checked before
it reaches the prompt or a grammar engine.

Bounded in size and nesting: the schema is validated, serialised into the prompt and, for a forced
tool choice, compiled into a grammar, and every one of those costs grows with it. (OpenAI's own
structured-output limits are tighter: 5 levels of nesting, 100 properties.)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

# NOTE: jsonschema ships no type information (types-jsonschema is a separate package)
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
from jsonschema.exceptions import SchemaError  # type: ignore[import-untyped]
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from kvbaton.server.tools.scan import nesting_depth

MAX_PARAMETERS_BYTES = 32 * 1024  # one schema, as compact JSON
MAX_PARAMETERS_DEPTH = 32  # nested objects and arrays (each schema level is one or two)
MAX_PARAMETERS_SUBSCHEMAS = 1024  # JSON objects in one schema: the meta-schema check's cost grows with them

# NOTE: OpenAI: "omitting parameters defines a function with an empty parameter list": arguments `{}`.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # their values are data, not schemas


def schema_bytes(schema: dict[str, Any]) -> int:
    """Its size as compact JSON; ValueError if it is not JSON text (NaN, lone surrogates)."""
    try:
        return len(json.dumps(schema, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode())
    except ValueError:
        raise ValueError("holds NaN or Infinity, which are not JSON") from None
    except UnicodeEncodeError:
        raise ValueError("holds a string that is not valid Unicode (a lone surrogate such as \\ud800)") from None


def check_parameters(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema`, if it is within bounds and describes an object; else ValueError saying why.

    Only the cheap checks, run while the request is parsed on the event loop: the meta-schema check costs
    ~0.3 ms per sub-schema, so it runs later, in a thread (`validate_parameters`)."""
    if nesting_depth(schema, MAX_PARAMETERS_DEPTH) > MAX_PARAMETERS_DEPTH:
        raise ValueError(f"nested more than {MAX_PARAMETERS_DEPTH} levels deep")
    if count_objects(schema, MAX_PARAMETERS_SUBSCHEMAS) > MAX_PARAMETERS_SUBSCHEMAS:
        raise ValueError(f"more than {MAX_PARAMETERS_SUBSCHEMAS} sub-schemas (JSON objects)")
    if (size := schema_bytes(schema)) > MAX_PARAMETERS_BYTES:
        raise ValueError(f"{size} bytes as JSON, more than {MAX_PARAMETERS_BYTES}")
    return schema


def validate_parameters(schema: dict[str, Any]) -> None:
    """ValueError unless `schema` (already through `check_parameters`) is a Draft 2020-12 JSON Schema whose
    references resolve within it. Remembered by content: agents send the same tools with every turn."""
    _validate_text(json.dumps(schema, ensure_ascii=False, sort_keys=True, separators=(",", ":")))


@functools.lru_cache(maxsize=256)  # at most 8 MiB of schema text (only valid schemas are remembered)
def _validate_text(text: str) -> None:
    schema = json.loads(text)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        raise ValueError(f"not a valid JSON Schema (Draft 2020-12): {e.json_path}: {e.message}") from None
    kind = schema.get("type", "object")
    if kind != "object":
        raise ValueError(f"must describe an object (the arguments), not type {json.dumps(kind)}")
    _check_refs(schema)


def count_objects(value: Any, limit: int) -> int:
    """JSON objects in `value`, counted up to one past `limit` (then it stops looking)."""
    count, stack = 0, [value]
    while stack and count <= limit:
        node = stack.pop()
        if isinstance(node, dict):
            count += 1
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count


def _schema_strings(schema: Any, key: str) -> Iterator[str]:
    """The string values of `key` in schema positions (not inside `const`, `enum`, ... data)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if isinstance(node.get(key), str):
                yield node[key]
            stack.extend(v for k, v in node.items() if k not in _DATA_KEYWORDS)


def _check_refs(schema: dict[str, Any]) -> None:
    """Every `$ref` resolves within the schema: a grammar engine fetches nothing, and an unresolvable
    reference would fail only later, when the grammar is built.

    NOTE: a schema with an `$id` anywhere changes the base its references resolve against; those are
    left to the grammar engine rather than resolved here by half."""
    if any(True for _ in _schema_strings(schema, "$id")):
        return
    resolver = Registry().resolver_with_root(DRAFT202012.create_resource(schema))
    for ref in _schema_strings(schema, "$ref"):
        if not ref.startswith("#"):
            raise ValueError(f"$ref {ref!r}: only references within the schema ('#...') are supported")
        try:
            resolver.lookup(ref)
        except Unresolvable:
            raise ValueError(f"$ref {ref!r} does not resolve within the schema") from None
