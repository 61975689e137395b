"""Shared test helpers: tiny random checkpoints, prompts and the transformers reference outputs (the oracle)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from tests.support.budget import release_memory

TINY_VOCAB = 320


def build_tiny_tokenizer(out_dir: Path, chat_template: str | None = None) -> None:
    """A word-level tokenizer over words t0..t{V-1}; enough to exercise text paths."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(TINY_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))


def build_tiny_checkpoint(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """Random-weight Llama / Qwen2 / Qwen3 saved with transformers (fp32)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    elif arch == "llama3":
        cfg = LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=True)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    else:
        raise ValueError(arch)
    return save_random_checkpoint(cfg, out_dir, seed)


def save_random_checkpoint(cfg, out_dir: Path, seed: int) -> Path:
    """`cfg`'s model with random weights (and random biases: they default to zero), saved fp32 with the tiny
    tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(str(out_dir))
    build_tiny_tokenizer(out_dir)
    return out_dir


def tiny_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Random token ids (1 .. TINY_VOCAB - 1) of the given lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB) for _ in range(n)] for n in lengths]


def prompt_of(n: int, seed: int) -> list[int]:
    """`n` random token ids (100 .. 39999) for the default model: distinct per seed, so no prefix is shared."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def greedy_checked(llm, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """An offline `LLM`'s greedy outputs (stopping at EOS), then its integrity check and an empty pool."""
    from kvbaton import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_new))
    llm.engine.check_integrity()
    assert llm.engine.kv_cache.pool.usage() == 0.0, "blocks still referenced after all requests finished"
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_greedy(model_dir: Path | str, prompts: list[list[int]], max_new_tokens: int,
              eos_token_id: int | list[int] | None = None, **generate_kwargs: Any) -> list[list[int]]:
    """transformers' greedy `generate`, float32, one prompt at a time (no padding effects): the parity oracle.
    `generate_kwargs` go to `generate` as they are (`min_new_tokens`, `repetition_penalty`, `sequence_bias`...)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    outs = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=eos_token_id, pad_token_id=0, attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), **generate_kwargs)
        outs.append(gen[0, len(ids):].tolist())
    del model
    release_memory()  # NOTE: the oracle's model is big beside the engine under test (the suite's RSS budget)
    return outs


def hf_logits(model_dir: Path | str, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits for every position of `ids` (one forward pass, no cache): the logits oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    del model
    release_memory()
    return logits


def deterministic_prompts(vocab: int, count: int, seed: int = 11) -> list[list[int]]:
    """Random token ids of mixed lengths (5-150): distinct prompts, so no prefix cache hides a difference."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randrange(5, 150))] for _ in range(count)]


def greedy(llm, max_tokens: int, prompts: list[list[int]]) -> list[list[int]]:
    """An offline `LLM`'s greedy output token ids (ignore_eos), in the order of `prompts`."""
    from kvbaton import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# A tiny model's KV pool for tests that build many engines: the default 1 GiB holds ~170k blocks of a tiny model,
# whose bookkeeping alone is ~50 MiB of Python objects per engine (the suite runs near its 2 GiB per process).
TINY_POOL_GB = 0.05


