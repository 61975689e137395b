"""`kvbaton bench serve` against a real server process on the real default model.

Backends: `kvbaton serve` (once kvbaton/server exists) and vLLM's CPU server (when the peer
venv /work/peers/venv-vllm, or $KVBATON_VLLM_PYTHON, provides it). Each is started on a free
127.0.0.1 port, polled at GET /health with a bounded wait, and stopped by its PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvbaton.bench.cli import run
from tests.support.procs import REPO_ROOT
from tests.support.server import free_port
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow

# NOTE: the vLLM run is opt-in (it takes minutes to start): set KVBATON_VLLM_PYTHON to its venv's python.
VLLM_PYTHON = Path(os.environ.get("KVBATON_VLLM_PYTHON", "/nonexistent/vllm-python"))
STARTUP_TIMEOUT_S = {"kvbaton": 600, "vllm": 1200}  # vLLM on a small CPU box compiles for minutes


def _server_command(backend: str, model_dir: Path, port: int) -> list[str]:
    if backend == "kvbaton":
        return [sys.executable, "-m", "kvbaton.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--served-model-name", "smol"]


def _skip_reason(backend: str) -> str | None:
    if backend == "vllm" and not VLLM_PYTHON.is_file():
        return "vLLM peer test is opt-in: set KVBATON_VLLM_PYTHON (e.g. /work/peers/venv-vllm/bin/python)"
    return None


def _wait_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float, log: Path) -> None:
    def healthy() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{base_url}/health", timeout=2.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout_s, interval_s=1.0, message=lambda: f"server not healthy:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    # The server runs in its own session, so its group id is its PID: this reaches its
    # engine subprocesses and nothing else.
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module", params=["kvbaton", "vllm"])
def server(request, default_model_dir: Path, tmp_path_factory) -> Iterator[str]:
    backend = request.param
    if (reason := _skip_reason(backend)) is not None:
        pytest.skip(reason)
    port = free_port()
    log = tmp_path_factory.mktemp(backend) / "server.log"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(_server_command(backend, default_model_dir, port), stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, base_url, STARTUP_TIMEOUT_S[backend], log)
        yield base_url
    finally:
        _stop(proc)


def _bench(base_url: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "result.json"
    argv = ["serve", "--base-url", base_url, "--output-len", "8", "--ignore-eos", "--no-progress",
            "--request-rate", "4", "--seed", "0", "--result-json", str(out), *extra]
    assert run(argv) == 0
    return json.loads(out.read_text())


def _check_records(doc: dict, num_prompts: int) -> None:
    (only_run,) = doc["runs"]
    assert only_run["summary"]["completed"] == num_prompts
    for rec in only_run["records"]:
        assert rec["status"] == "ok" and rec["output_tokens"] == 8  # ignore_eos: exactly max_tokens
        assert rec["prompt_len"] > 0 and 0 < rec["ttft_s"] <= rec["e2e_s"]
        assert len(rec["itl_s"]) >= 1


def test_random_completions_with_the_models_tokenizer(server, default_model_dir, tmp_path):
    doc = _bench(server, tmp_path, "--num-prompts", "6", "--input-len", "32", "--tokenizer", str(default_model_dir),
                 "--slo-ttft-ms", "600000", "--slo-tpot-ms", "60000")
    _check_records(doc, 6)
    summary = doc["runs"][0]["summary"]
    assert summary["slo_attainment"] == 1.0 and summary["goodput"] > 0
    for rec in doc["runs"][0]["records"]:
        assert abs(rec["prompt_len"] - 32) <= 2  # the server's own count of our random-token prompt


def test_shared_prefix_chat(server, tmp_path):
    doc = _bench(server, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset", "shared-prefix",
                 "--num-prompts", "4", "--num-prefixes", "2", "--prefix-len", "64", "--input-len", "8")
    _check_records(doc, 4)
