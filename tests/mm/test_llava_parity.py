"""A vision-language model through kvbaton's engine, its images encoded in the engine's process (`--encode 0`):
greedy fp32 output token-identical to transformers' on a tiny random LLaVA, with one and several images, images at
different positions, text-only prompts in the same batch, chunked prefill cutting through an image, and prefix
caching that shares KV for the same image and never for another."""

from __future__ import annotations

import random

import pytest
from PIL import Image

from kvbaton import LLM, SamplingParams
from kvbaton.sched.sampling_params import InvalidRequestError
from tests.support.helpers import (
    LLAVA_IMAGE_TOKEN,
    LLAVA_TOKENS_PER_IMAGE,
    build_tiny_llava,
    engine_vlm_greedy,
    hf_llava_greedy,
)

MAX_NEW = 8


def picture(seed: int, size: tuple[int, int] = (40, 36)) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3)))


def words(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, LLAVA_IMAGE_TOKEN) for _ in range(n)]


def with_images(*parts: list[int] | Image.Image) -> tuple[list[int], list[Image.Image]]:
    """Token ids with each image's placeholders where it stands, and the images in order."""
    ids: list[int] = []
    images = []
    for part in parts:
        if isinstance(part, Image.Image):
            ids += [LLAVA_IMAGE_TOKEN] * LLAVA_TOKENS_PER_IMAGE
            images.append(part)
        else:
            ids += part
    return ids, images


PROMPTS = [
    with_images(words(1, 5), picture(1), words(2, 7)),  # one image between text
    with_images(picture(2), words(3, 3)),  # an image first
    with_images(words(4, 9), picture(3), words(5, 2), picture(4), words(6, 4)),  # two images
    with_images(words(7, 20)),  # text only, in the same batch
    with_images(words(1, 5), picture(5), words(2, 7)),  # the first prompt with another image
]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    model = build_tiny_llava(tmp_path_factory.mktemp("llava"))
    return model, hf_llava_greedy(model, PROMPTS, MAX_NEW)


def generate(llm: LLM, prompts) -> list[list[int]]:
    return engine_vlm_greedy(llm, prompts, MAX_NEW)


def test_a_mixed_batch_of_image_and_text_prompts_matches_transformers(llava):
    model, refs = llava
    assert refs[0] != refs[4], "the image does not change the tiny model's output: the test would not see it"
    assert generate(LLM(str(model), dtype="float32"), PROMPTS) == refs


def test_chunked_prefill_through_an_image_matches(llava):
    model, refs = llava
    llm = LLM(str(model), dtype="float32", max_num_batched_tokens=7, block_size=4)
    assert generate(llm, PROMPTS) == refs


def test_a_preempted_image_request_computes_its_image_again(llava):
    model, refs = llava
    llm = LLM(str(model), dtype="float32", block_size=4, num_blocks=24)
    assert generate(llm, PROMPTS) == refs
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.core.runner.image_embeddings == {}  # each request's embeddings went with it


def test_the_same_image_shares_kv_blocks_and_another_image_never_does(llava):
    model, refs = llava
    llm = LLM(str(model), dtype="float32", block_size=4)
    assert generate(llm, PROMPTS[:1]) == refs[:1]
    hits = llm.engine.kv_cache.prefix_cache_stats().hit_tokens
    assert generate(llm, PROMPTS[:1]) == refs[:1]  # the same image: its blocks come from the cache
    again = llm.engine.kv_cache.prefix_cache_stats().hit_tokens - hits
    assert again >= 5 + LLAVA_TOKENS_PER_IMAGE, again
    # the same tokens with another image: only the blocks before the image are shared (5 text tokens: 1 block)
    assert generate(llm, PROMPTS[4:]) == refs[4:]
    other = llm.engine.kv_cache.prefix_cache_stats().hit_tokens - hits - again
    assert other <= 4, other


def test_an_image_seen_again_is_not_encoded_again(llava):
    model, refs = llava
    llm = LLM(str(model), dtype="float32", enable_prefix_caching=False)  # the KV of the image is computed again
    assert generate(llm, PROMPTS[:3]) == refs[:3]
    first = llm.engine.stats().encoder_cache
    assert first is not None and (first.hits, first.misses, first.entries) == (0, 4, 4)
    again = [with_images(words(8, 3), picture(1)), PROMPTS[2]]  # known images, other text
    ref = hf_llava_greedy(model, again[:1], MAX_NEW)
    assert generate(llm, again)[:1] == ref
    stats = llm.engine.stats().encoder_cache
    assert (stats.hits, stats.misses, stats.entries) == (3, 4, 4), stats
    assert llm.engine.core.runner.image_embeddings == {}


def test_the_encoder_cache_keeps_unheld_embeddings_within_its_bound(llava):
    model, refs = llava
    one_image = LLAVA_TOKENS_PER_IMAGE * 64 * 4  # 25 embeddings of 64 float32
    llm = LLM(str(model), dtype="float32", encoder_cache_mb=1.5 * one_image / 2**20)
    assert generate(llm, PROMPTS) == refs  # 5 distinct images
    stats = llm.engine.stats().encoder_cache
    assert stats.entries == 1 and stats.bytes == one_image and stats.evictions == 4, stats


def test_placeholders_that_do_not_fit_the_images_are_refused(llava):
    model, _ = llava
    llm = LLM(str(model), dtype="float32")
    ids, images = PROMPTS[0]
    for prompt, why in (({"prompt_token_ids": ids}, "for 0 image"),  # placeholders without their image
                        ({"prompt_token_ids": ids[:-10] + ids[-7:], "multi_modal_data": {"image": images}},
                         "image tokens"),
                        ({"prompt_token_ids": ids, "multi_modal_data": {"image": images * 2}}, "for 2 image"),
                        ({"prompt_token_ids": ids, "multi_modal_data": {"audio": [b"x"]}}, "images only")):
        with pytest.raises(InvalidRequestError, match=why):
            llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert generate(llm, PROMPTS[:1]) == llava[1][:1]  # nothing of the refused requests stayed behind


def test_the_config_names_the_placeholders_and_refuses_a_text_model_it_lacks(llava):
    import json

    from kvbaton.config import ConfigError, ModelConfig, VisionSpec

    model, _ = llava
    assert ModelConfig.from_dir(model).vision == VisionSpec(encoder="llava", image_token_id=LLAVA_IMAGE_TOKEN,
                                                            tokens_per_image=LLAVA_TOKENS_PER_IMAGE)
    hf = json.loads((model / "config.json").read_text())
    hf["text_config"]["model_type"] = "gemma"
    with pytest.raises(ConfigError, match="text model is 'gemma'"):
        ModelConfig.from_hf_dict(hf)
