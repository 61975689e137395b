"""A worker exits when the process that launched it is gone, from its first moments on.

The launcher (`kvbaton serve`, or a Ray actor) writes its own PID into the worker's environment
(`cluster.worker_env`); the worker compares its parent with it from a thread started before the
model loads. Reading the parent only once the worker was up (as before) missed a launcher killed
during the load: by then the worker had been re-parented, took its new parent for the launcher,
and served nobody for good. `PR_SET_PDEATHSIG` would not do either: it fires when the *thread* that
forked the child exits, and launchers start workers from pool threads.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PARENT_ENV = "KVBATON_PARENT_PID"
CHECK_EVERY_S = 0.5
GRACE_S = 10.0  # after SIGTERM (which unwinds the worker's `finally`), the hard exit
# What only the launcher would have removed (its shm arena): removed by whichever of its workers finds it gone.
_when_orphaned: list[Callable[[], None]] = []


def launcher_pid() -> int:
    """The launcher's PID, as it said (else this process's parent now)."""
    value = os.environ.get(PARENT_ENV, "")
    return int(value) if value.isdigit() else os.getppid()


def when_orphaned(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` (once the launcher is found gone, before this process exits) for what the launcher's own
    `finally` would have removed: a SIGKILLed launcher runs none."""
    _when_orphaned.append(cleanup)


def exit_with_launcher() -> None:
    """Start the watch: once the launcher is gone, SIGTERM ourselves, and exit hard if that does not end us."""
    parent = launcher_pid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(CHECK_EVERY_S)
        logger.error("the launcher (pid %d) is gone; exiting", parent)
        for cleanup in list(_when_orphaned):
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - the exit must happen whatever a cleanup does
                logger.exception("cleanup after the launcher's death failed")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="kvbaton-lifeline", daemon=True).start()
