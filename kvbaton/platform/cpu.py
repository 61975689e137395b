"""What this CPU can do: its vector and matrix extensions, caches and usable cores, read once.

Read from /proc/cpuinfo and /sys (Linux); where those are missing (another OS) only what torch
reports is known. The compute-path table (`kvbaton.platform.compute`) decides from this record.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# /proc/cpuinfo flag -> the name printed at start-up, in the order printed
FEATURES = {
    "avx2": "AVX2", "fma": "FMA", "avx512f": "AVX512F", "avx512bw": "AVX512BW", "avx512_vnni": "AVX512-VNNI",
    "avx_vnni": "AVX-VNNI", "avx512_bf16": "AVX512-BF16", "amx_tile": "AMX", "amx_bf16": "AMX-BF16",
    "amx_int8": "AMX-INT8",
}


@dataclass(frozen=True)
class CPUInfo:
    model_name: str
    arch: str  # platform.machine(): x86_64, aarch64, ...
    flags: frozenset[str]
    num_cores: int  # usable by this process (its affinity mask)
    l2_bytes: int | None  # per core
    l3_bytes: int | None

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def avx2(self) -> bool:
        return self.has("avx2") and self.has("fma")

    @property
    def avx512_bf16(self) -> bool:
        """`vdpbf16ps`: bf16 dot products in one instruction (Cooper Lake, Sapphire Rapids, Zen 4 and later)."""
        return self.has("avx512_bf16") and self.has("avx512bw")

    @property
    def amx_bf16(self) -> bool:
        return self.has("amx_bf16") and self.has("amx_tile")

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls run in hardware (oneDNN picks AVX512-BF16 or AMX), not emulated through fp32."""
        return self.avx512_bf16 or self.amx_bf16

    def summary(self) -> str:
        names = [name for flag, name in FEATURES.items() if flag in self.flags]
        caches = ", ".join(f"{label} {size // 2**20 if size >= 2**20 else size // 2**10}"
                           f"{' MiB' if size >= 2**20 else ' KiB'}"
                           for label, size in (("L2", self.l2_bytes), ("L3", self.l3_bytes)) if size)
        return (f"{self.model_name or self.arch}, {self.num_cores} cores"
                f"{', ' + caches if caches else ''}; {' '.join(names) or 'no AVX2'}")


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in a /proc/cpuinfo text."""
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def _cache_bytes(level: int) -> int | None:
    """Size of cpu0's data or unified cache at `level`, from sysfs ("2048K" -> 2 MiB)."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if int((index / "level").read_text()) != level or (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    return None


def _torch_flags() -> frozenset[str]:
    """Where /proc/cpuinfo is missing: what torch itself detected."""
    import torch  # NOTE: here only: the router and HTTP processes import this module without torch
    cpu = torch.backends.cpu.get_cpu_capability().lower()  # "avx2", "avx512", "default", ...
    flags = {"avx2", "fma"} if cpu in ("avx2", "avx512") else set()
    if cpu == "avx512":
        flags |= {"avx512f", "avx512bw"}
    if torch.cpu._is_avx512_bf16_supported():
        flags.add("avx512_bf16")
    if torch.cpu._is_amx_tile_supported():
        flags |= {"amx_tile", "amx_bf16"}
    return frozenset(flags)


@functools.cache
def detect_cpu() -> CPUInfo:
    """This machine's CPU (read once per process: it does not change under a running process)."""
    try:
        model, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        model, flags = platform.processor(), frozenset()
    if not flags:
        flags = _torch_flags()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return CPUInfo(model_name=model, arch=platform.machine(), flags=flags, num_cores=cores,
                   l2_bytes=_cache_bytes(2), l3_bytes=_cache_bytes(3))

