"""Frozen, validated configuration dataclasses.

Each config describes one resource; they are built once (from a checkpoint's config.json
or from user arguments) and never mutated afterwards.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV3ForCausalLM": "deepseek_v3",  # DeepSeek-V3/R1 and Kimi-K2 checkpoints name this class
    "LlavaForConditionalGeneration": "llama",  # its text model's family (`_VISION_TEXT_MODELS`) decides
    "Idefics3ForConditionalGeneration": "llama",  # SmolVLM (and Idefics3): the same
    "SmolVLMForConditionalGeneration": "llama",  # SmolVLM2
    "Qwen2VLForConditionalGeneration": "qwen2",
    "Qwen2_5_VLForConditionalGeneration": "qwen2",
}
# the vision-language architectures: which encoder (`mm/`) turns their images into the text model's embeddings
VISION_ARCHITECTURES = {"LlavaForConditionalGeneration": "llava", "Idefics3ForConditionalGeneration": "idefics3",
                        "SmolVLMForConditionalGeneration": "idefics3",  # SmolVLM2: Idefics3's images, renamed
                        "Qwen2VLForConditionalGeneration": "qwen2_vl",
                        "Qwen2_5_VLForConditionalGeneration": "qwen2_vl"}  # Qwen2.5-VL: another tower, same images
_VISION_TEXT_MODELS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",  # text_config's
                       "qwen2_vl_text": "qwen2", "qwen2_vl": "qwen2",  # (older Qwen2-VL configs: no text_config)
                       "qwen2_5_vl_text": "qwen2", "qwen2_5_vl": "qwen2"}
_QWEN_LIKE = ("qwen2", "qwen2_moe")  # q/k/v projections carry a bias
_PER_HEAD_QK_NORM = ("qwen3", "qwen3_moe")


class ConfigError(ValueError):
    """A configuration or checkpoint that kvbaton cannot serve; the message says why."""


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE scaling as transformers computes it (`kvbaton.layers.rope`): Llama-3's frequency-dependent slowdown
    (`rope_type == "llama3"`) or YaRN (`"yarn"`: DeepSeek-V3, Kimi-K2; its `attention_factor` scales cos/sin, and
    DeepSeek's softmax scale takes `mscale_all_dim` too)."""

    factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"  # "llama3" | "yarn"
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    mscale: float | None = None  # yarn: with mscale_all_dim, the attention factor's terms
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # yarn: cos/sin scale; None: from factor, mscale and mscale_all_dim
    truncate: bool = True  # yarn: round the correction range outwards


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Sparse experts: a router picks `top_k` of `num_experts` per token; MoE layers replace the dense MLP.

    softmax scoring (Mixtral, Qwen-MoE, OLMoE): top-k of the softmax over all experts, renormalized over the
    k when `norm_topk_prob`. sigmoid scoring (DeepSeek-V3, Kimi-K2): sigmoid scores, plus
    `e_score_correction_bias` for the choice only; experts come from the `topk_groups` best of `num_groups`
    groups (a group's score: its two best experts); weights renormalized, then times `routed_scaling_factor`.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False  # a learned per-expert bias added to scores for the choice
    shared_intermediate_size: int = 0  # always-on shared expert(s) (0: none)
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(gate(x))
    dense_layers: frozenset[int] = frozenset()  # layers that keep a dense MLP of the model's intermediate_size

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], not {self.top_k}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ConfigError(f"unsupported MoE scoring function {self.scoring!r}; supported: softmax, sigmoid")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ConfigError(f"n_group={self.num_groups} must divide the {self.num_experts} experts and "
                              f"topk_group={self.topk_groups} be in [1, n_group]")
        if self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise ConfigError("num_experts_per_tok exceeds the experts of the topk_group chosen groups")

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds, per token, the compressed latent
    `c_kv` [kv_lora_rank] and the decoupled RoPE key [qk_rope_head_dim], shared by every head."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q is projected from the hidden state directly
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # DeepSeek's checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ...

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class TileGrid:
    """The image processor's settings that decide how many tiles an image is cut into (Idefics3 / SmolVLM): the
    image is resized so that its longest edge is `longest_edge` (None: not resized), then, when `split`, to
    whole multiples of `tile` and cut into those tiles, the global image (the whole, at `tile`) last."""

    longest_edge: int | None
    tile: int
    split: bool


