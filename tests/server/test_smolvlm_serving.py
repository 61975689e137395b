"""SmolVLM / Idefics3 served E/P/D (`kvbaton serve --encode 1 --prefill 1 --decode 1`, the KV over shm): chats with
images of different tile grids, several in a chat, an image first, answer transformers' fp32 greedy tokens; their
prompts are the processor's token for token (`usage` and `/tokenize` count each image's tiles, tags and global
image); the encoder worker encodes every image and the language workers none.

LLaVA's deployment (the KV over tcp) and the image faults are in `test_vision_serving.py`; SmolVLM encoded where
the prompt is computed, in `tests/mm/test_idefics3_parity.py`."""

from __future__ import annotations

import base64
import io
import random

import httpx
import pytest
from PIL import Image

from tests.support.helpers import build_tiny_idefics3, hf_idefics3_greedy
from tests.support.server import served, stats, wait_idle

MAX_NEW = 6


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3)))


def data_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}"


@pytest.fixture(scope="module")
def smolvlm_server(tmp_path_factory, default_model_dir):
    model = build_tiny_idefics3(tmp_path_factory.mktemp("smolvlm"), default_model_dir)
    # NOTE: every chat here is longer than 8 tokens: all go through the prefill worker
    with served("--model", str(model), "--dtype", "float32", "--max-model-len", "1024", "--encode", "1",
                "--prefill", "1", "--decode", "1", "--kv-transport", "shm", "--local-prefill-threshold", "8") as server:
        yield model, server


def test_tiled_image_chats_answer_transformers_tokens_through_the_encoder_worker(smolvlm_server):
    from transformers import AutoProcessor

    model, server = smolvlm_server
    chats = [["Look at this:", picture(1, (70, 50)), "What is it?"],  # 3 x 3 tiles and the global image
             [picture(2, (30, 90)), "Describe it."],  # an image first: 3 x 1
             ["Two of them:", picture(3, (96, 20)), "and", picture(4, (50, 70)), "compare."]]  # 1 x 3, 3 x 3
    processor = AutoProcessor.from_pretrained(str(model))
    prompts = []
    for parts in chats:
        images = [p for p in parts if isinstance(p, Image.Image)]
        messages = [{"role": "user", "content": [{"type": "image"} if isinstance(p, Image.Image) else
                                                 {"type": "text", "text": p} for p in parts]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append((processor(text=[text], images=[images])["input_ids"][0], images))
    refs = hf_idefics3_greedy(model, prompts, MAX_NEW)
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
        assert body["usage"]["prompt_tokens"] == len(ids)  # every tile's placeholders and tags counted
        tokenized = httpx.post(f"{server.base}/tokenize", json={"messages": messages})
        assert tokenized.json()["tokens"] == list(ids), tokenized.text  # the processor's ids
    # a tile grid depends on the image's size: /tokenize decodes the images, in the generation requests' bounds
    broken = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]}]
    refused = httpx.post(f"{server.base}/tokenize", json={"messages": broken})
    assert refused.status_code == 400 and "image 0" in refused.json()["error"]["message"], refused.text
    workers = {w["name"]: w for w in httpx.get(f"{server.base}/workers").json()["workers"]}
    assert workers["kvbaton-encode-0"]["encode"]["encoded"] == 4, workers["kvbaton-encode-0"]
    assert stats(server.base)["router"]["disaggregated"] >= 3  # the chats' KV came from the prefill worker
    wait_idle(server.base)
