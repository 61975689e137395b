"""SmolVLM / Idefics3 (and SmolVLM2) through kvbaton's engine: an image is a grid of tiles and the global image,
each tile a run of placeholders between the processor's text (row and column tags, newlines). The frontend lays
the placeholders out from the image's size as transformers' processor does (token for token), and greedy fp32
output is token-identical to transformers' on tiny random checkpoints of both families: images of different
grids, several in a prompt, an image first, text-only prompts in the same batch, chunked prefill through the
tiles, and prefix caching that shares KV for the same image only."""

from __future__ import annotations

import random

import pytest
from PIL import Image

from kvbaton import LLM, SamplingParams
from kvbaton.config import ModelConfig
from kvbaton.mm.placeholders import Placeholders
from kvbaton.text.tokenizer import Tokenizer
from tests.support.helpers import IDEFICS3_TOKENS_PER_TILE, build_tiny_idefics3, hf_idefics3_greedy

MAX_NEW = 8


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3)))


def chat(*parts: str | Image.Image) -> tuple[list[dict], list[Image.Image]]:
    content = [{"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}], [p for p in parts if isinstance(p, Image.Image)]


CHATS = [
    chat("Look at this:", picture(1, (70, 50)), "What is it?"),  # 3 x 3 tiles and the global image
    chat(picture(2, (30, 90)), "Describe it."),  # an image first, 3 rows x 1 column
    chat("Two of them:", picture(3, (96, 20)), "and", picture(4, (50, 70)), "compare."),  # 1 x 3, then 3 x 3
    chat("No picture here, only words about pictures."),  # text only, in the same batch
    chat("Look at this:", picture(5, (70, 50)), "What is it?"),  # the first chat with another image
]


def processor_ids(model, family: str, messages: list[dict], images: list[Image.Image]) -> list[int]:
    """The prompt's token ids as transformers' processor of the family makes them (SmolVLM2's whole processor
    needs torchvision, for its videos: its own prompt function over its image processor's grid stands in)."""
    if family == "idefics3":
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(model))
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        return processor(text=[text], images=[images] if images else None)["input_ids"][0]
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if images:
        grid = AutoImageProcessor.from_pretrained(str(model))(images=[images], return_row_col_info=True)
        pieces = text.split("<image>")
        text = pieces[0] + "".join(
            get_image_prompt_string(rows, cols, IDEFICS3_TOKENS_PER_TILE, "<fake_token_around_image>", "<image>",
                                    "<global-img>") + piece
            for rows, cols, piece in zip(grid["rows"][0], grid["cols"][0], pieces[1:]))
    return tokenizer(text)["input_ids"]


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def smolvlm(request, tmp_path_factory, default_model_dir):
    family = request.param
    model = build_tiny_idefics3(tmp_path_factory.mktemp(family), default_model_dir, family=family)
    prompts = [(list(processor_ids(model, family, messages, images)), images) for messages, images in CHATS]
    return model, prompts, hf_idefics3_greedy(model, prompts, MAX_NEW)


def generate(llm: LLM, prompts) -> list[list[int]]:
    inputs = [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else
              {"prompt_token_ids": ids} for ids, images in prompts]
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_frontend_lays_out_the_processors_placeholders(smolvlm):
    model, prompts, _ = smolvlm
    vision = ModelConfig.from_dir(model).vision
    assert vision is not None and vision.tokens_per_image == IDEFICS3_TOKENS_PER_TILE and vision.tiles is not None
    tokenizer = Tokenizer(model)
    placeholders = Placeholders(vision, lambda text: tokenizer.encode(text, add_special_tokens=False))
    for (messages, images), (expected, _) in zip(CHATS, prompts):
        rendered = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        assert placeholders.expand(rendered, [im.size for im in images]) == expected


def test_a_mixed_batch_of_tiled_images_and_text_matches_transformers(smolvlm):
    model, prompts, refs = smolvlm
    assert refs[0] != refs[4], "the image does not change the tiny model's output: the test would not see it"
    assert generate(LLM(str(model), dtype="float32"), prompts) == refs


def test_chunked_prefill_through_the_tiles_matches(smolvlm):
    model, prompts, refs = smolvlm
    assert generate(LLM(str(model), dtype="float32", max_num_batched_tokens=7, block_size=4), prompts) == refs


def test_the_same_image_shares_kv_blocks_and_another_never_does(smolvlm):
    model, prompts, refs = smolvlm
    llm = LLM(str(model), dtype="float32", block_size=4)
    assert generate(llm, prompts[:1]) == refs[:1]
    hits = llm.engine.kv_cache.prefix_cache_stats().hit_tokens
    assert generate(llm, prompts[:1]) == refs[:1]
    again = llm.engine.kv_cache.prefix_cache_stats().hit_tokens - hits
    assert again >= len(prompts[0][0]) - 4, again  # all but the last block
    assert generate(llm, prompts[4:]) == refs[4:]  # another image: only the blocks before it are shared
    first_image = prompts[0][0].index(ModelConfig.from_dir(model).vision.image_token_id)
    assert llm.engine.kv_cache.prefix_cache_stats().hit_tokens - hits - again <= first_image
