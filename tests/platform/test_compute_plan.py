"""The platform layer: CPU features read from /proc/cpuinfo, and the compute-path table's choice for
each kind of machine this project runs on (pure functions: every row is checked on any CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbaton.config import ConfigError
from kvbaton.platform.compute import COMPUTE_PATHS, choose_compute_plan
from kvbaton.platform.cpu import CPUInfo, detect_cpu, parse_cpuinfo

EPYC_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi2 sha_ni"  # the AVX2-only machines here
ZEN4_FLAGS = EPYC_FLAGS + " avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"  # AVX512-BF16, no AMX
XEON_FLAGS = ZEN4_FLAGS + " avx_vnni amx_bf16 amx_tile amx_int8"  # Sapphire Rapids


def cpu(flags: str, arch: str = "x86_64") -> CPUInfo:
    return CPUInfo(model_name="test CPU", arch=arch, flags=frozenset(flags.split()), num_cores=2,
                   l2_bytes=2**20, l3_bytes=32 * 2**20)


def test_parse_cpuinfo_reads_the_first_processor():
    text = ("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: " + EPYC_FLAGS + "\n\n"
            "processor\t: 1\nmodel name\t: other\nflags\t\t: sse\n")
    model, flags = parse_cpuinfo(text)
    assert model == "AMD EPYC 7B13" and "avx2" in flags and "avx512f" not in flags


def test_detect_cpu_agrees_with_proc_cpuinfo():
    info = detect_cpu()
    text = Path("/proc/cpuinfo").read_text()
    _, flags = parse_cpuinfo(text)
    assert info.flags == flags and info.num_cores >= 1
    assert info.avx512_bf16 == ("avx512_bf16" in flags and "avx512bw" in flags)
    assert info.summary().startswith(info.model_name)


@pytest.mark.parametrize("flags, path, few, many, norm, attention", [
    (EPYC_FLAGS, "avx2", "stream-avx2", "packed", "c", "c"),
    (XEON_FLAGS, "amx", "dot-avx512bf16", "amx", "c", "c+sdpa"),
    (ZEN4_FLAGS, "avx512-bf16", "dot-avx512bf16", "onednn-packed", "c", "c"),
    ("fp asimd", "onednn", "torch", "torch", "torch", "c"),  # no kvbaton linear kernels off x86 (arch below)
])
def test_auto_row_per_machine_kind(flags, path, few, many, norm, attention):
    arch = "aarch64" if "asimd" in flags else "x86_64"
    plan = choose_compute_plan(cpu(flags, arch), "bfloat16")
    assert (plan.path, plan.few_rows_linear, plan.many_rows_linear, plan.norm, plan.attention) == (
        path, few, many, norm, attention)
    assert not plan.deterministic and path in plan.summary()


def test_without_kernels_everything_is_pytorch():
    plan = choose_compute_plan(cpu(EPYC_FLAGS), "bfloat16", kernels_available=False)
    assert plan.path == "torch" and plan.many_rows_linear == "torch-fp32" and plan.attention == "torch"
    assert "could not be built" in plan.reason
    assert choose_compute_plan(cpu(XEON_FLAGS), "bfloat16", "torch").many_rows_linear == "torch"  # native bf16


def test_float32_uses_pytorch_gemms_on_every_path():
    for path in ("amx", "avx512-bf16", "avx2", "onednn"):
        plan = choose_compute_plan(cpu(XEON_FLAGS), "float32", path)
        assert (plan.few_rows_linear, plan.many_rows_linear, plan.attention) == ("torch", "torch", "c")


@pytest.mark.parametrize("path, flags, needs", [
    ("amx", ZEN4_FLAGS, "AMX-BF16"), ("avx512-bf16", EPYC_FLAGS, "AVX512-BF16"), ("avx2", "sse sse2", "AVX2"),
])
def test_a_path_this_cpu_cannot_run_is_refused_with_the_reason(path, flags, needs):
    with pytest.raises(ConfigError, match=needs):
        choose_compute_plan(cpu(flags), "bfloat16", path)


def test_unknown_path_and_kernel_paths_without_kernels_are_refused():
    with pytest.raises(ConfigError, match="unknown compute path"):
        choose_compute_plan(cpu(EPYC_FLAGS), "bfloat16", "avx1024")
    with pytest.raises(ConfigError, match="C kernels"):
        choose_compute_plan(cpu(EPYC_FLAGS), "bfloat16", "avx2", kernels_available=False)


@pytest.mark.parametrize("flags, linear", [(EPYC_FLAGS, "dot-generic"), (ZEN4_FLAGS, "dot-avx512bf16"),
                                           (XEON_FLAGS, "amx")])
def test_deterministic_variant_is_one_kernel_for_every_row_count(flags, linear):
    plan = choose_compute_plan(cpu(flags), "bfloat16", deterministic=True)
    assert plan.deterministic and plan.few_rows_linear == plan.many_rows_linear == linear
    assert plan.attention == "c-per-token" and plan.norm == "c"
    # the AVX2 machines' deterministic setup runs anywhere with AVX2, for cross-checks
    assert choose_compute_plan(cpu(flags), "bfloat16", "avx2", deterministic=True).many_rows_linear == "dot-generic"
    with pytest.raises(ConfigError, match="deterministic"):
        choose_compute_plan(cpu(flags), "bfloat16", "torch", deterministic=True)


def test_every_named_path_is_in_the_table():
    rows = {choose_compute_plan(cpu(XEON_FLAGS), "bfloat16", p).path for p in COMPUTE_PATHS if p != "auto"}
    assert rows == set(COMPUTE_PATHS) - {"auto"}


def test_without_the_os_granting_amx_the_xeon_takes_the_avx512_row():
    plan = choose_compute_plan(cpu(XEON_FLAGS), "bfloat16", amx_granted=False)
    assert plan.path == "avx512-bf16" and "refused" in plan.reason
    with pytest.raises(ConfigError, match="refused this process"):
        choose_compute_plan(cpu(XEON_FLAGS), "bfloat16", "amx", amx_granted=False)
