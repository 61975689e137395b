"""Admission control: refuse at once ("server busy") rather than queue without bound.

A request is pending from admission until its first token. It is refused when the pending
queue is full, or when the prompt tokens already pending plus its own exceed what the KV
pool could hold (it would only wait for blocks that cannot come soon).

The server releases a request's entries however it ends (first token, finished, failed, its
client gone before a choice ever started). As a backstop against a path that forgets, an entry
older than `max_pending_s` is dropped with a warning: no request waits that long for a first
token (the router aborts one that makes no progress for its request timeout, 600 s by default),
so such an entry can only be a leak, and a leak must not turn into "server busy" for everyone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting_requests: int = 256
    max_pending_tokens: int | None = None  # None: the KV pool's capacity in tokens
    max_pending_s: float = 900.0  # an older entry is a leak: dropped (see the module's docstring)

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be >= 1")
        if not self.max_pending_s > 0:
            raise ValueError("max_pending_s must be > 0")


@dataclass
class _Entry:
    num_prompt_tokens: int
    admitted_at: float


class AdmissionController:
    def __init__(self, limits: AdmissionLimits, kv_capacity_tokens: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_waiting = limits.max_waiting_requests
        self.max_tokens = limits.max_pending_tokens or kv_capacity_tokens
        self.max_pending_s = limits.max_pending_s
        self.clock = clock  # the simulator passes its own
        self._pending: dict[str, _Entry] = {}  # request id -> entry, oldest first (insertion order)
        self._pending_tokens = 0
        self.num_expired = 0

    def try_admit(self, request_id: str, num_prompt_tokens: int) -> str | None:
        """Admit (returns None) or say why not."""
        now = self.clock()
        self._expire(now)
        if len(self._pending) >= self.max_waiting:
            return f"server busy: {len(self._pending)} requests already waiting"
        if self._pending and self._pending_tokens + num_prompt_tokens > self.max_tokens:
            return f"server busy: {self._pending_tokens} prompt tokens already waiting for KV cache space"
        self.started(request_id)  # an id admitted twice counts once
        self._pending[request_id] = _Entry(num_prompt_tokens, now)
        self._pending_tokens += num_prompt_tokens
        return None

    def started(self, request_id: str) -> None:
        """First token produced (or request gone): it no longer waits. Idempotent."""
        entry = self._pending.pop(request_id, None)
        if entry is not None:
            self._pending_tokens -= entry.num_prompt_tokens

    def _expire(self, now: float) -> None:
        while self._pending:
            request_id, entry = next(iter(self._pending.items()))
            if now - entry.admitted_at <= self.max_pending_s:
                return
            self.started(request_id)
            self.num_expired += 1
            log.warning("admission entry of %s dropped after %.0f s without a first token or a release "
                        "(a leak in the server: please report it)", request_id, now - entry.admitted_at)

    @property
    def num_pending(self) -> int:
        self._expire(self.clock())
        return len(self._pending)
