"""What a worker reads of the tokenizer without transformers (its start does not import it): the EOS id and
the tokenizer.json text the grammar engine takes, each equal to what transformers' tokenizer gives."""

from __future__ import annotations

import json
import shutil

from kvbaton.text.tokenizer import Tokenizer, tokenizer_eos_token_id, tokenizer_json


def test_the_eos_id_is_read_as_transformers_reads_it(default_model_dir, tmp_path):
    assert tokenizer_eos_token_id(default_model_dir) == Tokenizer(default_model_dir).eos_token_id == 2
    model = tmp_path / "m"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, model / name)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|endoftext|>"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_eos_token_id(model) == Tokenizer(model).eos_token_id == 0


def test_the_grammar_engines_tokenizer_is_the_one_transformers_serialises(default_model_dir):
    theirs = json.loads(Tokenizer(default_model_dir).backend.to_str())
    assert json.loads(tokenizer_json(default_model_dir)) == theirs