def build_tiny_moe_checkpoint(arch: str, out_dir: Path, seed: int = 0, **overrides: object) -> Path:
    """Random-weight sparse-expert models saved with transformers (fp32): 8 experts, top-2 (Mixtral,
    Qwen2-MoE with a gated shared expert and one dense layer, Qwen3-MoE with norm_topk_prob, OLMoE with its
    whole-q/k norm and clip_qkv). Weights are large enough (std 0.2) that routing differs per token.
    `overrides`: config fields to change (e.g. a Mixtral `intermediate_size` the C experts kernel takes)."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                  eos_token_id=None, bos_token_id=None, pad_token_id=0, num_experts_per_tok=2,
                  tie_word_embeddings=False)
    if arch == "mixtral":
        cfg = MixtralConfig(**{**common, "intermediate_size": 48, "num_local_experts": 8, **overrides})
    elif arch == "qwen2_moe":
        cfg = Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                             shared_expert_intermediate_size=48, mlp_only_layers=[1])
    elif arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                             head_dim=32, norm_topk_prob=True)
    elif arch == "olmoe":
        cfg = OlmoeConfig(**common, intermediate_size=32, num_experts=8, clip_qkv=1.5)
    else:
        raise ValueError(arch)
    return save_random_checkpoint(cfg, out_dir, seed)


def build_deepseek_checkpoint(out_dir: Path, seed: int = 0, **overrides: object) -> Path:
    """A random-weight DeepSeek-V3 saved with transformers (fp32), weights large enough that outputs are not
    degenerate, router correction biases and norm weights random so each matters."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    kwargs: dict = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256, initializer_range=0.2,
        eos_token_id=None, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(DeepseekV3Config(**kwargs), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.rand_like(buf))
    model.save_pretrained(str(out_dir))
    build_tiny_tokenizer(out_dir)
    return out_dir


LLAVA_IMAGE_TOKEN = TINY_VOCAB - 1  # "t319": the tiny tokenizer's last word stands for an image's positions
LLAVA_TOKENS_PER_IMAGE = 25  # 30 x 30 pixels in 6 x 6 patches, the CLS position dropped
# each message's text, or its parts in order, an image as its image token ("t319"), words apart by spaces
LLAVA_CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}"
                       "{% for p in m['content'] %}{% if p['type'] == 'image' %}t319 {% else %}{{ p['text'] }} "
                       "{% endif %}{% endfor %}{% endif %}{% endfor %}")


def build_tiny_llava(out_dir: Path, seed: int = 0) -> Path:
    """A random-weight LLaVA (a 2-layer CLIP tower of 30 x 30 images, the projector, the tiny Llama) saved as
    llava-hf's checkpoints are: config, weights, the tiny tokenizer and the CLIP image processor."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    text = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=0,
                       tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=30, patch_size=6, initializer_range=0.2)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=LLAVA_IMAGE_TOKEN,
                      vision_feature_layer=-2, vision_feature_select_strategy="default",
                      image_seq_length=LLAVA_TOKENS_PER_IMAGE)
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(cfg).float().save_pretrained(str(out_dir))
    build_tiny_tokenizer(out_dir, LLAVA_CHAT_TEMPLATE)
    CLIPImageProcessor(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30}).save_pretrained(str(out_dir))
    return out_dir


def hf_llava_greedy(model_dir: Path, prompts: list[tuple[list[int], list]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate of a vision-language checkpoint, float32, one (token ids, PIL images) prompt
    at a time, its images through the checkpoint's own processor: the multimodal parity oracle."""
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    processor = AutoImageProcessor.from_pretrained(str(model_dir))

    def pixel_inputs(ids: list[int], images: list) -> dict:
        return {"pixel_values": processor(images=images, return_tensors="pt")["pixel_values"]}

    return hf_vlm_greedy(LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32),
                          pixel_inputs, prompts, max_new_tokens)


def engine_vlm_greedy(llm, prompts: list[tuple[list[int], list]], max_new_tokens: int) -> list[list[int]]:
    """kvbaton's greedy tokens for each (token ids, PIL images) prompt, all in one `generate` (one batch)."""
    from kvbaton import SamplingParams

    inputs = [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else
              {"prompt_token_ids": ids} for ids, images in prompts]
    outs = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_vlm_greedy(model, pixel_inputs, prompts: list[tuple[list[int], list]], max_new_tokens: int) -> list[list[int]]:
    """`model`'s greedy tokens for each (token ids, PIL images) prompt, `pixel_inputs(ids, images)` its image
    inputs."""
    outs = []
    for ids, images in prompts:
        extra = pixel_inputs(ids, images) if images else {}
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long), **extra)
        outs.append(gen[0, len(ids):].tolist())
    del model
    release_memory()
    return outs
