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
_kept: dict[str, float] = {}  # module -> MiB by which the resident set stayed higher once it ended and was released
_test_resident: float | None = None  # the resident set when the test running now began
_resident_before: float | None = None  # the resident set, released, when the module running now began


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def resident_mib() -> float:
    """This process's resident set now (Linux; elsewhere the peak stands in)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return peak_rss_mib()


def pytest_sessionstart(session: pytest.Session) -> None:
    global _started
    _started = time.monotonic()
    _fixed_mmap_threshold()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 4 << 20


def _fixed_mmap_threshold() -> None:
    """Allocations of 4 MiB and more (weights, KV pools, logits) are mapped and go back to the OS when freed.

    NOTE: glibc's default threshold starts at 128 KiB and rises to the largest block freed (up to 32 MiB), after
    which freed tensors stay in its heap: after an engine on the default model was freed, this process kept
    ~0.3 GiB more resident (0.8 GiB in the KV-quality test), the next engine came on top of it, and a test with two
    engines peaked over 2 GiB. A fixed threshold keeps that from happening; `release_memory` trims the rest."""
    _glibc("mallopt", M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def _glibc(function: str, *args: int) -> None:
    """Call one of glibc's malloc tunables; elsewhere (macOS, musl) there is nothing to tune."""
    if sys.platform == "linux":
        try:
            getattr(ctypes.CDLL("libc.so.6"), function)(*args)
        except (OSError, AttributeError):
            pass  # not glibc (musl)


def release_memory() -> None:
    """Give what the last module freed back to the OS.

    NOTE: measured: after a module whose engines held the default model, the pytest process kept 0.6-0.9 GiB more
    resident with no engine left alive; glibc keeps freed tensors' memory in its heaps (its mmap threshold rises
    after the first large free). The suite's peak RSS grew module by module to ~5 GiB. `malloc_trim` returns it."""
    gc.collect()
    _glibc("malloc_trim", 0)


def pytest_runtest_setup(item: pytest.Item) -> None:
    global _module, _resident_before, _test_resident
    name = item.nodeid.split("::")[0]
    if _module is None or _module[0] != name:
        last = _module[0] if _module is not None else None
        _close_module()
        release_memory()
        resident = resident_mib()
        if last is not None and _resident_before is not None:
            _kept[last] = resident - _resident_before  # what the last module left alive (a leak if large)
        _module, _resident_before = (name, peak_rss_mib()), resident
    _test_resident = resident_mib()


RELEASE_AFTER_MIB = 64  # a test that left the process this much larger gives the memory back before the next


def pytest_runtest_logfinish() -> None:
    """After a test (its fixtures torn down) that grew the resident set, give what it freed back to the OS: the
    next test's engines then start from the floor, not on top of the last one's freed heap (a test with two
    default-model engines peaked 0.5-1 GiB higher without it). Cheap tests cost one read of /proc."""
    if _test_resident is not None and resident_mib() - _test_resident > RELEASE_AFTER_MIB:
        release_memory()


def _close_module() -> None:
    """Charge the module running now with what it raised the peak by (once)."""
    global _module
    if _module is not None:
        _raised[_module[0]] = _raised.get(_module[0], 0.0) + peak_rss_mib() - _module[1]
        _module = None


def _report() -> dict:
    """This process's figures: what a pytest-xdist worker sends its controller."""
    _close_module()
    return {"peak_mib": peak_rss_mib(), "raised": dict(_raised), "kept": dict(_kept),
            "wall_s": time.monotonic() - _started}


_workers: dict[str, dict] = {}  # under pytest-xdist, the controller's copy of each worker's `_report`


def pytest_sessionfinish(session: pytest.Session) -> None:
    output = getattr(session.config, "workeroutput", None)  # set only in an xdist worker
    if output is not None:
        output["kvbaton_budget"] = _report()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ARG001 - xdist's hook: a worker finished
    report = getattr(node, "workeroutput", {}).get("kvbaton_budget")
    if report is not None:
        _workers[node.gateway.id] = report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if getattr(terminalreporter.config, "workeroutput", None) is not None:
        return  # a worker: the controller reports
    reports = {"main": _report(), **_workers}
    raised: dict[str, float] = {}
    kept: dict[str, float] = {}
    for name, report in reports.items():  # under xdist each module named with its worker: a peak is per process
        suffix = f" ({name})" if len(reports) > 1 else ""
        raised.update({module + suffix: mib for module, mib in report["raised"].items()})
        kept.update({module + suffix: mib for module, mib in report["kept"].items()})
    wall = time.monotonic() - _started
    # Each pytest process is held to the budget (the controller of an xdist run holds no test).
    rss = max(report["peak_mib"] for report in reports.values())
    over = [what for what, ok in (("time", wall <= BUDGET_S), ("memory", rss <= BUDGET_RSS_MIB)) if not ok]
    verdict = f"OVER BUDGET ({', '.join(over)})" if over else "within budget"
    terminalreporter.write_line("pytest peak RSS raised by: " + _top(raised, 0.0))
    terminalreporter.write_line("pytest resident set kept after: " + _top(kept, 16.0))
    peaks = ", ".join(f"{name} {report['peak_mib']:.0f}" for name, report in reports.items())
    if _workers:  # which worker's share of the tests is the critical path: trim there first
        ended = ", ".join(f"{name} {report['wall_s'] / 60:.1f}" for name, report in sorted(_workers.items()))
        terminalreporter.write_line(f"xdist workers done after (min): {ended}")
    terminalreporter.write_line(f"suite budget: test phase {wall / 60:.1f} min (budget {BUDGET_S // 60}), pytest "
                                f"peak RSS {rss:.0f} MiB per process (budget {BUDGET_RSS_MIB}; {peaks}): {verdict}")


def _top(mib_by_module: dict[str, float], floor: float) -> str:
    top = sorted(mib_by_module.items(), key=lambda kv: -kv[1])[:SHOW_MODULES]
    return ", ".join(f"{module} +{mib:.0f} MiB" for module, mib in top if mib > floor) or "none"
