"""Compile kvbaton's C kernels on first use with the system C compiler and load them with ctypes.

They are plain C (no PyTorch headers), so a build takes about a second; the shared object is
cached under `<cache root>/kernels/`, keyed by the source, the flags and the CPU, because
`-march=native` code is only valid on the CPU it was built for. Without a compiler, or with
`KVBATON_KERNELS=0`, `cpu_kernels()` returns None and callers use their PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvbaton.paths import kernels_dir

log = logging.getLogger(__name__)

SOURCES = ("paged_attention.c", "paged_prefill.c", "linear_bf16.c", "gemm_packed.c", "norm_bf16.c", "copy_rows.c",
           "linear_dot.c", "gemm_amx.c", "moe_experts.c", "silu_mul_bf16.c", "rope_bf16.c", "decode_layers.c",
           "argmax_rows.c")
HEADERS = ("vec8.h", "bf16x16.h", "team.h")
_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# C signatures: name -> (return type, argument types); the sources document each argument.
SIGNATURES = {
    "kvbaton_paged_decode_attention": (_i, [_p, _i, _p, _p, _p, _p, _i64, _i64, _i, _i, _i, _i, _f, _i, _i]),
    "kvbaton_paged_prefill_attention": (_i, [_p, _i, _p, _p, _p, _i64, _i64, _i, _i, _i, _i, _f, _i]),
    "kvbaton_linear_bf16": (_i, [_p, _p, _p, _p, _i64, _i64, _i64, _i]),
    "kvbaton_gemm_packed": (_i, [_p, _p, _i, _p, _p, _i, _i64, _i64, _i64, _i]),
    "kvbaton_add_rms_norm_bf16": (None, [_p, _p, _p, _p, _p, _i64, _i64, _f, _i]),
    "kvbaton_rms_norm_heads_bf16": (None, [_p, _i64, _i64, _i64, _i64, _p, _f, _i]),
    "kvbaton_copy_rows": (None, [_p, _p, _p, _p, _i64, _i64, _i]),
    "kvbaton_linear_dot": (_i, [_p, _p, _i, _p, _p, _i, _i64, _i64, _i64, _i, _i]),
    "kvbaton_gemm_amx": (_i, [_p, _p, _p, _p, _i, _i64, _i64, _i64, _i]),
    "kvbaton_amx_enable": (_i, []),
    "kvbaton_moe_experts": (_i, [_p, _p, _p, _p, _p, _p, _i64, _i, _i64, _i64, _i64, _i, _i, _i]),
    "kvbaton_moe_route": (_i, [_p, _p, _i64, _i64, _i64, _i, _i, _i, _i, _p, _p]),
    "kvbaton_silu_mul_bf16": (None, [_p, _p, _i64, _i64, _i]),
    "kvbaton_rope_bf16": (None, [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i]),
    "kvbaton_decode_layers": (_i, [_p, _p, _p, _p, _p, _p, _p, _i64, _p, _i64, _p, _i64, _p]),
    "kvbaton_decode_layers_take": (_i, [_p, _p, _i64]),
    "kvbaton_decode_burst": (_i, [_p, _p, _p, _i64, _p, _p, _p, _i64, _i64, _i64, _p, _p, _p, _p, _p, _i64]),
    "kvbaton_argmax_rows": (None, [_p, _i64, _i64, _p, _i]),
    "kvbaton_decode_layers_workspace": (_i64, [_p, _i64, _i64]),
}

CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
# NOTE: linked without -ffast-math: with it, GCC (12 and older) links crtfastmath.o into the library, whose
# constructor turns on flush-to-zero / denormals-are-zero for the whole process as soon as it is loaded:
# every float parsed there after (a request's top_p of 5e-324 read as 0.0) and torch's own arithmetic.
LDFLAGS = ("-fopenmp", "-shared")
# Per-source flags, after CFLAGS (so they override): the batch-invariant kernels must not let the compiler
# reorder their sums (see linear_dot.c), and the argmax must see NaNs.
SOURCE_FLAGS = {"linear_dot.c": ("-fno-fast-math",), "gemm_amx.c": ("-fno-fast-math",),
                "argmax_rows.c": ("-fno-fast-math",)}


def _cpu_fingerprint() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in info.splitlines() if ln.startswith(("flags", "Features"))), "")
        model = next((ln for ln in info.splitlines() if ln.startswith("model name")), "")
        return model + flags
    except OSError:
        return platform.processor()


def _build(out: Path, compiler: str) -> None:
    srcs = [str(Path(__file__).with_name(s)) for s in SOURCES]
    out.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: build into a temp file and rename, so concurrent first uses never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as objdir:
            objs = [str(Path(objdir) / f"{Path(src).stem}.o") for src in srcs]
            for src, obj in zip(srcs, objs):
                extra = SOURCE_FLAGS.get(Path(src).name, ())
                subprocess.run([compiler, *CFLAGS, *extra, "-c", "-o", obj, src], check=True, capture_output=True,
                               text=True)
            subprocess.run([compiler, *LDFLAGS, "-o", tmp, *objs, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def sources_digest() -> str:
    """The kernels' version: a digest of their sources and flags (what packed layouts kept on disk are keyed by)."""
    digest = hashlib.sha256()
    for s in (*SOURCES, *HEADERS):
        digest.update(Path(__file__).with_name(s).read_bytes())
    flags = (*CFLAGS, *LDFLAGS, repr(sorted(SOURCE_FLAGS.items())))
    digest.update(" ".join(flags).encode())
    return digest.hexdigest()[:16]


@functools.cache
def cpu_kernels() -> ctypes.CDLL | None:
    if os.environ.get("KVBATON_KERNELS", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: using the PyTorch attention path (slower on CPU)")
        return None
    digest = hashlib.sha256(sources_digest().encode())
    digest.update(compiler.encode() + _cpu_fingerprint().encode())
    out = kernels_dir() / f"libkvbaton_cpu-{digest.hexdigest()[:16]}.so"
    try:
        if not out.exists():
            _build(out, compiler)
        lib = ctypes.CDLL(str(out))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building the CPU kernels failed, using the PyTorch path: %s", detail)
        return None
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
