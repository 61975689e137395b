"""`kvbaton kv save` / `kvbaton kv restore` against real servers: a conversation's KV saved from one server is
restored into a fresh one (same cluster secret), whose next turn then loads it instead of computing it, with
output token-identical to transformers (float32); a damaged file is refused with a one-line error."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import httpx
import pytest

from kvbaton.text.tokenizer import Tokenizer
from tests.support.helpers import hf_greedy
from tests.support.server import kvbaton_server

pytestmark = pytest.mark.slow

SERVER = ("--dtype", "float32", "--max-model-len", "1024", "--kv-store", "shm")
MAX_NEW = 8
BLOCK = 16
HISTORY = [{"role": "user", "content": "Tell me about the history of paper making, in a few sentences."},
           {"role": "assistant", "content": "Paper was first made in China around the second century, from "
                                            "mulberry bark, hemp and rags pressed into thin sheets and dried. "
                                            "The craft spread along the Silk Road to Samarkand and Baghdad, and "
                                            "reached Europe through Spain in the twelfth century."}]
NEXT_TURN = [*HISTORY, {"role": "user", "content": "And who improved it in Europe?"}]


def kv_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbaton.cli", "kv", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_a_saved_session_is_restored_into_a_fresh_server(default_model_dir, tmp_path):
    env = {**os.environ, "KVBATON_CLUSTER_SECRET": "kv-session-test-secret-0123456789"}
    tokenizer = Tokenizer(default_model_dir)
    history_ids = tokenizer.encode(tokenizer.apply_chat_template(HISTORY, add_generation_prompt=False))
    next_ids = tokenizer.encode(tokenizer.apply_chat_template(NEXT_TURN, add_generation_prompt=True))
    assert next_ids[:len(history_ids)] == history_ids  # the next turn's prompt starts with the saved one
    saved_tokens = len(history_ids) // BLOCK * BLOCK
    ref = hf_greedy(default_model_dir, [next_ids], MAX_NEW)[0]
    messages, session = tmp_path / "chat.json", tmp_path / "chat.kvs"
    messages.write_text(json.dumps(HISTORY))

    with kvbaton_server(*SERVER, env=env) as (base, _):
        saved = kv_cli("save", "--url", base, "--messages", str(messages), "-o", str(session), env=env)
        assert saved.returncode == 0, saved.stderr
        assert f"saved {saved_tokens} tokens of KV" in saved.stdout
        assert stat.S_IMODE(session.stat().st_mode) == 0o600  # a prompt's KV gives the prompt away

    # a fresh server: its pool and its arena are empty
    with kvbaton_server(*SERVER, "--max-kv-session-bytes", str(8 * 2**20), env=env) as (base, _):
        assert_bad_input_is_refused(base)
        damaged = bytearray(session.read_bytes())
        damaged[len(damaged) // 2] ^= 0xFF
        (tmp_path / "damaged.kvs").write_bytes(bytes(damaged))
        refused = kv_cli("restore", "--url", base, str(tmp_path / "damaged.kvs"), env=env)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1
        assert "400: the session file's signature does not verify" in refused.stderr

        restored = kv_cli("restore", "--url", base, str(session), env=env)
        assert restored.returncode == 0, restored.stderr
        assert f"restored {saved_tokens} tokens of KV" in restored.stdout
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": NEXT_TURN, "max_tokens": MAX_NEW,
                                                             "temperature": 0, "ignore_eos": True}, timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["prompt_tokens"] == len(next_ids)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == saved_tokens  # loaded, not computed
        assert out["choices"][0]["message"]["content"] == tokenizer.decode(ref)
        assert httpx.get(f"{base}/stats").json()["kv_store_hit_tokens"] == saved_tokens


def assert_bad_input_is_refused(base: str) -> None:
    """Malformed saves and restores: a JSON error with the right status, and the server goes on serving."""
    def post(path: str, **kwargs) -> httpx.Response:
        return httpx.post(f"{base}{path}", timeout=60, **kwargs)

    cases = [
        (post("/admin/kv/restore", content=b"not a session"), 400, "too short"),
        (post("/admin/kv/restore", content=b"\0" * 4096), 400, "not a kvbaton KV session file"),
        (post("/admin/kv/restore", content=b"x" * (9 * 2**20)), 413, "--max-kv-session-bytes"),
        (post("/admin/kv/save", json={"prompt": "hi", "messages": HISTORY}), 400, "exactly one of prompt and messages"),
        (post("/admin/kv/save", json={}), 400, "exactly one of prompt and messages"),
        (post("/admin/kv/save", json={"prompt": [1, 2, 3]}), 400, "fewer than one full block"),
        (post("/admin/kv/save", json={"prompt": [10**9] * 20}), 400, "prompt"),
        (post("/admin/kv/save", content=b"{not json", headers={"Content-Type": "application/json"}), 400, ""),
    ]
    for response, status, message in cases:
        assert response.status_code == status, response.text
        assert message in response.json()["error"]["message"]
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
