"""The checkpoint's recommended sampling settings (HF `generation_config.json`), as request defaults.

`--generation-config` takes vLLM's values: `auto` reads the model directory's file, `vllm` ignores it,
and anything else names a directory holding generation_config.json, or the file itself. A request's
own fields always win; these only fill what it leaves unset.

NOTE: this lives in the engine layer, not in models, because it validates against the bounds in
`sampling_params` (a lower layer may not import the engine); like that module it imports no torch, so
the HTTP process may load it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvbaton.config import ConfigError
from kvbaton.sched.sampling_params import (
    INT32_MAX,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
)

FILE_NAME = "generation_config.json"
AUTO, VLLM = "auto", "vllm"


@dataclass(frozen=True, kw_only=True)
class GenerationDefaults:
    """Defaults for the sampling fields a request leaves unset; None: the field has no default here."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the file's `max_new_tokens`
    eos_token_ids: tuple[int, ...] = ()
    source: str = "none"  # the file these came from, or "none"

    def overrides(self) -> dict[str, float | int]:
        """The set fields, keyed by SamplingParams field names."""
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
        return {name: value for name in names if (value := getattr(self, name)) is not None}

    def describe(self) -> str:
        """One line for the startup log: which defaults apply, and from where."""
        if not self.overrides():
            return "default sampling parameters: kvbaton's own (no generation config sets any)"
        values = ", ".join(f"{k}={v}" for k, v in self.overrides().items())
        return f"default sampling parameters overridden by the model's generation config ({self.source}): {values}"


def load_generation_defaults(model_dir: Path, setting: str) -> GenerationDefaults:
    """Resolve `--generation-config` (auto | vllm | PATH) against `model_dir`; ConfigError if unusable."""
    if setting == VLLM:
        return GenerationDefaults()
    if setting == AUTO:
        path = Path(model_dir) / FILE_NAME
        return parse_generation_config(path) if path.is_file() else GenerationDefaults()
    path = Path(setting).expanduser()
    path = path / FILE_NAME if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"--generation-config {setting}: no {FILE_NAME} there (expected auto, vllm, "
                          f"a directory holding {FILE_NAME}, or the file)")
    return parse_generation_config(path)


def generation_eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids of the model directory's generation_config.json, () without one.

    NOTE: read whatever `--generation-config` says, as vLLM does: which tokens end a turn is a
    property of the checkpoint, not a sampling preference.
    """
    path = Path(model_dir) / FILE_NAME
    if not path.is_file():
        return ()
    try:  # only the EOS field: with `vllm`, a sampling value kvbaton refuses must not stop the engine
        return _eos_ids(_read_json(path).get("eos_token_id"))
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def parse_generation_config(path: Path) -> GenerationDefaults:
    raw = _read_json(path)
    try:
        return _from_hf_dict(raw, source=str(path))
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable JSON file ({_one_line(exc)})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _from_hf_dict(raw: dict, source: str) -> GenerationDefaults:
    # NOTE: transformers samples only with `do_sample: true`; an explicit false is greedy whatever the
    # temperature says. Absent, we follow the file's temperature (as vLLM does), not transformers' default.
    temperature = _number(raw, "temperature", lambda t: t == 0.0 or t >= MIN_TEMPERATURE,
                          f"0 (greedy) or >= {MIN_TEMPERATURE}")
    if raw.get("do_sample") is False:
        temperature = 0.0
    return GenerationDefaults(
        temperature=temperature,
        top_p=_number(raw, "top_p", lambda p: MIN_TOP_P <= p <= 1.0, f"in [{MIN_TOP_P}, 1]"),
        top_k=_integer(raw, "top_k", -1),  # -1 or 0: disabled
        min_p=_number(raw, "min_p", lambda p: 0.0 <= p <= 1.0, "in [0, 1]"),
        repetition_penalty=_number(raw, "repetition_penalty",
                                   lambda r: MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY,
                                   f"in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]"),
        max_tokens=_integer(raw, "max_new_tokens", 1),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        source=source,
    )


def _number(raw: dict, key: str, ok: Callable[[float], bool], bounds: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    # NOTE: bool is an int to Python, and json.loads accepts NaN and Infinity: neither is a setting.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} must be a number, got {value!r}")
    if not ok(float(value)):
        raise ValueError(f"{key} must be {bounds}, got {value}")
    return float(value)


def _integer(raw: dict, key: str, minimum: int) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= INT32_MAX:
        raise ValueError(f"{key} must be an integer in [{minimum}, {INT32_MAX}], got {value!r}")
    return value


def _eos_ids(value: object) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else ([] if value is None else [value])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(ids)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