@dataclass(frozen=True, kw_only=True)
class DynamicResolution:
    """Qwen2-VL's image processor: an image keeps its aspect, resized to whole multiples of `patch * merge`
    pixels with at least `min_pixels` and at most `max_pixels`; every `merge` x `merge` patches become one
    placeholder (so one image's run is as long as its size asks)."""

    patch: int
    merge: int
    min_pixels: int
    max_pixels: int


@dataclass(frozen=True, kw_only=True)
class VisionSpec:
    """What the text model of a vision-language checkpoint needs to know of its images: each image stands in the
    prompt as runs of `tokens_per_image` copies of `image_token_id`, whose embeddings the encoder supplies. One
    run per image (LLaVA), or with `tiles`, one per tile and one for the global image, between text tokens
    (Idefics3: `<fake_token_around_image><row_1_col_1>`, newlines), the global image's run after
    `global_image_token_id`."""

    encoder: str  # a value of VISION_ARCHITECTURES
    image_token_id: int
    tokens_per_image: int  # per run: per tile with `tiles`
    tiles: TileGrid | None = None
    global_image_token_id: int | None = None  # with `tiles`: the token before an image's last run
    # Qwen2-VL: one run per image, as long as its size asks (`tokens_per_image` 0), and multimodal RoPE: an
    # image's placeholders take (t, row, column) positions, rotated by sections of the head's frequencies
    resolution: DynamicResolution | None = None
    mrope_section: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a decoder-only transformer, as read from an HF `config.json`."""

    architecture: str  # a value of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE; OLMoE: over all heads at once
    qk_norm_per_head: bool = True
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip]
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    vision: VisionSpec | None = None  # a vision-language checkpoint's image placeholders

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if min(self.hidden_size, self.num_hidden_layers, self.vocab_size, self.head_dim) < 1:
            raise ConfigError("model dimensions must be positive")

    @classmethod
    def from_hf_dict(cls, hf: dict) -> ModelConfig:
        arch_names = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in arch_names if a in SUPPORTED_ARCHITECTURES), None)
        if any(a in VISION_ARCHITECTURES for a in arch_names):  # the text model's own family decides its layers
            text_type = (hf.get("text_config") or {}).get("model_type", hf.get("model_type", "llama"))
            arch = _VISION_TEXT_MODELS.get(text_type)
            if arch is None:
                raise ConfigError(f"a vision-language checkpoint whose text model is {text_type!r} is not supported; "
                                  f"text models: {', '.join(sorted(_VISION_TEXT_MODELS))}")
        if arch is None:
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise ConfigError(f"unsupported architecture {arch_names or '(none)'}; supported: {supported}")
        text = hf.get("text_config") or hf
        quant = hf.get("quantization_config") or text.get("quantization_config")
        if quant:
            # NOTE: e.g. DeepSeek-V3's block-wise FP8 weights with their *_scale_inv tensors: loading their raw
            # values as weights would give a model that runs and answers nonsense
            method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
            raise ConfigError(f"quantized checkpoints ({method}) are not supported: convert the weights to bf16 "
                              "or fp32 first (or use a GGUF file)")
        heads = text["num_attention_heads"]
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        rope_params = text.get("rope_parameters") or {}
        rope_theta = text.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        max_pos = text.get("max_position_embeddings", 2048)
        if text.get("sliding_window") and text.get("use_sliding_window", arch == "llama"):
            # NOTE: within the window, sliding-window attention equals full attention, so
            # capping the context keeps outputs exact without a second attention path.
            max_pos = min(max_pos, int(text["sliding_window"]))
        eos = text.get("eos_token_id", hf.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_hidden_layers=text["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=text.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=_parse_rope_scaling(text.get("rope_scaling") or rope_params, text),
            attention_bias=arch in _QWEN_LIKE or bool(text.get("attention_bias", False)),
            qk_norm=arch in _PER_HEAD_QK_NORM or arch == "olmoe",
            qk_norm_per_head=arch != "olmoe",
            clip_qkv=float(text["clip_qkv"]) if text.get("clip_qkv") is not None else None,
            moe=_parse_moe(arch, text),
            mla=_parse_mla(text) if arch == "deepseek_v3" else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            bos_token_id=text.get("bos_token_id", hf.get("bos_token_id")),
            eos_token_ids=eos_ids,
            vision=_parse_vision(arch_names, hf),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in model directory {model_dir}")
        hf = json.loads(path.read_text())
        try:
            config = cls.from_hf_dict(hf)
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: missing or invalid field {exc}") from exc
        if config.vision is not None and config.vision.encoder == "idefics3":
            config = replace(config, vision=_with_tiles(config.vision, Path(model_dir)))
        if config.vision is not None and config.vision.encoder == "qwen2_vl":
            config = replace(config, vision=_with_resolution(config.vision, Path(model_dir), hf))
        return config


def _parse_vision(arch_names: list[str], hf: dict) -> VisionSpec | None:
    encoder = next((VISION_ARCHITECTURES[a] for a in arch_names if a in VISION_ARCHITECTURES), None)
    if encoder is None:
        return None
    image_token = hf.get("image_token_id", hf.get("image_token_index"))
    if not isinstance(image_token, int):
        raise ConfigError("a vision-language config needs image_token_id (or image_token_index)")
    if encoder == "qwen2_vl":  # as many as the image's size asks
        return VisionSpec(encoder=encoder, image_token_id=image_token, tokens_per_image=0,
                          mrope_section=_mrope_section(hf))
    vision = hf["vision_config"]
    patches = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
    if encoder == "idefics3":  # the connector folds scale x scale patches into one token
        tokens = patches // int(hf.get("scale_factor", 2)) ** 2
    else:  # LLaVA's "default" strategy drops the CLS position; "full" keeps it
        tokens = patches + (hf.get("vision_feature_select_strategy", "default") == "full")
    return VisionSpec(encoder=encoder, image_token_id=image_token, tokens_per_image=tokens)


def image_processor_settings(model_dir: Path) -> dict:
    """The checkpoint's image processor settings: preprocessor_config.json, or the `image_processor` entry of
    transformers 5's processor_config.json ({} if neither)."""
    older = model_dir / "preprocessor_config.json"
    if older.is_file():
        return json.loads(older.read_text())
    newer = model_dir / "processor_config.json"
    if newer.is_file():
        settings = json.loads(newer.read_text()).get("image_processor", {})
        return settings if isinstance(settings, dict) else {}
    return {}


