from __future__ import annotations

import os
from pathlib import Path

import pytest

# NOTE: before anything loads OpenMP (torch, the C kernels), in this process and every one a test starts. Spinning
# OpenMP threads waste what a 2-core host has when two processes compute at once (two xdist workers, a test and its
# server, a server and a busy loop): a served 24-token request took 3-5x longer beside an in-process engine test,
# and under 1.1x with passive waiting (tests/README.md, "Parallel").
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
pytest.register_assert_rewrite("tests.support")  # before the first import of it, so its asserts explain themselves
from tests.support.helpers import MOE_ARCHS, build_tiny_checkpoint, build_tiny_moe_checkpoint  # noqa: E402

pytest_plugins = ["tests.support.budget"]  # the suite's wall time and peak RSS, at the end of every run


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_checkpoint(arch, root / arch) for arch in ("llama", "llama3", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-moe")
    return {arch: build_tiny_moe_checkpoint(arch, root / arch) for arch in MOE_ARCHS}


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from kvbaton.models.registry import pull_default_model

    return pull_default_model()


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    """The tiny Llama of `tiny_models` (the disaggregation and fault tests' model)."""
    return tiny_models["llama"]


# Under pytest-xdist (`scripts/test.sh` runs `-n 2`), the tests that start `kvbaton serve` or a deployment's
# processes run one after another on one worker: on 2 cores two of them side by side would fight for the CPU their
# deadlines assume. Every other module runs whole on either worker, beside them, its module-scoped fixtures built
# once. (xdist's own `--dist loadgroup` cannot do this under pytest 9: it renames test ids, which pytest 9 no
# longer lets a plugin do.)
# NOTE: tests/test_cli.py runs beside them: its deadlines are minutes (CLI commands that load a model or fail before
# serving), and it was among the largest modules of the suite's critical path. (The Ray module was tried there too:
# its cluster's processes slowed the end-to-end group by more than the module's own time.)
END_TO_END = ("tests/server/", "tests/disagg/", "tests/faults/", "tests/cluster/", "tests/soak/", "tests/fuzz/",
              "tests/models/test_mla.py")

# Modules that start servers but whose waits are minutes and whose load is a client's: they run beside the
# end-to-end unit like tests/test_cli.py (the other worker ended 3.5 min before the end-to-end one at d0f986b, 2 min
# before it at bfcb51e). A module joins only if no deadline of its own, nor of a test beside it, is tight: the
# OpenAI surface's cases are functional, each request given 300 s.
BESIDE = ("tests/test_chat_client.py", "tests/doctor/test_doctor_live.py", "tests/bench/test_bench_real_server.py",
          "tests/server/test_openai_surface.py")


# Modules under those folders that start nothing (policies, schemas, parsers over real objects, in process): any
# worker takes them, off the end-to-end unit (the suite's critical path)
IN_PROCESS = ("tests/cluster/test_autoscale.py", "tests/server/test_admission_control.py",
              "tests/server/test_chat_encoding.py", "tests/server/test_output_budget.py")


def work_unit(nodeid: str) -> str:
    """What one xdist worker runs whole: every end-to-end test together, else the test's module."""
    module = nodeid.split("::")[0]
    return "end-to-end" if module.startswith(END_TO_END) and module not in IN_PROCESS + BESIDE else module


# The modules whose in-process engines hold the default model (the budget report's "raised by"): each peaks ~1 GiB
# above its worker's resident set, and that set grows module by module (imports, kernel builds, allocator caches).
# Handed out first, right after the end-to-end unit, they peak on the smallest one (the budget is 2 GiB a process).
MEMORY_HEAVY = ("tests/engine/test_deterministic.py", "tests/engine/test_compute_paths.py",
                "tests/models/test_default_model.py", "tests/kv/test_kv_quantization.py",
                "tests/kv/store/test_background_load.py", "tests/engine/test_structured_outputs.py",
                "tests/kv/store/test_store_engine.py")


def hand_out_order(unit: str) -> int:
    """Work units are handed out by this key, then biggest first: end-to-end, the memory-heavy modules, the rest."""
    if unit == "end-to-end":
        return 0
    return 1 + MEMORY_HEAVY.index(unit) if unit in MEMORY_HEAVY else 1 + len(MEMORY_HEAVY)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: pytest without xdist never calls it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):  # the queue is biggest first (xdist's loadscope reorder)
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            first = min(self.workqueue, key=hand_out_order)  # min keeps the earliest (biggest) of equal keys
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return ByWorkUnit(config, log)
