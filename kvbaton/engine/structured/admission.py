"""The engine's side of structured outputs before the step loop: a request whose grammar is still
compiling waits here, not in the scheduler, so no step ever waits for a compilation. The compiler
(and the runner's matchers) are built with the first such request: an engine that never sees one
never loads the tokenizer twice or starts the compiler's thread."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future

from kvbaton.engine.structured.grammar import GrammarCompiler
from kvbaton.sched.grammar_spec import StructuredOutput
from kvbaton.sched.outputs import RequestFailure
from kvbaton.sched.request import Request

# With only requests whose grammar is compiling, a step waits this long for one instead of spinning.
GRAMMAR_WAIT_S = 0.005


class GrammarAdmission:
    """`make_compiler`: builds the compiler (called once, with the first grammar)."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler]) -> None:
        self._make_compiler = make_compiler
        self.compiler: GrammarCompiler | None = None
        self._compiling: dict[str, tuple[Request, Future]] = {}

    def start(self) -> GrammarCompiler:
        """Build the compiler now (its tokenizer then loads in the compiler's thread): a server's workers do
        this at start, so the first structured request does not pay ~1 s of loading beside running ones."""
        if self.compiler is None:
            self.compiler = self._make_compiler()
        return self.compiler

    def compile(self, spec: StructuredOutput) -> Future:
        """Start compiling `spec` in the background (cached by spec)."""
        return self.start().compile(spec)

    def hold(self, req: Request, spec: StructuredOutput) -> bool:
        """True if `req` must wait for its grammar (it is held here); raises if its grammar is known bad."""
        compiled = self.compile(spec)
        if not compiled.done():
            self._compiling[req.request_id] = (req, compiled)
            return True
        error = compiled.exception()
        if error is not None:
            raise error
        return False

    def ready(self, idle: bool) -> tuple[list[Request], list[RequestFailure]]:
        """Held requests whose grammar is now compiled, and those whose grammar failed (which end here).
        `idle`: nothing else to run, so wait a moment for a compilation rather than spin."""
        if not self._compiling:
            return [], []
        if idle:
            concurrent.futures.wait([f for _, f in self._compiling.values()], timeout=GRAMMAR_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failures = [], []
        for request_id, (req, compiled) in list(self._compiling.items()):
            if not compiled.done():
                continue
            del self._compiling[request_id]
            error = compiled.exception()
            if error is not None:
                failures.append(RequestFailure(request_id, str(error), in_step=False))
            else:
                ready.append(req)
        return ready, failures

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._compiling.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._compiling

    def __len__(self) -> int:
        return len(self._compiling)

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
