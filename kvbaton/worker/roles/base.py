"""What a worker's role is: the contract between the worker process and what it computes with.

The worker process (`worker/main.py`) is a shell every role shares: its command and event sockets, the signed
codec, the heartbeat thread, the lifeline to its launcher, drain and shutdown, and the rule that a command which
raises fails only the request it names. A role is the rest:
- **what it receives**: its `WorkerSpec` and the cluster secret, from which `start` builds what it computes with
  (today an engine core: `engine_role.py`; an expert shard or a vision encoder has none);
- **what it does**: the router commands it takes (`commands`), and one round of work whenever the shell asks
  (`run_round`), the shell waiting on commands meanwhile for as long as `wait_ms` says;
- **what it reports**: its hello, which registers it in the pool, and its load, which the shell numbers and
  sends with each round's events and with every heartbeat;
- **how it is supervised**: not by itself. The pool watches the heartbeat and relaunches a dead worker
  (`router/supervision.py`); a round that raises ends the process, a command that raises is contained.

A new role is a new module here and a name in `ROLES` (`__init__.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import msgspec

from kvbaton.messages.router_worker import WorkerHello, WorkerLoad
from kvbaton.messages.worker_spec import WorkerRole, WorkerSpec
from kvbaton.platform.startup import StartupClock

Handler = Callable[[Any], None]


class WorkerContext(Protocol):
    """What a role may use of the worker process around it."""

    name: str

    def send(self, msg: msgspec.Struct) -> None:
        """Push an event to the router."""
        ...

    def report_load(self) -> WorkerLoad:
        """The role's load now, numbered; the heartbeat carries it too until the next one."""
        ...


class Role(ABC):
    role: ClassVar[WorkerRole]

    @abstractmethod
    def start(self, spec: WorkerSpec, secret: bytes, startup: StartupClock) -> None:
        """Build what this role computes with, before its hello: a worker joins the pool ready to serve."""

    @abstractmethod
    def hello(self, worker: WorkerContext, index: int, pid: int, address: str) -> WorkerHello:
        """What registers this worker in the pool (`address`: where its command socket listens)."""

    @abstractmethod
    def commands(self, worker: WorkerContext) -> dict[type, Handler]:
        """Handlers for the router commands this role takes (the shell takes drain and shutdown)."""

    def serving(self, worker: WorkerContext) -> None:  # noqa: B027 - a hook: most roles need nothing here
        """Once the hello is out: start what no request needs before its first token (in the background)."""

    @abstractmethod
    def run_round(self, worker: WorkerContext) -> None:
        """One round of work between two looks at the commands: move hand-offs along, compute, report."""

    @abstractmethod
    def wait_ms(self) -> int:
        """How long the shell may wait for a command before the next round (0: work is runnable now)."""

    @abstractmethod
    def idle(self) -> bool:
        """Nothing in flight: a drain is complete."""

    @abstractmethod
    def load(self, seq: int) -> WorkerLoad:
        """What the router balances by, as of now (`seq` numbers it; the shell keeps the count)."""

    @abstractmethod
    def close(self) -> None:
        """Release what `start` built (the shell closes its sockets after)."""
