"""Qwen2-VL and Qwen2.5-VL through kvbaton's engine: an image is one run of placeholders as long as its size asks
(dynamic resolution), and its placeholders take (t, row, column) positions rotated by sections of the head's
frequencies (multimodal RoPE), the text after it behind its index. The frontend lays the placeholders out from the
image's size as transformers' processor does, and greedy fp32 output is token-identical to transformers' on tiny
random checkpoints of both: images of different sizes, several in a prompt, an image first, text-only prompts in
the same batch, chunked prefill through an image, decode steps past the prompt, and prefix caching that shares KV
for the same image only."""

from __future__ import annotations

import random

import pytest
from PIL import Image

from kvbaton import LLM, SamplingParams
from kvbaton.config import ModelConfig
from kvbaton.mm.placeholders import Placeholders
from kvbaton.text.tokenizer import Tokenizer
from tests.support.helpers import build_tiny_qwen2_vl, hf_qwen2_vl_greedy, qwen2_vl_prompt_ids

MAX_NEW = 12


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3)))


def chat(*parts: str | Image.Image) -> tuple[list[dict], list[Image.Image]]:
    content = [{"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}], [p for p in parts if isinstance(p, Image.Image)]


CHATS = [
    chat("Look at this:", picture(1, (90, 50)), "What is it?"),  # 2 x 3 merged patches
    chat(picture(2, (40, 120)), "Describe it."),  # an image first, 4 x 1
    chat("Two of them:", picture(3, (120, 120)), "and", picture(4, (60, 30)), "compare."),  # 4 x 4, then 1 x 2
    chat("No picture here, only words about pictures."),  # text only, in the same batch
    chat("Look at this:", picture(5, (90, 50)), "What is it?"),  # the first chat with another image
]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen2_vl(request, tmp_path_factory, default_model_dir):
    model = build_tiny_qwen2_vl(tmp_path_factory.mktemp(request.param), default_model_dir, family=request.param)
    prompts = [(qwen2_vl_prompt_ids(model, messages, images), images) for messages, images in CHATS]
    return model, prompts, hf_qwen2_vl_greedy(model, prompts, MAX_NEW)


def generate(llm: LLM, prompts) -> list[list[int]]:
    inputs = [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else
              {"prompt_token_ids": ids} for ids, images in prompts]
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_frontend_lays_out_the_processors_placeholders(qwen2_vl):
    model, prompts, _ = qwen2_vl
    vision = ModelConfig.from_dir(model).vision
    assert vision is not None and vision.resolution is not None and vision.mrope_section == (2, 3, 3)
    tokenizer = Tokenizer(model)
    placeholders = Placeholders(vision, lambda text: tokenizer.encode(text, add_special_tokens=False))
    for (messages, images), (expected, _) in zip(CHATS, prompts):
        rendered = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        assert placeholders.expand(rendered, [im.size for im in images]) == expected


def test_a_mixed_batch_matches_transformers(qwen2_vl):
    model, prompts, refs = qwen2_vl
    assert refs[0] != refs[4], "the image does not change the tiny model's output: the test would not see it"
    assert generate(LLM(str(model), dtype="float32"), prompts) == refs


def test_chunked_prefill_through_an_image_matches(qwen2_vl):
    model, prompts, refs = qwen2_vl
    assert generate(LLM(str(model), dtype="float32", max_num_batched_tokens=7, block_size=4), prompts) == refs


def test_the_same_image_shares_kv_blocks_and_another_never_does(qwen2_vl):
    model, prompts, refs = qwen2_vl
    llm = LLM(str(model), dtype="float32", block_size=4)
    assert generate(llm, prompts[:1]) == refs[:1]
    hits = llm.engine.kv_cache.prefix_cache_stats().hit_tokens
    assert generate(llm, prompts[:1]) == refs[:1]
    again = llm.engine.kv_cache.prefix_cache_stats().hit_tokens - hits
    assert again >= len(prompts[0][0]) - 4, again
    assert generate(llm, prompts[4:]) == refs[4:]
    first_image = prompts[0][0].index(ModelConfig.from_dir(model).vision.image_token_id)
    assert llm.engine.kv_cache.prefix_cache_stats().hit_tokens - hits - again <= first_image
