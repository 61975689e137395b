"""`kvbaton serve --prefill 1 --decode 1 --kv-transport redis` with no --redis-url starts its own
loopback redis-server (password-protected, not on any command line) and stops it on exit."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx

from tests.support.helpers import hf_greedy
from tests.support.procs import pid_alive
from tests.support.server import kvbaton_server


def _redis_pids() -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "comm").read_text().strip() == "redis-server":
                    pids.add(int(proc.name))
            except OSError:
                pass
    return pids


def test_serve_starts_and_stops_its_own_redis(tiny_models):
    assert shutil.which("redis-server"), "redis-server is not installed (scripts/setup.sh installs it with apt-get)"
    model = tiny_models["llama"]
    prompt = list(range(5, 45))
    before = _redis_pids()
    with kvbaton_server("--model", str(model), "--dtype", "float32", "--prefill", "1", "--decode", "1",
                        "--kv-transport", "redis", "--local-prefill-threshold", "0", "--block-size", "4") as (base, _):
        started = _redis_pids() - before
        assert len(started) == 1
        (pid,) = started
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"requirepass" not in cmdline and b"redis://" not in cmdline
        body = {"model": Path(model).name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        out = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 12
        from kvbaton.text.tokenizer import Tokenizer

        assert out["choices"][0]["text"] == Tokenizer(model).decode(hf_greedy(model, [prompt], 12)[0])
        for env_file in Path("/proc").glob("[0-9]*/environ"):  # the password is in no worker's argv
            if env_file.parent.name.isdigit() and int(env_file.parent.name) != os.getpid():
                try:
                    assert b"redis://:" not in (env_file.parent / "cmdline").read_bytes()
                except OSError:
                    pass
    assert not pid_alive(pid), "the redis-server started by kvbaton serve outlived it"
