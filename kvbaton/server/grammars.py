"""The frontend's grammar check: a request whose grammar does not compile is answered 400 before any
worker sees it. Compiled with the same engine and tokenizer the workers use, in its own thread, so the
event loop never waits on it; the result is cached by spec, so a schema sent again costs nothing."""

from __future__ import annotations

import asyncio

from kvbaton.engine.structured.grammar import GrammarCompiler
from kvbaton.sched.grammar_spec import StructuredOutput
from kvbaton.sched.sampling_params import InvalidRequestError
from kvbaton.text.tokenizer import Tokenizer


class GrammarCheck:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        # NOTE: built at start-up, in the compiler's thread (~1 s): the first structured request does not wait.
        self.compiler = GrammarCompiler.for_tokenizer(tokenizer.backend.to_str, vocab_size, eos_token_ids)

    async def check(self, spec: StructuredOutput, param: str) -> None:
        """Raise InvalidRequestError naming `param` (the field the request used) if `spec` does not compile."""
        try:
            await asyncio.wrap_future(self.compiler.compile(spec))
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), param) from None

    def close(self) -> None:
        self.compiler.close()
