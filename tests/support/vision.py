"""Tiny random vision-language checkpoints of the families whose images are laid out by their size (SmolVLM /
SmolVLM2 / Idefics3: a tile grid; Qwen2-VL / Qwen2.5-VL: dynamic resolution and multimodal RoPE), saved as their
hubs' checkpoints are, with transformers' own prompt ids and greedy output as the oracle; and what the parity and
serving tests of those families share. (LLaVA's: `tests/support/helpers.py`.)"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from PIL import Image

from tests.support.helpers import hf_vlm_greedy
from tests.support.server import Served, served

IDEFICS3_TILE = 32  # pixels of a tile's edge: 4 x 4 patches of 8, pixel-shuffled by 2 into 4 image tokens
IDEFICS3_TOKENS_PER_TILE = 4
# SmolVLM's template, shortened: each image part as "<image>", which the processor expands by the tile grid
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")


def build_tiny_idefics3(out_dir: Path, tokenizer_dir: Path, seed: int = 0, family: str = "idefics3") -> Path:
    """A random-weight SmolVLM (`family` "idefics3": SmolVLM's first checkpoints' architecture; "smolvlm":
    SmolVLM2's) of a 2-layer SigLIP tower of 32-pixel tiles, the pixel-shuffle connector and a tiny Llama, saved
    as HuggingFaceTB's checkpoints are: config, weights, the default model's tokenizer with SmolVLM's image
    tokens added, and the image processor (tiles of 32 pixels, images resized to 96 at most: grids up to 3 x 3
    and the global image; Idefics3's whole processor too, SmolVLM's needs torchvision for its videos)."""
    import transformers
    from transformers import AutoTokenizer, LlamaConfig

    prefix = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[family]
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
        *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]]})
    tokenizer.chat_template = IDEFICS3_CHAT_TEMPLATE
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=0,
                       tie_word_embeddings=False, rms_norm_eps=1e-5)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IDEFICS3_TILE, patch_size=8, initializer_range=0.2)
    cfg = getattr(transformers, f"{prefix}Config")(vision_config=vision, text_config=text.to_dict(),
                                                   image_token_id=image_token, scale_factor=2,
                                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    getattr(transformers, f"{prefix}ForConditionalGeneration")(cfg).float().save_pretrained(str(out_dir))
    images = getattr(transformers, f"{prefix}ImageProcessor")(size={"longest_edge": 3 * IDEFICS3_TILE},
                                                              max_image_size={"longest_edge": IDEFICS3_TILE})
    if family == "idefics3":
        transformers.Idefics3Processor(images, tokenizer, image_seq_len=IDEFICS3_TOKENS_PER_TILE,
                                       chat_template=IDEFICS3_CHAT_TEMPLATE).save_pretrained(str(out_dir))
    else:
        images.save_pretrained(str(out_dir))
        tokenizer.save_pretrained(str(out_dir))
    return out_dir


def hf_idefics3_greedy(model_dir: Path, prompts: list[tuple[list[int], list]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate of an Idefics3 / SmolVLM checkpoint, float32, one (token ids, PIL images)
    prompt at a time, the images through the checkpoint's own image processor (tiles, global image, padding mask)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    processor = AutoImageProcessor.from_pretrained(str(model_dir))

    def pixel_inputs(ids: list[int], images: list) -> dict:
        out = processor(images=[images], return_tensors="pt")
        return {k: v for k, v in out.items() if k in ("pixel_values", "pixel_attention_mask")}

    return hf_vlm_greedy(AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32),
                          pixel_inputs, prompts, max_new_tokens)


def idefics3_prompt_ids(model_dir: Path, messages: list[dict], images: list) -> list[int]:
    """A chat's token ids as the family's processor makes them: Idefics3's whole processor, or for SmolVLM2 (whose
    whole processor needs torchvision, for its videos) its own prompt function over its image processor's grid."""
    from transformers import AutoConfig

    if AutoConfig.from_pretrained(str(model_dir)).model_type == "idefics3":
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(model_dir))
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        return list(processor(text=[text], images=[images] if images else None)["input_ids"][0])
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if images:
        grid = AutoImageProcessor.from_pretrained(str(model_dir))(images=[images], return_row_col_info=True)
        pieces = text.split("<image>")
        text = pieces[0] + "".join(
            get_image_prompt_string(rows, cols, IDEFICS3_TOKENS_PER_TILE, "<fake_token_around_image>", "<image>",
                                    "<global-img>") + piece
            for rows, cols, piece in zip(grid["rows"][0], grid["cols"][0], pieces[1:]))
    return tokenizer(text)["input_ids"]


# Qwen2-VL's template, shortened: each image part as its start, one pad token (the processor repeats it) and its end
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN2_VL_MAX_PIXELS = 28 * 28 * 16  # at most 16 placeholders an image


