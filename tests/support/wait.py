"""Waiting for a condition, never for a fixed time: `wait_until` (sync) and `async_wait_until` (async).

A test that sleeps a fixed time either wastes it (the condition came sooner) or fails on a busy
machine (it came later). These poll the condition instead and give up only at a generous deadline,
with a message that says what was awaited. Fixed sleeps are banned in tests by ruff (TID251); a
sleep that is itself the behaviour under test carries `# noqa: TID251 - <why>`.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

Message = str | Callable[[], str]  # a callable is asked only on failure (e.g. for a server log's tail)


def _failure(message: Message, timeout_s: float) -> AssertionError:
    text = message() if callable(message) else message
    return AssertionError(f"{text} (not within {timeout_s:g} s)")


def wait_until(condition: Callable[[], T], timeout_s: float, *, interval_s: float = 0.05,
               message: Message = "condition not met") -> T:
    """Poll `condition` (no arguments) until it returns a truthy value, and return that value; raise
    `AssertionError` with `message` and the timeout once `timeout_s` has passed without one."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _failure(message, timeout_s)
        # the one allowed sleep: a polling pause between two looks at the condition, bounded by the deadline
        time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))  # noqa: TID251 - the polling pause


async def async_wait_until(condition: Callable[[], T | Awaitable[T]], timeout_s: float, *, interval_s: float = 0.05,
                           message: Message = "condition not met") -> T:
    """`wait_until` for async code: `condition` may be a plain or an async function; the event loop runs
    between looks."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _failure(message, timeout_s)
        # the one allowed sleep: a polling pause between two looks at the condition, bounded by the deadline
        await asyncio.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))  # noqa: TID251 - the polling pause
