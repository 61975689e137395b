"""llguidance and xgrammar behind one interface (compile, matcher, fill, consume, their batch forms, and the
bitmask kernels), and two plain-torch ways to apply a bitmask."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


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
