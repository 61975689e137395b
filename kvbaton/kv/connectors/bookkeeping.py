"""A receiver's memory of the requests it is not expecting, shared by the transports that need one."""

from __future__ import annotations

import time
from typing import Generic, TypeVar

T = TypeVar("T")

# NOTE: one horizon for every transport. A receiver needs to remember a request it is not expecting
# only while messages of it can still come, and they stop when its sender gives up: at the transfer's
# deadline (the router's, 30 s by default), counted from begin(), which follows expect(). Twice that
# default covers them; it is also the redis transport's default key TTL. Forgetting too early costs
# little: a late message then waits here as an early one, until the next horizon.
REMEMBER_S = 60.0


class RequestMemory(Generic[T]):
    """What a receiver remembers of requests it is not expecting (engine thread only): messages that
    came before `expect()` (`hold`; `expect` hands them back), and requests that ended (`end`; what
    comes for them later is dropped, and `has_ended` says so). An entry goes REMEMBER_S after it was
    made (`prune`)."""

    def __init__(self) -> None:
        self._notes: dict[str, tuple[float, list[T] | None]] = {}  # id -> (since, early items; None: ended)

    def hold(self, request_id: str, item: T) -> None:
        """Keep `item` for `expect()`; dropped if the request has ended."""
        items = self._notes.setdefault(request_id, (time.monotonic(), []))[1]
        if items is not None:
            items.append(item)

    def expect(self, request_id: str) -> list[T]:
        """The request is expected (again): forget it ended; return what came early, in order."""
        return self._notes.pop(request_id, (0.0, None))[1] or []

    def end(self, request_id: str) -> None:
        self._notes[request_id] = (time.monotonic(), None)

    def has_ended(self, request_id: str) -> bool:
        return self._notes.get(request_id, (0.0, []))[1] is None

    def prune(self, now: float) -> None:
        horizon = now - REMEMBER_S
        for request_id in [r for r, (since, _) in self._notes.items() if since < horizon]:
            del self._notes[request_id]
