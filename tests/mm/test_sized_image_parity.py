"""The vision-language families whose images are laid out by their size, through kvbaton's engine (their images
encoded where the prompt is computed, `--encode 0`'s path), on tiny random checkpoints of each:

- SmolVLM / Idefics3 and SmolVLM2: an image is a grid of tiles and the global image, each tile a run of
  placeholders between the processor's text (row and column tags, newlines);
- Qwen2-VL and Qwen2.5-VL: an image is one run as long as its size asks (dynamic resolution), its placeholders at
  (t, row, column) positions rotated by sections of the head's frequencies (multimodal RoPE), the text after it
  behind its index.

The frontend lays the placeholders out from each image's size as transformers' processor does (token for token),
and greedy fp32 output is token-identical to transformers': images of different sizes, several in a prompt, an
image first, text-only prompts in the same batch, chunked prefill through the images, decode steps past the
prompt, and prefix caching that shares KV for the same image and never for another. (LLaVA, whose images all
take the same run: `test_llava_parity.py`.)"""

from __future__ import annotations

import pytest
from PIL import Image

from kvbaton import LLM
from kvbaton.config import ModelConfig
from kvbaton.mm.placeholders import Placeholders
from kvbaton.text.tokenizer import Tokenizer
from tests.support.helpers import engine_vlm_greedy
from tests.support.vision import FAMILIES, picture, template_messages

MAX_NEW = 12

CHATS = [
    ["Look at this:", picture(1, (70, 50)), "What is it?"],
    [picture(2, (30, 90)), "Describe it."],  # an image first
    ["Two of them:", picture(3, (96, 20)), "and", picture(4, (120, 120)), "compare."],
    ["No picture here, only words about pictures."],  # text only, in the same batch
    ["Look at this:", picture(5, (70, 50)), "What is it?"],  # the first chat with another image
]


def images_of(parts: list) -> list[Image.Image]:
    return [p for p in parts if isinstance(p, Image.Image)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, default_model_dir):
    family = FAMILIES[request.param]
    model = family.build(tmp_path_factory.mktemp(request.param), default_model_dir)
    prompts = [(family.prompt_ids(model, template_messages(parts), images_of(parts)), images_of(parts))
               for parts in CHATS]
    return model, prompts, family.greedy(model, prompts, MAX_NEW)


def generate(llm: LLM, prompts) -> list[list[int]]:
    return engine_vlm_greedy(llm, prompts, MAX_NEW)


def test_the_frontend_lays_out_the_processors_placeholders(family):
    model, prompts, _ = family
    vision = ModelConfig.from_dir(model).vision
    assert vision is not None and (vision.tiles is not None or vision.resolution is not None)
    tokenizer = Tokenizer(model)
    placeholders = Placeholders(vision, lambda text: tokenizer.encode(text, add_special_tokens=False))
    for parts, (expected, images) in zip(CHATS, prompts):
        rendered = tokenizer.encode(tokenizer.apply_chat_template(template_messages(parts), add_generation_prompt=True))
        assert placeholders.expand(rendered, [im.size for im in images]) == expected


def test_a_mixed_batch_matches_transformers(family):
    model, prompts, refs = family
    assert refs[0] != refs[4], "the image does not change the tiny model's output: the test would not see it"
    assert generate(LLM(str(model), dtype="float32"), prompts) == refs


def test_chunked_prefill_through_the_images_matches(family):
    model, prompts, refs = family
    assert generate(LLM(str(model), dtype="float32", max_num_batched_tokens=7, block_size=4), prompts) == refs


def test_the_same_image_shares_kv_blocks_and_another_never_does(family):
    model, prompts, refs = family
    llm = LLM(str(model), dtype="float32", block_size=4)
    assert generate(llm, prompts[:1]) == refs[:1]
    hits = llm.engine.kv_cache.prefix_cache_stats().hit_tokens
    assert generate(llm, prompts[:1]) == refs[:1]
    again = llm.engine.kv_cache.prefix_cache_stats().hit_tokens - hits
    assert again >= len(prompts[0][0]) - 4, again  # all but the last block
    assert generate(llm, prompts[4:]) == refs[4:]  # another image: only the blocks before it are shared
    first_image = prompts[0][0].index(ModelConfig.from_dir(model).vision.image_token_id)
    assert llm.engine.kv_cache.prefix_cache_stats().hit_tokens - hits - again <= first_image
