"""`kvbaton` CLI as a user runs it: a real subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _kvbaton(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbaton.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_generate_streams_text_for_default_model(default_model_dir):
    result = _kvbaton("generate", "--prompt", "What is the capital of France?", "--max-tokens", "12",
                      "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tokens, TTFT" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model"], "model not found"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--max-tokens", "0"], "max_tokens must be >= 1"),
])
def test_bad_input_is_one_line_error(args, message):
    result = _kvbaton("generate", *args, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("kvbaton: error:")


def test_missing_weights_dir_is_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    result = _kvbaton("generate", "--model", str(tmp_path), timeout=120)
    assert result.returncode == 2 and "kvbaton: error:" in result.stderr
