"""Where a process's start goes, phase by phase (a worker's cold start is a product figure: a failover
replacement or an autoscaler's new worker serves only once it is up).

    clock = StartupClock.since_exec()  # "import": the process's age so far (interpreter and imports)
    ... load the weights ...
    clock.lap("weights")               # the time since the previous lap
    clock.summary()                    # 'import 1.71 s, weights 0.48 s, ...'
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

# the "ticks" /proc/<pid>/stat counts a process's start time in since boot
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_age_s() -> float | None:
    """Seconds since this process was started (exec'd), from /proc; None where there is no /proc."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return None
    # NOTE: the command name (field 2) may hold spaces and parentheses: fields are counted after its last ')'
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return max(0.0, uptime - start_ticks / _CLOCK_TICKS)


@dataclass
class StartupClock:
    """Phases of a start in the order they ran, each its seconds."""

    phases: dict[str, float] = field(default_factory=dict)
    _last: float = field(default_factory=time.perf_counter, repr=False)

    @classmethod
    def since_exec(cls) -> StartupClock:
        """A clock for a process's own start, made once its imports are done: the process's age so far is its
        "import" phase (the interpreter's start and the imports; not counted where there is no /proc)."""
        age = process_age_s()
        return cls({"import": age} if age is not None else {})

    def lap(self, phase: str) -> float:
        """Close `phase` (the time since the last lap, or since the clock was made); returns its seconds."""
        now = time.perf_counter()
        seconds = now - self._last
        self._last = now
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        return seconds

    @property
    def total_s(self) -> float:
        return sum(self.phases.values())

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items())
