"""What a request asks its output to match: one kind of grammar and its text. Torch-free; it rides in
`SamplingParams` to every worker, and its `key` names the compiled grammar in each process's cache."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

StructuredKind = Literal["json", "regex", "choice", "grammar"]
STRUCTURED_KINDS: tuple[StructuredKind, ...] = ("json", "regex", "choice", "grammar")
# NOTE: a grammar is compiled in the frontend (to refuse a bad one with a 400) and again in each worker it
# reaches; its size bounds both. OpenAI caps a schema far lower; a generous bound still stops a 64 MiB body.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutput:
    """`kind`: `json` (`text` is a JSON schema; `{"type": "object"}` is OpenAI's JSON mode), `regex`,
    `choice` (`text` is a JSON list of strings) or `grammar` (Lark, or llama.cpp's GBNF)."""

    kind: StructuredKind
    text: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or not 0 < len(self.text) <= MAX_GRAMMAR_CHARS:
            raise ValueError(f"a {self.kind} must be a non-empty string of at most {MAX_GRAMMAR_CHARS} characters")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> StructuredOutput:
        # NOTE: the schema's own key order: the output's properties come in the order they are declared, as
        # OpenAI and vLLM generate them (a "reasoning" field declared before "answer" is written first).
        return cls("json", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(options), separators=(",", ":")))

    @property
    def key(self) -> str:
        """Names the compiled grammar: equal for equal specs in every process (not `hash()`, which is salted)."""
        return hashlib.blake2b(f"{self.kind}\0{self.text}".encode(), digest_size=16).hexdigest()
