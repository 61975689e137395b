"""The suite's budget, reported at the end of every run: the test phase's wall time, the pytest process's peak RSS
and the test modules that raised that peak (tests/README.md states the budget: 15 minutes,
2 GiB); and between two modules, what the last one freed goes back to the OS. A pytest plugin, loaded by
tests/conftest.py."""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
import time

import pytest

BUDGET_S = 15 * 60
BUDGET_RSS_MIB = 2048
SHOW_MODULES = 8

_started = time.monotonic()
_raised: dict[str, float] = {}  # module -> MiB by which it raised the process's peak RSS
_module: tuple[str, float] | None = None  # the module running now, and the peak RSS when it began


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def pytest_sessionstart(session: pytest.Session) -> None:
    global _started
    _started = time.monotonic()


def release_memory() -> None:
    """Give what the last module freed back to the OS.

    NOTE: measured: after a module whose engines held the default model, the pytest process kept 0.6-0.9 GiB more
    resident with no engine left alive; glibc keeps freed tensors' memory in its heaps (its mmap threshold rises
    after the first large free). The suite's peak RSS grew module by module to ~5 GiB. `malloc_trim` returns it."""
    gc.collect()
    if sys.platform == "linux":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc (musl): nothing to trim


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _module
    name = item.nodeid.split("::")[0]
    if _module is None or _module[0] != name:
        _close_module()
        release_memory()
        _module = (name, peak_rss_mib())


def _close_module() -> None:
    if _module is not None:
        _raised[_module[0]] = _raised.get(_module[0], 0.0) + peak_rss_mib() - _module[1]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    _close_module()
    wall, rss = time.monotonic() - _started, peak_rss_mib()
    over = [what for what, ok in (("time", wall <= BUDGET_S), ("memory", rss <= BUDGET_RSS_MIB)) if not ok]
    verdict = f"OVER BUDGET ({', '.join(over)})" if over else "within budget"
    raised = sorted(_raised.items(), key=lambda kv: -kv[1])[:SHOW_MODULES]
    terminalreporter.write_line("pytest peak RSS raised by: " + ", ".join(f"{m} +{g:.0f} MiB" for m, g in raised
                                                                          if g > 0))
    terminalreporter.write_line(f"suite budget: test phase {wall / 60:.1f} min (budget {BUDGET_S // 60}), pytest "
                                f"peak RSS {rss:.0f} MiB (budget {BUDGET_RSS_MIB}): {verdict}")