def _with_tiles(vision: VisionSpec, model_dir: Path) -> VisionSpec:
    """Idefics3's tile grid (from its image processor's settings) and `<global-img>`'s id (from the tokenizer's
    added tokens): what the prompt's image runs are grouped by."""
    settings = image_processor_settings(model_dir)
    try:
        tile = int(settings.get("max_image_size", {}).get("longest_edge", 364))
        resize = settings.get("do_resize", True)
        longest = int(settings["size"]["longest_edge"]) if resize else None
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ConfigError(f"{model_dir}: the image processor's size needs a longest_edge") from None
    tokenizer = model_dir / "tokenizer.json"
    added = json.loads(tokenizer.read_text()).get("added_tokens", []) if tokenizer.is_file() else []
    global_id = next((t["id"] for t in added if t.get("content") == "<global-img>"), None)
    if global_id is None:
        raise ConfigError(f"{model_dir}: the tokenizer has no <global-img> token (an Idefics3 / SmolVLM tokenizer has)")
    return replace(vision, tiles=TileGrid(longest_edge=longest, tile=tile, split=bool(settings.get(
        "do_image_splitting", True))), global_image_token_id=int(global_id))


def _mrope_section(hf: dict) -> tuple[int, ...]:
    text = hf.get("text_config") or hf
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if not isinstance(section, list) or len(section) != 3:
        raise ConfigError("a Qwen2-VL config needs rope_parameters.mrope_section: three sizes")
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if sum(section) * 2 != head_dim:
        raise ConfigError(f"mrope_section {section} does not cover the head's {head_dim // 2} frequencies")
    return tuple(int(n) for n in section)


