"""The xdist schedule in tests/conftest.py names modules by path: a renamed or new module must not slip out of it."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import BESIDE, END_TO_END, IN_PROCESS, MEMORY_HEAVY, work_unit

ROOT = Path(__file__).resolve().parent.parent


def test_every_scheduled_path_exists():
    assert [p for p in END_TO_END + MEMORY_HEAVY + IN_PROCESS + BESIDE if not (ROOT / p).exists()] == []


def test_the_in_process_modules_start_nothing():
    """Taken off the end-to-end unit, they must not start a server, a router's workers or a process."""
    starts = ("tests.support.server", "tests.support.pd", "subprocess", "Popen", "served(", "deploy(")
    assert [p for p in IN_PROCESS if any(s in (ROOT / p).read_text() for s in starts)] == []


def test_every_module_that_starts_a_server_runs_with_the_end_to_end_set():
    """Two servers side by side on 2 cores starve each other's deadlines: they run one after another (but for the
    few named in BESIDE, whose waits are minutes)."""
    serving = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("test_*.py"))
               if p.name != Path(__file__).name and "from tests.support.server import" in p.read_text()]
    assert serving and [m for m in serving if work_unit(m) != "end-to-end" and m not in BESIDE] == []
    assert [m for m in BESIDE if work_unit(m) == "end-to-end"] == []
