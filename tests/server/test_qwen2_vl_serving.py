"""Qwen2-VL served E/P/D (`kvbaton serve --encode 1 --prefill 1 --decode 1`, the KV over tcp): chats with images of
different sizes (runs of placeholders as long as each size asks) answer transformers' fp32 greedy tokens. The
prefill worker places the images' multimodal RoPE positions from the sizes the encoder worker sent with their
embeddings, and the decode worker goes on from where the prompt's positions ended (behind the token index), for
tokens well past the prompt; `usage` and `/tokenize` count each image's placeholders as the processor lays them out.

Qwen2-VL encoded where the prompt is computed, and its positions through chunked prefill and the prefix cache, in
`tests/mm/test_qwen2_vl_parity.py`."""

from __future__ import annotations

import base64
import io
import random

import httpx
import pytest
from PIL import Image

from tests.support.helpers import build_tiny_qwen2_vl, hf_qwen2_vl_greedy, qwen2_vl_prompt_ids
from tests.support.server import served, stats, wait_idle

MAX_NEW = 10


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3)))


def data_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}"


@pytest.fixture(scope="module")
def qwen2_vl_server(tmp_path_factory, default_model_dir):
    model = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2vl"), default_model_dir)
    # NOTE: every chat here is longer than 8 tokens: all go through the prefill worker
    with served("--model", str(model), "--dtype", "float32", "--max-model-len", "1024", "--encode", "1",
                "--prefill", "1", "--decode", "1", "--kv-transport", "tcp", "--local-prefill-threshold", "8") as server:
        yield model, server


def test_image_chats_answer_transformers_tokens_through_the_encoder_and_prefill_workers(qwen2_vl_server):
    model, server = qwen2_vl_server
    chats = [["Look at this:", picture(1, (90, 50)), "What is it?"],  # 2 x 3 merged patches
             [picture(2, (40, 120)), "Describe it."],  # an image first: 4 x 1
             ["Two of them:", picture(3, (120, 120)), "and", picture(4, (60, 30)), "compare."]]  # 4 x 4, 1 x 2
    prompts = []
    for parts in chats:
        images = [p for p in parts if isinstance(p, Image.Image)]
        messages = [{"role": "user", "content": [{"type": "image"} if isinstance(p, Image.Image) else
                                                 {"type": "text", "text": p} for p in parts]}]
        prompts.append((qwen2_vl_prompt_ids(model, messages, images), images))
    refs = hf_qwen2_vl_greedy(model, prompts, MAX_NEW)
    for parts, (ids, _), ref in zip(chats, prompts, refs):
        content = [{"type": "image_url", "image_url": {"url": data_url(p)}} if isinstance(p, Image.Image) else
                   {"type": "text", "text": p} for p in parts]
        messages = [{"role": "user", "content": content}]
        resp = httpx.post(f"{server.base}/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "logprobs": True})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        answered = [entry["token"] for entry in body["choices"][0]["logprobs"]["content"]]
        expected = [httpx.post(f"{server.base}/detokenize", json={"tokens": [t]}).json()["prompt"] for t in ref]
        assert answered == expected, parts
        assert body["usage"]["prompt_tokens"] == len(ids)
        tokenized = httpx.post(f"{server.base}/tokenize", json={"messages": messages})
        assert tokenized.json()["tokens"] == list(ids), tokenized.text
    # an image the processor refuses (its sides 300x apart): a 400 naming why, before any worker
    thin = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture(5, (600, 2)))}}]}]
    refused = httpx.post(f"{server.base}/v1/chat/completions", json={"messages": thin, "max_tokens": 2})
    assert refused.status_code == 400 and "differ by 200x" in refused.json()["error"]["message"], refused.text
    workers = {w["name"]: w for w in httpx.get(f"{server.base}/workers").json()["workers"]}
    assert workers["kvbaton-encode-0"]["encode"]["encoded"] == 4, workers["kvbaton-encode-0"]
    assert stats(server.base)["router"]["disaggregated"] >= 3  # the chats' KV came from the prefill worker
    wait_idle(server.base)
