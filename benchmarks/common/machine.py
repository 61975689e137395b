"""The machine and the model as the figures depend on them: CPU, versions, read bandwidth,
and the batch-1 decode roofline that bandwidth implies."""

from __future__ import annotations

import json
import os
import platform
import struct
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from common.records import Bandwidth, Environment, ModelFacts, Roofline

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "SmolLM2-135M-Instruct"  # kvbaton's default model, which every benchmark serves
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


def cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.processor())


def cpu_kind() -> str:
    """A short tag for the CPU kinds whose figures differ (vendor and widest bf16 path), e.g. "intel-amx",
    "amd-avx512bf16", "amd-avx2": results measured on one kind are kept beside, not over, another's."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    vendor = "intel" if "GenuineIntel" in text else "amd" if "AuthenticAMD" in text else platform.machine()
    path = next((name for flag, name in (("amx_tile", "amx"), ("avx512_bf16", "avx512bf16"), ("avx2", "avx2"))
                 if flag in flags), "generic")
    return f"{vendor}-{path}"


def kvbaton_commit() -> str:
    """HEAD's short hash, "+dirty" when kvbaton/ has uncommitted changes (the figures are then
    of code no commit holds)."""

    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "kvbaton")
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")


def environment(*, with_transformers: bool = False, peers: dict[str, str] | None = None) -> Environment:
    import torch

    transformers_version = None
    if with_transformers:
        import transformers

        transformers_version = transformers.__version__
    from kvbaton.platform.cpu import detect_cpu

    return Environment(cpu=cpu_name(), cpus=os.cpu_count(), torch=torch.__version__,
                       torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                       cpu_features=detect_cpu().summary(),
                       transformers=transformers_version, python=platform.python_version(),
                       kvbaton_commit=kvbaton_commit(), peers=peers)


def _best_time(fn: Callable[[], object], reps: int = 7) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_bandwidth(tensor_mb: int, threads: int) -> Bandwidth:
    """Read and copy bandwidth of large fp32 tensors, and what a decode-style matvec achieves."""
    import torch

    torch.set_num_threads(threads)
    n = tensor_mb * 2**20 // 4
    x = torch.ones(n)
    y = torch.empty_like(x)
    y.copy_(x)  # fault both in
    nbytes = n * 4
    matvec = {}
    # The LM head's shape [vocab, hidden] @ one token: the largest matrix a decode step reads.
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        w = torch.randn(49152, 576).to(dtype)
        v = torch.randn(1, 576).to(dtype)
        with torch.inference_mode():
            torch.nn.functional.linear(v, w)
            t = _best_time(partial(torch.nn.functional.linear, v, w), reps=20)
        matvec[name] = w.numel() * w.element_size() / t / 1e9
    return Bandwidth(tensor_mb=tensor_mb, threads=torch.get_num_threads(),
                     read_gb_s=nbytes / _best_time(lambda: x.sum()) / 1e9,
                     copy_gb_s=2 * nbytes / _best_time(lambda: y.copy_(x)) / 1e9,
                     matvec_float32_gb_s=matvec["float32"], matvec_bfloat16_gb_s=matvec["bfloat16"])


def read_gb_s_now(x: Any, reps: int = 5) -> float:
    """The read bandwidth at this moment: GB/s of `x.sum()` at its best of `reps` (x: a large torch tensor made
    once, faulted in), as measure_bandwidth's read figure but in ~0.3 s, to pair with a run measured next to it."""
    return x.numel() * x.element_size() / _best_time(x.sum, reps) / 1e9


def model_facts(model_dir: str) -> ModelFacts:
    """Parameter count from the safetensors headers (no weights loaded) and the KV shape."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    numel = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                k = 1
                for d in meta["shape"]:
                    k *= d
                numel += k
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return ModelFacts(params=numel, vocab_size=cfg["vocab_size"], layers=cfg["num_hidden_layers"],
                      kv_heads=cfg["num_key_value_heads"], head_dim=head_dim,
                      tie_word_embeddings=cfg.get("tie_word_embeddings", False))


def roofline(facts: ModelFacts, dtype: str, prompt_len: int, out_len: int, read_gb_s: float) -> Roofline:
    """Bytes one batch-1 decode step must read: every weight once (a tied embedding is read once,
    as the LM head; the embedding lookup is one row) plus the K and V of the context so far,
    taken at the mean decode context `prompt_len + out_len / 2`."""
    elem = DTYPE_BYTES[dtype]
    weight_bytes = facts.params * elem
    kv_per_token = 2 * facts.layers * facts.kv_heads * facts.head_dim * elem
    context = prompt_len + out_len / 2
    step_bytes = weight_bytes + kv_per_token * context
    return Roofline(weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token, mean_context=context,
                    bytes_per_step=step_bytes, read_gb_s=read_gb_s,
                    roofline_ms_per_tok=1e3 * step_bytes / (read_gb_s * 1e9))