def build_tiny_qwen2_vl(out_dir: Path, tokenizer_dir: Path, seed: int = 0, family: str = "qwen2_vl") -> Path:
    """A random-weight Qwen2-VL (`family` "qwen2_vl"; "qwen2_5_vl": Qwen2.5-VL, whose ViT attends within windows
    but for its last block) of a 2-block ViT of 14-pixel patches merged 2 x 2 and a tiny Qwen2 with multimodal
    RoPE sections 2 + 3 + 3, saved as Qwen's checkpoints are: config, weights, the default model's tokenizer with
    Qwen2-VL's vision tokens added, and the image processor (56 x 56 to 112 x 112 pixels' worth)."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                          "<|video_pad|>")}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, initializer_range=0.2)
    else:  # windows of 56 pixels: a 112-pixel image has four
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                      initializer_range=0.2)
    prefix = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[family]
    cfg = getattr(transformers, f"{prefix}Config")(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    getattr(transformers, f"{prefix}ForConditionalGeneration")(cfg).float().save_pretrained(str(out_dir))
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=QWEN2_VL_MAX_PIXELS).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def qwen2_vl_prompt_ids(model_dir: Path, messages: list[dict], images: list) -> list[int]:
    """A chat's token ids as Qwen2-VL's processor makes them: each image's pad token repeated once per merged
    patch of the image processor's grid (its whole processor needs torchvision, for videos)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if images:
        grids = AutoImageProcessor.from_pretrained(str(model_dir))(images=images)["image_grid_thw"]
        pieces = text.split("<|image_pad|>")
        text = pieces[0] + "".join("<|image_pad|>" * (int(t * h * w) // 4) + piece
                                   for (t, h, w), piece in zip(grids.tolist(), pieces[1:]))
    return tokenizer(text)["input_ids"]


def hf_qwen2_vl_greedy(model_dir: Path, prompts: list[tuple[list[int], list]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate of a Qwen2-VL checkpoint, float32, one (token ids, PIL images) prompt at a
    time, the images through its own image processor (patches and their grid: multimodal RoPE positions)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    processor = AutoImageProcessor.from_pretrained(str(model_dir))

    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]

    def pixel_inputs(ids: list[int], images: list) -> dict:
        out = processor(images=images, return_tensors="pt")
        # which tokens are an image's (the processor's own output beside the ids): without them transformers
        # falls back to text positions
        kinds = torch.tensor([[int(t == image_token) for t in ids]], dtype=torch.int32)
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
                "mm_token_type_ids": kinds}

    return hf_vlm_greedy(AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32),
                          pixel_inputs, prompts, max_new_tokens)



@dataclass(frozen=True)
class Family:
    """A family's tiny checkpoint, its processor's prompt ids of a chat, and transformers' greedy output."""

    build: Callable[[Path, Path], Path]  # (out dir, tokenizer dir) -> the checkpoint
    prompt_ids: Callable[[Path, list[dict], list], list[int]]
    greedy: Callable[[Path, list[tuple[list[int], list]], int], list[list[int]]]


FAMILIES = {
    "idefics3": Family(lambda out, tok: build_tiny_idefics3(out, tok, family="idefics3"), idefics3_prompt_ids,
                       hf_idefics3_greedy),
    "smolvlm": Family(lambda out, tok: build_tiny_idefics3(out, tok, family="smolvlm"), idefics3_prompt_ids,
                      hf_idefics3_greedy),
    "qwen2_vl": Family(lambda out, tok: build_tiny_qwen2_vl(out, tok, family="qwen2_vl"), qwen2_vl_prompt_ids,
                       hf_qwen2_vl_greedy),
    "qwen2_5_vl": Family(lambda out, tok: build_tiny_qwen2_vl(out, tok, family="qwen2_5_vl"), qwen2_vl_prompt_ids,
                         hf_qwen2_vl_greedy),
}


@contextlib.contextmanager
def served_family(name: str, out_dir: Path, tokenizer_dir: Path, *flags: str) -> Iterator[tuple[Path, Served]]:
    """A tiny checkpoint of the family served float32 with `flags` (stopped by PID on the way out)."""
    model = FAMILIES[name].build(out_dir, tokenizer_dir)
    with served("--model", str(model), "--dtype", "float32", "--max-model-len", "1024", *flags) as server:
        yield model, server


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3)))


def data_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}"


def template_messages(parts: list) -> list[dict]:
    """A user turn of text and PIL images, as a chat template takes it."""
    return [{"role": "user", "content": [{"type": "image"} if isinstance(p, Image.Image) else
                                         {"type": "text", "text": p} for p in parts]}]


def api_messages(parts: list) -> list[dict]:
    """The same turn as the OpenAI API takes it: each image as a base64 data: URL."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(p)}}
                                         if isinstance(p, Image.Image) else {"type": "text", "text": p}
                                         for p in parts]}]


def check_served_chats(base: str, family: Family, model: Path, chats: list[list], max_new: int) -> None:
    """Each chat through the server answers transformers' greedy tokens, and `usage` and `/tokenize` count the
    processor's prompt ids."""
    prompts = [(family.prompt_ids(model, template_messages(parts), [p for p in parts if isinstance(p, Image.Image)]),
                [p for p in parts if isinstance(p, Image.Image)]) for parts in chats]
    refs = family.greedy(model, prompts, max_new)
    for parts, (ids, _), ref in zip(chats, prompts, refs):
        messages = api_messages(parts)
        resp = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "messages": messages, "max_tokens": max_new, "temperature": 0, "ignore_eos": True, "logprobs": True})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        answered = [entry["token"] for entry in body["choices"][0]["logprobs"]["content"]]
        expected = [httpx.post(f"{base}/detokenize", json={"tokens": [t]}).json()["prompt"] for t in ref]
        assert answered == expected, parts
        assert body["usage"]["prompt_tokens"] == len(ids)  # every image's placeholders (and tags) counted
        tokenized = httpx.post(f"{base}/tokenize", json={"messages": messages})
        assert tokenized.json()["tokens"] == list(ids), tokenized.text  # the processor's ids


def encoded(base: str) -> int:
    """How many images the deployment's first encoder worker ran through its tower (as its last report said)."""
    workers = {w["name"]: w for w in httpx.get(f"{base}/workers").json()["workers"]}
    return workers["kvbaton-encode-0"]["encode"]["encoded"]
