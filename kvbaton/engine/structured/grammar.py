"""Compile structured-output specs into llguidance matchers, off the step loop, cached by spec.

Why llguidance (see benchmarks/results/grammar-engines.md): a 7.6 MB wheel with no dependency
(xgrammar's Linux wheel pulls triton), JSON schema, regex, choice and Lark/GBNF grammars from one
engine, and masks computed lazily per token in Rust with the GIL released, so a new schema costs
milliseconds rather than an up-front automaton build. vLLM ships it as its `guidance` backend.

One compiler per process (the HTTP frontend validates with it; each worker compiles with it).
Building the tokenizer's token trie takes ~1 s, so it happens in the compiler's own thread, as
does every compilation: the step loop only ever copies a compiled matcher (`deep_copy`, cheap).
Torch-free.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance

from kvbaton.sched.grammar_spec import MAX_CHOICES, StructuredOutput
from kvbaton.sched.sampling_params import InvalidRequestError

MAX_CACHED_GRAMMARS = 256
# NOTE: bounds the work one request's grammar may cost a step (lexer fuel) and its size; llguidance's
# defaults, stated so that a frontend and its workers agree on what is refused.
PARSER_LIMITS = llguidance.LLParserLimits()


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar for `spec`; raises InvalidRequestError naming what is wrong."""
    try:
        if spec.kind == "json":
            schema = json.loads(spec.text)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object (or true / false)")
            return llguidance.LLMatcher.grammar_from_json_schema(
                spec.text, defaults={"whitespace_flexible": False})
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        if spec.kind == "choice":
            options = json.loads(spec.text)
            if not (isinstance(options, list) and 0 < len(options) <= MAX_CHOICES
                    and all(isinstance(o, str) and o for o in options)):
                raise ValueError(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
        return llguidance.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid {spec.kind}: {str(exc)[:500]}", "structured_outputs") from None


@dataclass(frozen=True)
class Refusal:
    """Why a spec does not compile: what the cache keeps of a bad spec (a message, not an exception)."""

    message: str

    def error(self) -> InvalidRequestError:
        return InvalidRequestError(self.message, "structured_outputs")


class GrammarCompiler:
    """`tokenizer`: builds the llguidance tokenizer (called once, in the compiler's thread).

    NOTE: the cache holds each spec's outcome (a matcher or a `Refusal`), never an exception. A cached exception
    raised again to each caller (`Future.result()`, `asyncio.wrap_future`) grows its traceback by that caller's
    frames every time, and those frames hold the request, the engine and the event loop's state: a client
    repeating one bad schema grew the process without bound, and an engine that refused a grammar was never
    freed (measured: 600 MB kept per in-process engine). Each caller gets its own future and a fresh error."""

    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer]) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbaton-grammar")
        self._tokenizer: Future[llguidance.LLTokenizer] = self._pool.submit(tokenizer)
        self._compiled: OrderedDict[str, Future[llguidance.LLMatcher | Refusal]] = OrderedDict()
        self._lock = threading.Lock()  # the frontend validates from several threads

    @classmethod
    def for_tokenizer(cls, tokenizer_json: Callable[[], str], vocab_size: int,
                      eos_token_ids: tuple[int, ...]) -> GrammarCompiler:
        """A compiler for the tokenizer serialised as `tokenizer_json()` (HF tokenizer.json text), with
        the model's vocabulary size (its embedding may be larger than the tokenizer) and EOS ids (the only
        tokens a finished grammar allows)."""
        return cls(lambda: llguidance.LLTokenizer(tokenizer_json(), n_vocab=vocab_size,
                                                  eos_token=list(eos_token_ids) or None))

    def compile(self, spec: StructuredOutput) -> Future[llguidance.LLMatcher]:
        """The compiled matcher for `spec` (its initial state), compiling it in the background once. The future
        is the caller's own: it fails with a fresh InvalidRequestError if `spec` does not compile."""
        with self._lock:
            built = self._compiled.get(spec.key)
            if built is not None:
                self._compiled.move_to_end(spec.key)
            else:
                built = self._compiled[spec.key] = self._pool.submit(self._build, spec)
                while len(self._compiled) > MAX_CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        mine: Future[llguidance.LLMatcher] = Future()
        waiting = [mine]  # emptied once settled: `built` keeps its callbacks, which must not keep `mine`
        built.add_done_callback(lambda done: _settle(waiting.pop(), done))
        return mine

    def validate(self, spec: StructuredOutput) -> None:
        """Raise InvalidRequestError if `spec` does not compile (blocks until it is compiled)."""
        self.compile(spec).result()

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one request (blocks only if the spec is still compiling)."""
        return self.compile(spec).result().deep_copy()

    def _build(self, spec: StructuredOutput) -> llguidance.LLMatcher | Refusal:
        try:
            grammar = grammar_text(spec)
        except InvalidRequestError as exc:
            return Refusal(str(exc))
        try:
            tokenizer = self._tokenizer.result()
        except Exception as exc:  # e.g. a tokenizer llguidance cannot read: every grammar is refused, clearly
            return Refusal(f"structured outputs are not available with this model's tokenizer: "
                           f"{type(exc).__name__}: {str(exc)[:300]}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
        if matcher.is_error():  # NOTE: kept in the cache: the same bad spec again is refused at no cost
            return Refusal(f"invalid {spec.kind}: {matcher.get_error()[:500]}")
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _settle(mine: Future[llguidance.LLMatcher], built: Future[llguidance.LLMatcher | Refusal]) -> None:
    """Give a caller's future the outcome of the shared compilation: a fresh exception for each caller."""
    if built.cancelled():
        mine.cancel()
        return
    error = built.exception()
    if error is not None:  # a bug, not a bad spec: report it without handing out the shared exception object
        mine.set_exception(RuntimeError(f"grammar compilation failed: {type(error).__name__}: {str(error)[:300]}"))
        return
    outcome = built.result()
    if isinstance(outcome, Refusal):
        mine.set_exception(outcome.error())
    else:
        mine.set_result(outcome)
