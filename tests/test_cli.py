"""`kvbaton` CLI as a user runs it: a real subprocess."""

from __future__ import annotations

import socket
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
    (["--temperature", "-1"], "temperature must be 0 (greedy) or >= 0.01"),
    (["--top-p", "1.5"], "top_p must be in [1e-08, 1]"),
    (["--max-tokens", "0"], "max_tokens must be in [1, "),
    (["--deterministic", "--compile"], "leave --compile off"),
    (["--deterministic", "--compute-path", "torch"], "--deterministic needs kvbaton's C kernels"),
    (["--generation-config", "/nonexistent"], "--generation-config /nonexistent: no generation_config.json"),
])
def test_bad_input_is_one_line_error(args, message):
    result = _kvbaton("generate", *args, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("kvbaton: error:")


def test_serve_with_a_missing_generation_config_fails_before_any_worker(default_model_dir):
    result = _kvbaton("serve", "--generation-config", "/nonexistent", "--port", "0", timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1
    assert lines[0].startswith("kvbaton: error: --generation-config /nonexistent: no generation_config.json")


def test_serve_on_a_port_in_use_fails_before_any_worker(default_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _kvbaton("serve", "--port", str(port), timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1].startswith(f"kvbaton: error: cannot serve on 127.0.0.1:{port}: ")
    assert "--port" in lines[-1] and "kvbaton-both-0" not in result.stderr  # no worker was started


def test_missing_weights_dir_is_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    result = _kvbaton("generate", "--model", str(tmp_path), timeout=120)
    assert result.returncode == 2 and "kvbaton: error:" in result.stderr


def test_serve_whose_worker_cannot_start_ends_with_one_line(tmp_path, tiny_models):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # a checkpoint without weights
        (tmp_path / name).write_bytes((tiny_models["llama"] / name).read_bytes())
    result = _kvbaton("serve", "--model", str(tmp_path), "--port", "0", timeout=180)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and last == "kvbaton: error: worker(s) kvbaton-both-0 exited during start-up"
    assert "no *.safetensors weights" in result.stderr  # the worker's own message, above
