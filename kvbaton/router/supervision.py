"""Supervision: the pool's worker slots, and the replacement of a worker the pool declared dead.

A slot is one worker's place in the pool, named as its worker (`kvbaton-decode-0`); it outlives
the worker. When the pool declares a worker dead (its process exited, or its heartbeat fell
silent and it was fenced), the slot restarts it under the same name, after an exponential
back-off, within a restart budget:

    death -> RESTARTING -- back-off 0.5 s, 1 s, 2 s ... (at most 30 s) --> launch, wait for hello
               ^                                                              | joined: UP
               '--------- the replacement exited or never said hello ---------'
    more than `max_restarts` restarts within `window_s`: DOWN (for good; the reason stays visible)

A worker that was drained and retired, or stopped with the pool, is not replaced: its slot goes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from kvbaton.config import ConfigError
from kvbaton.messages.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    max_restarts: int = 5  # per slot within `window_s`; 0: a dead worker is never replaced
    window_s: float = 600.0
    backoff_s: float = 0.5  # before the first restart; doubles with every restart within the window
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ConfigError(f"invalid restart policy {self}: need max_restarts >= 0, window_s > 0 and "
                             "0 <= backoff_s <= max_backoff_s")


class SlotState(str, enum.Enum):
    UP = "up"  # its worker runs (or is starting for the first time)
    RESTARTING = "restarting"  # its worker died; a replacement waits out its back-off or is starting
    DOWN = "down"  # its worker died and the restart budget is spent: it stays down


@dataclass(kw_only=True)
class Slot:
    spec: WorkerSpec  # what its worker was launched with; a replacement is launched with it again
    state: SlotState = SlotState.UP
    restarts: int = 0  # since the pool started
    reason: str | None = None  # why its last worker died
    died_again: str | None = None  # its replacement died while its restart was still finishing
    recent: deque[float] = field(default_factory=deque)  # monotonic times of its restarts within the window

    @property
    def name(self) -> str:
        return self.spec.name

    def backoff(self, policy: RestartPolicy, now: float) -> float | None:
        """Seconds to wait before the next restart, or None once the budget is spent."""
        while self.recent and now - self.recent[0] > policy.window_s:
            self.recent.popleft()
        if len(self.recent) >= policy.max_restarts:
            return None
        return min(policy.backoff_s * 2 ** len(self.recent), policy.max_backoff_s)

    def describe(self, policy: RestartPolicy) -> str:
        budget = f"{policy.max_restarts} restart(s) per {policy.window_s:.0f} s"
        if self.state == SlotState.DOWN:
            return (f"{self.name} is down for good: it died ({self.reason}) and its restart budget is spent "
                    f"({budget}; see --max-worker-restarts)")
        return f"{self.name} died ({self.reason}) and is restarting ({len(self.recent)} of {budget} used)"

    def view(self, policy: RestartPolicy) -> dict[str, Any]:
        """A slot with no worker in the pool, as `GET /workers` shows it."""
        return {"name": self.name, "role": self.spec.role.value, "index": self.spec.index, "pid": None,
                "healthy": False, "state": self.state.value, "restarts": self.restarts,
                "reason": self.describe(policy)}


Relaunch = Callable[[WorkerSpec], Awaitable[None]]  # start the worker again and wait for its hello; raises if not


class Supervisor:
    """The pool's slots and their restart tasks. `relaunch` starts a replacement and returns once
    it has joined the pool (raising if it exited or timed out; then nothing of it runs);
    `changed` is called whenever a slot changes state (the pool's health may have changed);
    `spawn` starts a task the pool watches (a task that dies takes the pool down)."""

    def __init__(self, policy: RestartPolicy, relaunch: Relaunch, changed: Callable[[], None],
                 spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task]) -> None:
        self.policy, self._relaunch, self._changed, self._spawn = policy, relaunch, changed, spawn
        self.slots: dict[str, Slot] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    def add(self, spec: WorkerSpec) -> None:
        self.slots[spec.name] = Slot(spec=spec)

    def remove(self, name: str) -> None:
        """The worker was retired (drained): its slot goes, and nothing replaces it."""
        self.slots.pop(name, None)

    def restarts(self, name: str) -> int:
        slot = self.slots.get(name)
        return slot.restarts if slot else 0

    def not_up(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.state != SlotState.UP]

    def worker_died(self, name: str, reason: str) -> None:
        """The pool declared `name` dead and fenced it: replace it, unless its budget is spent."""
        slot = self.slots.get(name)
        if slot is None:
            return
        if name in self._tasks:  # it joined and died before its restart task saw it join
            slot.died_again = reason
            return
        slot.state, slot.reason = SlotState.RESTARTING, reason
        self._tasks[name] = self._spawn(self._restart(slot), f"restart of {name}")

    async def _restart(self, slot: Slot) -> None:
        try:
            while (delay := slot.backoff(self.policy, time.monotonic())) is not None:
                logger.warning("%s died (%s); restarting it in %.1f s", slot.name, slot.reason, delay)
                self._changed()
                await asyncio.sleep(delay)
                slot.recent.append(time.monotonic())
                slot.restarts += 1
                try:
                    await self._relaunch(slot.spec)
                except Exception as exc:  # noqa: BLE001 - any failure to start counts against the budget
                    slot.reason = f"its replacement failed: {exc}"
                    continue
                if slot.died_again is not None:
                    slot.reason, slot.died_again = slot.died_again, None
                    continue
                slot.state = SlotState.UP
                logger.warning("%s is back (restart %d)", slot.name, slot.restarts)
                self._changed()
                return
            slot.state = SlotState.DOWN
            logger.error("%s stays down: %s", slot.name, slot.describe(self.policy))
            self._changed()
        finally:
            self._tasks.pop(slot.name, None)

    async def close(self) -> None:
        """Stop restarting (a replacement launched but not joined is killed by `relaunch`)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class TaskGuard:
    """Background tasks that cannot die silently: one that raises, or is cancelled other than by
    `close`, or (a `forever` task) returns, is logged and `on_death(why)` is called."""

    def __init__(self, on_death: Callable[[str], None]) -> None:
        self._on_death = on_death
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    def spawn(self, coro: Coroutine[Any, Any, None], what: str, forever: bool = False) -> asyncio.Task:
        task = asyncio.create_task(coro, name=what)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, what, forever))
        return task

    def _done(self, task: asyncio.Task, what: str, forever: bool) -> None:
        self._tasks.discard(task)
        if self._closing:
            return
        if task.cancelled():
            self._on_death(f"the {what} task was cancelled")
        elif (exc := task.exception()) is not None:
            logger.error("the %s task died", what, exc_info=exc)
            self._on_death(f"the {what} task died: {exc!r}")
        elif forever:
            self._on_death(f"the {what} task ended")

    async def close(self) -> None:
        self._closing = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
