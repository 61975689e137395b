"""`kvbaton serve --prefill 1 --decode 1` on the real default model: the OpenAI API behaves as
in colocated mode, output equals transformers' greedy output, `GET /workers` shows the
topology, and `kvbaton workers` adds and drains workers at run time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.helpers import hf_greedy
from tests.support.server import kvbaton_server

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow and say why the sky is blue."]
MAX_NEW = 20


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbaton.cli", "workers", *args], capture_output=True, text=True,
                          timeout=700)


def test_pd_serving_end_to_end(default_model_dir):
    from kvbaton.text.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    refs = hf_greedy(default_model_dir, prompts, MAX_NEW, eos_token_id=2)
    with kvbaton_server("--dtype", "float32", "--max-model-len", "1024", "--prefill", "1", "--decode", "1",
                        "--local-prefill-threshold", "0", "--kv-transport", "tcp") as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        for prompt, ref in zip(prompts, refs):
            whole = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_NEW,
                                              temperature=0)
            stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_NEW,
                                               temperature=0, stream=True)
            streamed = "".join(c.choices[0].text for c in stream)
            assert whole.choices[0].text == streamed == tok.decode(ref)
            assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == len(ref)

        workers = httpx.get(f"{base}/workers").json()["workers"]
        assert {(w["name"], w["role"]) for w in workers} == {("kvbaton-prefill-0", "prefill"),
                                                             ("kvbaton-decode-0", "decode")}
        for w in workers:
            assert w["healthy"] and Path(f"/proc/{w['pid']}/cmdline").read_bytes().startswith(w["name"].encode())

        added = _cli("add", "decode", "--url", base)
        assert added.returncode == 0, added.stderr
        assert "kvbaton-decode-1" in added.stdout
        drained = _cli("drain", "kvbaton-decode-0", "--url", base)
        assert drained.returncode == 0, drained.stderr
        refused = _cli("drain", "kvbaton-nope-7", "--url", base)
        assert refused.returncode == 2 and "no live worker" in refused.stderr
        listing = ""
        for _ in range(100):  # the drained worker leaves once idle (bounded)
            listing = _cli("list", "--url", base).stdout
            if "kvbaton-decode-0" not in listing:
                break
        assert "kvbaton-decode-1" in listing and "kvbaton-decode-0" not in listing
        again = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompts[0], max_tokens=MAX_NEW,
                                          temperature=0)
        assert again.choices[0].text == tok.decode(refs[0])
