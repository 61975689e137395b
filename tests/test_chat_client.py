"""`kvbaton chat` and `kvbaton complete` as a user runs them: real subprocesses, stdin piped in, against a
real `kvbaton serve` (with an API key, which the clients take from the environment)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.server import free_port, kvbaton_server

MODEL = "SmolLM2-135M-Instruct"
KEY = "s3cret"
SYSTEM = "Answer in one short sentence."
KVBATON_SCRIPT = str(Path(sys.executable).parent / "kvbaton")  # the console script, as installed


@pytest.fixture(scope="module")
def server(default_model_dir) -> str:
    with kvbaton_server("--dtype", "float32", "--max-model-len", "1024", "--api-key", KEY) as (base, _):
        yield base


def _run(cmd: list[str], stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("KVBATON_API_KEY", "OPENAI_API_KEY")}
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, env={**clean, **(env or {})},
                          timeout=180)


def _python_m(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "kvbaton", *args], stdin, env)


def _reference(base: str, path: str, body: dict) -> str:
    """The greedy answer of /v1/chat/completions or /v1/completions, not streamed."""
    r = httpx.post(f"{base}/v1{path}", json={"model": MODEL, "temperature": 0, **body}, timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvbaton: error: "), result.stderr
    assert all(w in lines[0] for w in words), lines[0]


@pytest.mark.slow
def test_chat_streams_the_greedy_answer_and_keeps_the_history(server):
    first, second = "What is the capital of France?", "And of Italy?"
    result = _python_m("chat", "--url", f"{server}/v1", "--system", SYSTEM, "--max-tokens", "16",
                       "--temperature", "0", stdin=f"{first}\n\n{second}\n/quit\nnever sent\n",
                       env={"KVBATON_API_KEY": KEY})
    assert result.returncode == 0 and result.stderr == "", result.stderr  # no prompt nor banner on a pipe
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]
    answer1 = _reference(server, "/chat/completions", {"messages": history, "max_tokens": 16})
    history += [{"role": "assistant", "content": answer1}, {"role": "user", "content": second}]
    answer2 = _reference(server, "/chat/completions", {"messages": history, "max_tokens": 16})
    assert answer1 and answer2 and result.stdout == f"{answer1}\n{answer2}\n"


@pytest.mark.slow
def test_chat_ends_at_end_of_input(server):
    result = _python_m("chat", "--url", f"{server}/v1", "--max-tokens", "4", stdin="Hi\n",
                       env={"OPENAI_API_KEY": KEY})  # the fallback key
    assert result.returncode == 0 and result.stdout.endswith("\n") and result.stdout.strip(), result.stderr


@pytest.mark.slow
def test_complete_one_shot_and_line_by_line(server):
    prompts = ["The three primary colors are", "Once upon a time"]
    whole = [_reference(server, "/completions", {"prompt": p, "max_tokens": 8}) for p in prompts]
    one = _run([KVBATON_SCRIPT, "complete", "--url", f"{server}/v1", "--prompt", prompts[0], "--max-tokens", "8",
                "--temperature", "0"], env={"KVBATON_API_KEY": KEY})
    assert one.returncode == 0 and one.stdout == f"{whole[0]}\n", one.stderr
    lines = _run([KVBATON_SCRIPT, "complete", "--url", f"{server}/v1", "--model", MODEL, "--max-tokens", "8",
                  "--temperature", "0"], stdin="".join(f"{p}\n" for p in prompts), env={"KVBATON_API_KEY": KEY})
    assert lines.returncode == 0 and lines.stdout == "".join(f"{w}\n" for w in whole), lines.stderr  # no history


@pytest.mark.slow
def test_the_clients_run_without_torch(server):
    code = "import sys\nsys.modules['torch'] = None\nfrom kvbaton.cli import main\nsys.exit(main())\n"
    result = _run([sys.executable, "-c", code, "complete", "--url", f"{server}/v1", "--prompt", "Hi",
                   "--max-tokens", "2"], env={"KVBATON_API_KEY": KEY})
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("args, env, words", [
    (["chat"], {}, ("answered 401", "invalid or missing API key")),
    (["chat"], {"KVBATON_API_KEY": "wrong"}, ("answered 401",)),
    (["chat", "--model", "gpt-4"], {"KVBATON_API_KEY": KEY}, ("answered 404", "gpt-4")),
    (["complete", "--prompt", "Hi", "--max-tokens", "0"], {"KVBATON_API_KEY": KEY}, ("answered 400", "max_tokens")),
])
def test_a_server_error_is_one_line_and_exit_2(server, args, env, words):
    _one_line_error(_python_m(*args, "--url", f"{server}/v1", stdin="Hi\n", env=env), *words)


@pytest.mark.parametrize("command", [["chat"], ["complete", "--prompt", "Hi"]])
def test_an_unreachable_server_is_one_line_and_exit_2(command):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    _one_line_error(_python_m(*command, "--url", url, stdin="Hi\n"), "cannot connect to", url)
    _one_line_error(_python_m(*command, "--url", "127.0.0.1:8000", stdin="Hi\n"), "must start with http://")


def test_python_m_kvbaton_is_the_kvbaton_command():
    result = _python_m("--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: kvbaton "), result.stderr
    assert all(cmd in result.stdout for cmd in ("serve", "chat", "complete"))
    chat = _python_m("chat", "--help")
    assert chat.returncode == 0 and "--system" in chat.stdout and "http://127.0.0.1:8000/v1" in chat.stdout
