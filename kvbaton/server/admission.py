"""Admission control: refuse at once ("server busy") rather than queue without bound.

A request is pending from admission until its first token. It is refused when the pending
queue is full, or when the prompt tokens already pending plus its own exceed what the KV
pool could hold (it would only wait for blocks that cannot come soon).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting_requests: int = 256
    max_pending_tokens: int | None = None  # None: the KV pool's capacity in tokens

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be >= 1")


class AdmissionController:
    def __init__(self, limits: AdmissionLimits, kv_capacity_tokens: int) -> None:
        self.max_waiting = limits.max_waiting_requests
        self.max_tokens = limits.max_pending_tokens or kv_capacity_tokens
        self._pending: dict[str, int] = {}  # request id -> prompt tokens

    def try_admit(self, request_id: str, num_prompt_tokens: int) -> str | None:
        """Admit (returns None) or say why not."""
        if len(self._pending) >= self.max_waiting:
            return f"server busy: {len(self._pending)} requests already waiting"
        pending_tokens = sum(self._pending.values())
        if self._pending and pending_tokens + num_prompt_tokens > self.max_tokens:
            return f"server busy: {pending_tokens} prompt tokens already waiting for KV cache space"
        self._pending[request_id] = num_prompt_tokens
        return None

    def started(self, request_id: str) -> None:
        """First token produced (or request gone): it no longer waits."""
        self._pending.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._pending)