def _with_resolution(vision: VisionSpec, model_dir: Path, hf: dict) -> VisionSpec:
    """Qwen2-VL's resize bounds (from its image processor's settings) and patch sizes (from config.json, `hf`)."""
    settings = image_processor_settings(model_dir)
    size = settings.get("size") or {}
    try:
        resolution = DynamicResolution(
            patch=int(hf["vision_config"]["patch_size"]), merge=int(hf["vision_config"].get("spatial_merge_size", 2)),
            min_pixels=int(settings.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(settings.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{model_dir}: the image processor's pixel bounds or the patch size are not numbers"
                          ) from None
    return replace(vision, resolution=resolution)


def _parse_moe(arch: str, text: dict) -> MoEConfig | None:
    """The MoE fields of an HF config, spelled differently by each family."""
    num_experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    if not num_experts:
        return None
    layers = text["num_hidden_layers"]
    moe = functools.partial(MoEConfig, num_experts=int(num_experts), top_k=int(text["num_experts_per_tok"]))
    if arch == "mixtral":
        return moe(intermediate_size=text["intermediate_size"])
    if arch == "olmoe":
        return moe(intermediate_size=text["intermediate_size"],
                         norm_topk_prob=bool(text.get("norm_topk_prob", False)))
    if arch in ("qwen2_moe", "qwen3_moe"):
        step = int(text.get("decoder_sparse_step", 1) or 1)
        only_mlp = set(text.get("mlp_only_layers") or [])
        dense = frozenset(i for i in range(layers) if i in only_mlp or (i + 1) % step)
        shared = int(text.get("shared_expert_intermediate_size", 0) or 0)
        return moe(intermediate_size=text["moe_intermediate_size"],
                         norm_topk_prob=bool(text.get("norm_topk_prob", False)), shared_intermediate_size=shared,
                         shared_expert_gate=shared > 0, dense_layers=dense)
    if arch == "deepseek_v3":
        first_dense, freq = int(text.get("first_k_dense_replace", 0)), int(text.get("moe_layer_freq", 1) or 1)
        dense = frozenset(i for i in range(layers) if i < first_dense or i % freq)
        expert_size = text["moe_intermediate_size"]
        return moe(intermediate_size=expert_size, scoring="sigmoid",
                         norm_topk_prob=bool(text.get("norm_topk_prob", True)),
                         num_groups=int(text.get("n_group") or 1), topk_groups=int(text.get("topk_group") or 1),
                         routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
                         score_correction_bias=True,
                         shared_intermediate_size=expert_size * int(text.get("n_shared_experts") or 0),
                         dense_layers=dense)
    raise ConfigError(f"{arch} checkpoints have no sparse experts, but this config names {num_experts}")


def _parse_mla(text: dict) -> MLAConfig:
    return MLAConfig(kv_lora_rank=int(text["kv_lora_rank"]), q_lora_rank=text.get("q_lora_rank"),
                     qk_nope_head_dim=int(text["qk_nope_head_dim"]), qk_rope_head_dim=int(text["qk_rope_head_dim"]),
                     v_head_dim=int(text["v_head_dim"]), rope_interleave=bool(text.get("rope_interleave", True)))


def _parse_rope_scaling(raw: dict, text: dict) -> RopeScaling | None:
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default", "mrope"):  # Qwen2-VL's sections: `VisionSpec.mrope_section`
        return None
    if kind == "yarn":
        return _parse_yarn(raw, text)
    if kind != "llama3":
        raise ConfigError(f"unsupported rope scaling type {kind!r}; supported: default, llama3, yarn")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )


def _parse_yarn(raw: dict, text: dict) -> RopeScaling:
    """transformers' defaults: a top-level original_max_position_embeddings wins, else the rope dict's, else
    max_position_embeddings; no factor: max_position_embeddings over the original."""
    max_pos = text.get("max_position_embeddings", 2048)
    original = int(text.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
                   or max_pos)

    def optional(key: str) -> float | None:
        return None if raw.get(key) is None else float(raw[key])

    return RopeScaling(rope_type="yarn", factor=float(raw.get("factor") or max_pos / original),
                       original_max_position_embeddings=original, beta_fast=float(raw.get("beta_fast") or 32),
                       beta_slow=float(raw.get("beta_slow") or 1), mscale=optional("mscale"),
                       mscale_all_dim=optional("mscale_all_dim"), attention_factor=optional("attention_factor"),
                       truncate=bool(raw.get("truncate", True)))


# --kv-cache-dtype -> the KV layout's dtype (None: the model's)
KV_CACHE_DTYPES = {"auto": None, "bf16": "bfloat16", "bfloat16": "bfloat16", "float32": "float32", "int8": "int8",
                   "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` blocks of `block_size` token slots per layer."""

    block_size: int = 16
    num_blocks: int | None = None  # None: size from `kv_cache_memory_gb`
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | a KV_CACHE_DTYPES name
    # vision-language models: image embeddings no request holds, kept for the next request with the same image
    encoder_cache_mb: float = 256.0

    def __post_init__(self) -> None:
        if self.encoder_cache_mb < 0:
            raise ConfigError("encoder_cache_mb must be >= 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"not {self.kv_cache_dtype!r}")
        if self.block_size < 1:
            raise ConfigError("block_size must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("num_blocks must be >= 1")
        if self.kv_cache_memory_gb <= 0:
            raise ConfigError("kv_cache_memory_gb must be positive")


WRITE_POLICIES = ("write-through", "write-back")
STORE_TIERS = ("shm", "disk", "redis", "mooncake")  # fastest first: the order a lookup asks them in


@dataclass(frozen=True, kw_only=True)
class KVStoreConfig:
    """The KV tiers shared beyond one worker's pool (`kvbaton.kv.store`), none unless `tiers` names them.

    shm: node-local shared memory, one named arena every worker on the host maps (L2).
    disk: a directory of signed block files, bounded, kept across restarts under one cluster secret (L3); one per
          worker.
    redis: a cluster-wide Redis, every block under the TTL (L4).
    mooncake: a Mooncake Store (a cluster-wide memory pool), the alternative L4.
    """

    tiers: tuple[str, ...] = ()
    shm_name: str | None = None  # the arena in /dev/shm; workers naming the same arena share it (serve: one per server)
    shm_gb: float = 1.0
    disk_dir: str | None = None  # None: <cache>/kv-store; a served worker uses <disk_dir>/<worker name>
    disk_gb: float = 4.0
    redis_url: str | None = None  # serve: None starts a private redis-server of `redis_gb`, LRU
    redis_gb: float = 4.0
    mooncake_master: str | None = None  # host:port of its master; serve: None starts a private store of `mooncake_gb`
    mooncake_metadata_url: str | None = None  # its HTTP metadata server (the private store's master runs one)
    mooncake_gb: float = 4.0
    ttl_s: float = 3600.0  # no block outlives this in any tier
    write_policy: str = "write-through"  # full blocks as they are computed, or cached blocks when evicted
    # with other requests running, load a prefix on a background thread (they go on stepping) rather than
    # inside the step (they wait for it); False: always inside the step
    background_loads: bool = True

    def __post_init__(self) -> None:
        unknown = [t for t in self.tiers if t not in STORE_TIERS]
        if unknown or len(set(self.tiers)) != len(self.tiers):
            raise ConfigError(f"KV store tiers must be distinct names among {', '.join(STORE_TIERS)}, "
                              f"not {', '.join(self.tiers)}")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"KV store write policy must be one of {', '.join(WRITE_POLICIES)}, "
                              f"not {self.write_policy!r}")
        if min(self.shm_gb, self.disk_gb, self.redis_gb, self.mooncake_gb, self.ttl_s) <= 0:
            raise ConfigError("KV store sizes and TTL must be positive")

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    @property
    def ordered_tiers(self) -> tuple[str, ...]:
        return tuple(t for t in STORE_TIERS if t in self.tiers)


MAX_DECODE_BURST = 64  # a burst holds its requests' new arrivals back: bounded


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of continuous batching."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # >0: cap one request's prefill chunk per step
    # Decode steps run back to back in one scheduled step when every running request decodes greedily with
    # nothing that needs Python per token, and none waits (sched/burst.py); 1: one token per step
    decode_burst: int = 4

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 1 <= self.decode_burst <= MAX_DECODE_BURST:
            raise ConfigError(f"decode_burst must be in [1, {MAX_DECODE_BURST}], got {self.decode_burst}")


@dataclass(frozen=True, kw_only=True)
class ExpertParallelConfig:
    """This engine is rank `rank` of an expert-parallel group of `size` engines: each holds 1/size of every MoE
    layer's experts and its own requests (attention data-parallel); tokens cross ranks in each MoE layer."""

    size: int
    rank: int
    init_method: str  # torch.distributed rendezvous, e.g. tcp://127.0.0.1:29500
    int8_dispatch: bool = False  # int8 activations (per-token scale) on the dispatch wire; combine stays exact
    timeout_s: float = 60.0  # a collective waiting longer than this fails the step (a rank died)
    # EPLB: extra expert slots for copies of hot experts (the slots, E + this, split evenly over the ranks)
    num_redundant_experts: int = 0
    rebalance_interval_steps: int = 0  # re-place experts from the measured load every this many steps (0: never)
    balance_objective: str = "tokens"  # balance tokens per rank, or "active_experts" (hit experts per rank)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"expert-parallel rank {self.rank} must be in [0, size={self.size})")
        if self.timeout_s <= 0:
            raise ConfigError("expert-parallel timeout must be positive")
        if min(self.num_redundant_experts, self.rebalance_interval_steps) < 0:
            raise ConfigError("redundant experts and the rebalance interval must be >= 0")
        if self.balance_objective not in ("tokens", "active_experts"):
            raise ConfigError(f"balance objective must be tokens or active_experts, not {self.balance_objective!r}")


@dataclass(frozen=True)
class AttentionFFNConfig:
    """Attention/FFN disaggregation (AFD): this engine is attention worker `index` of its deployment; every MoE
    layer's routed experts live in an expert pool of separate expert workers (`experts`: their exchange
    addresses, in pool-rank order), to which each layer's rows go and from which their outputs come back. A
    decode step's batch runs as `micro_batches` micro-batches in a ping-pong: while the experts compute one,
    attention computes the next."""

    experts: tuple[str, ...]  # tcp://host:port of each expert worker's exchange socket
    index: int = 0  # this attention worker's index (spreads its tokens over a hot expert's copies)
    micro_batches: int = 1  # 0: auto, chosen per step from measured step times (`engine/micro_batches.py`)
    timeout_s: float = 30.0  # an expert worker silent for this long fails the step (it died)
    shared_memory: bool = True  # same-host expert workers: rows through owner-only shm slots, not in frames
    encrypt: bool = False  # the exchange sockets CURVE-encrypted (--encrypt-traffic), keys from the cluster secret
    # EPLB in the expert pool (attention worker 0 plans): re-place the experts every this many busy steps (0: never)
    rebalance_interval_steps: int = 0
    balance_objective: str = "tokens"  # as ExpertParallelConfig's

    def __post_init__(self) -> None:
        if self.rebalance_interval_steps < 0 or self.balance_objective not in ("tokens", "active_experts"):
            raise ConfigError("the expert pool's rebalance interval must be >= 0 and its objective tokens or "
                              "active_experts")
        if not self.experts:
            raise ConfigError("attention/FFN disaggregation needs at least one expert worker")
        if self.micro_batches < 0:
            raise ConfigError(f"micro-batches must be >= 1, or 0 for auto, not {self.micro_batches}")
        if self.timeout_s <= 0 or self.index < 0:
            raise ConfigError("the expert pool's timeout must be positive and the attention index >= 0")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything one engine needs; `max_model_len` is resolved against the model."""

    model: str
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16"
    max_model_len: int | None = None
    num_threads: int | None = None
    compile: bool = False
    kernels: bool = True  # kvbaton's C CPU kernels (built on first use); False: PyTorch ops only
    compute_path: str = "auto"  # a row of kvbaton.platform.compute's table; auto: chosen by the CPU
    deterministic: bool = False  # batch-invariant kernels: greedy output independent of batching
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_store: KVStoreConfig = field(default_factory=KVStoreConfig)
    expert_parallel: ExpertParallelConfig | None = None
    attention_ffn: AttentionFFNConfig | None = None  # this engine attends; its MoE layers' experts live elsewhere
    expert_load_window_steps: int = 1000  # MoE: the expert load statistics (and EPLB) cover this many steps
    step_trace_dir: str | None = None  # each step's shape and seconds, appended to <dir>/steps-<pid>.jsonl

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype must be auto, float32 or bfloat16, not {self.dtype!r}")
        if self.expert_load_window_steps < 1:
            raise ConfigError("expert_load_window_steps must be >= 1")
        if self.attention_ffn is not None and self.expert_parallel is not None:
            raise ConfigError("an attention worker's experts live in its expert pool: expert parallelism is the "
                              "pool's (--expert-workers), not the attention worker's")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len must be >= 1")
        if self.deterministic and self.compile:
            raise ConfigError("--deterministic runs kvbaton's batch-invariant kernels; torch.compile would replace "
                              "them: leave --compile off")
        if self.kv_store.enabled and not self.cache.enable_prefix_caching:
            raise ConfigError("the KV store names blocks by the prefix cache's hashes: leave prefix caching on")
        if not self.kernels and self.compute_path not in ("auto", "torch"):
            raise ConfigError(f"compute path {self.compute_path!r} needs the C kernels, which kernels=False turns off")
