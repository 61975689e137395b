"""A model as a cost model sees it: parameter counts, weight and KV bytes, FLOPs per token.

Built from an HF `config.json` (through `kvbaton.config.ModelConfig`, so one parser reads every checkpoint) or
from a named preset of public configs. Nothing here runs a model; `roofline.py` turns these numbers into seconds.

KV bytes per token, all layers, K and V:
  GQA  2 x layers x kv_heads x head_dim x bytes (+ a 4-byte scale per token, layer, head and component for
       kvbaton's quantized pools)
  MLA  layers x (kv_lora_rank + qk_rope_head_dim) x bytes: one latent and one RoPE key shared by every head
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from kvbaton.config import ConfigError, MLAConfig, ModelConfig, MoEConfig


class Dtype(str, Enum):
    """How weights (or activations) are stored."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bytes(self) -> float:
        return {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}[self.value]


class KVDtype(str, Enum):
    """How the KV cache holds K and V.

    `fp8` is a GPU engine's fp8 cache (vLLM, TensorRT-LLM): one byte per element, one scale per tensor, so its
    bytes are exactly half of fp16's. `fp8_e4m3` and `int8` are kvbaton's pools: one byte per element plus an
    fp32 scale per token and head (`kvbaton.kv.layout.SCALE_BYTES`), 51.6% of bf16 at head_dim 128."""

    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    FP8_E4M3 = "fp8_e4m3"
    INT8 = "int8"

    @property
    def element_bytes(self) -> int:
        return 2 if self in (KVDtype.FP16, KVDtype.BF16) else 1

    @property
    def scale_bytes(self) -> int:
        """Bytes of scale per token, layer, head and component (K or V)."""
        return 4 if self in (KVDtype.FP8_E4M3, KVDtype.INT8) else 0


def parse_dtype(value: str) -> Dtype:
    try:
        return Dtype(value)
    except ValueError:
        raise ConfigError(f"unknown weight dtype {value!r}; choose one of {', '.join(d.value for d in Dtype)}") \
            from None


def parse_kv_dtype(value: str) -> KVDtype:
    try:
        return KVDtype(value)
    except ValueError:
        raise ConfigError(f"unknown KV dtype {value!r}; choose one of {', '.join(d.value for d in KVDtype)}") \
            from None


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    num_experts: int
    top_k: int
    moe_intermediate_size: int  # of one routed expert
    shared_intermediate_size: int = 0  # all shared experts together (DeepSeek: n_shared_experts x expert size)
    num_dense_layers: int = 0  # layers that keep a dense MLP (DeepSeek's first_k_dense_replace)

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts or self.moe_intermediate_size < 1 or self.num_dense_layers < 0:
            raise ConfigError("MoE: need 1 <= top_k <= num_experts, a positive expert size, dense layers >= 0")


@dataclass(frozen=True, kw_only=True)
class MLASpec:
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q comes from the hidden state directly

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Elements cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The dimensions that decide a decoder-only transformer's memory and FLOPs."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # of the dense MLP (the dense layers' of an MoE model)
    vocab_size: int
    tie_word_embeddings: bool = False
    moe: MoESpec | None = None
    mla: MLASpec | None = None

    def __post_init__(self) -> None:
        dims = (self.num_layers, self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                self.intermediate_size, self.vocab_size)
        if min(dims) < 1:
            raise ConfigError(f"model {self.name!r}: every dimension must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model {self.name!r}: heads must be a multiple of KV heads")
        if self.moe is not None and self.moe.num_dense_layers > self.num_layers:
            raise ConfigError(f"model {self.name!r}: more dense layers than layers")

    # -- parameters -------------------------------------------------------------------------------------------

    @property
    def attention_params(self) -> int:
        """One layer's attention projections and norms."""
        h = self.hidden_size
        if self.mla is None:
            q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return h * q_out + 2 * h * kv_out + q_out * h + 2 * h
        m = self.mla
        q_out = self.num_heads * m.qk_head_dim
        q = h * q_out if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * q_out
        kv = h * m.latent_dim + m.kv_lora_rank + m.kv_lora_rank * self.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + self.num_heads * m.v_head_dim * h + 2 * h

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size  # gate, up, down

    @property
    def expert_params(self) -> int:
        """One routed expert (0 for a dense model)."""
        return 0 if self.moe is None else 3 * self.hidden_size * self.moe.moe_intermediate_size

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.moe is None else self.num_layers - self.moe.num_dense_layers

    @property
    def moe_always_on_params(self) -> int:
        """What every token of one MoE layer uses besides its routed experts: the router and the shared experts."""
        if self.moe is None:
            return 0
        return self.moe.num_experts * self.hidden_size + 3 * self.hidden_size * self.moe.shared_intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return self.embedding_params  # tied or not, the LM head is a [vocab, hidden] matmul

    @property
    def num_dense_mlp_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def shared_params(self) -> int:
        """Every parameter but the routed experts: read by every step whatever the batch."""
        untied_head = 0 if self.tie_word_embeddings else self.lm_head_params
        return (self.num_layers * self.attention_params + self.num_dense_mlp_layers * self.dense_mlp_params
                + self.num_moe_layers * self.moe_always_on_params + self.embedding_params + untied_head
                + self.hidden_size)

    @property
    def routed_expert_params(self) -> int:
        if self.moe is None:
            return 0
        return self.num_moe_layers * self.moe.num_experts * self.expert_params

    @property
    def total_params(self) -> int:
        return self.shared_params + self.routed_expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses: everything but the routed experts it does not pick."""
        top_k = 0 if self.moe is None else self.moe.top_k
        return self.shared_params + self.num_moe_layers * top_k * self.expert_params

    def weight_bytes(self, dtype: Dtype) -> float:
        return self.total_params * dtype.bytes

    # -- KV cache ---------------------------------------------------------------------------------------------

    def kv_bytes_per_token(self, kv_dtype: KVDtype) -> int:
        """One token's KV over all layers (see the module docstring)."""
        if self.mla is not None:
            # NOTE: MLA caches one latent row per token, no per-head split; a scale per row when quantized.
            return self.num_layers * (self.mla.latent_dim * kv_dtype.element_bytes + kv_dtype.scale_bytes)
        per_head = self.head_dim * kv_dtype.element_bytes + kv_dtype.scale_bytes
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def kv_shards(self) -> int:
        """How many ways TP can split one token's KV: by KV head (MLA's latent cannot be split)."""
        return 1 if self.mla is not None else self.num_kv_heads

    # -- FLOPs ------------------------------------------------------------------------------------------------

    @property
    def matmul_params_per_token(self) -> int:
        """Active parameters every token multiplies, without the embedding lookup and the LM head (which only
        a sequence's last scheduled token needs: engines compute logits for those rows only)."""
        untied_head = 0 if self.tie_word_embeddings else self.lm_head_params
        return self.active_params - self.embedding_params - untied_head

    def attention_flops_per_position(self, *, decode: bool) -> int:
        """FLOPs of QK^T and PV for one query token against one cached position, all layers.

        GQA: 4 x layers x heads x head_dim. MLA decodes in the absorbed form (FlashMLA: q.latent over
        kv_lora_rank + rope dims, p.latent over kv_lora_rank) and prefills in the expanded form (qk_head_dim
        and v_head_dim per head)."""
        if self.mla is None:
            return 4 * self.num_layers * self.num_heads * self.head_dim
        m = self.mla
        per_head = m.latent_dim + m.kv_lora_rank if decode else m.qk_head_dim + m.v_head_dim
        return 2 * self.num_layers * self.num_heads * per_head

    def flops_per_token(self, context: int) -> float:
        """One token's forward FLOPs at `context` attended positions: 2 x active params + attention."""
        return 2.0 * self.active_params + context * self.attention_flops_per_position(decode=True)

    # -- construction -----------------------------------------------------------------------------------------

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, name: str) -> ModelSpec:
        return cls(name=name, num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                   num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                   intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                   tie_word_embeddings=cfg.tie_word_embeddings, moe=_moe_spec(cfg.moe), mla=_mla_spec(cfg.mla))

    @classmethod
    def from_hf_dict(cls, hf: dict, name: str = "config.json") -> ModelSpec:
        # NOTE: a plan only needs shapes, so a quantized checkpoint's config (DeepSeek-V3 ships FP8) is read
        # without its quantization_config, which the serving parser refuses
        stripped = {k: v for k, v in hf.items() if k != "quantization_config"}
        if isinstance(stripped.get("text_config"), dict):
            stripped["text_config"] = {k: v for k, v in stripped["text_config"].items() if k != "quantization_config"}
        try:
            return cls.from_model_config(ModelConfig.from_hf_dict(stripped), name)
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"{name}: missing or invalid field {exc}") from exc

    @classmethod
    def from_file(cls, path: str | Path) -> ModelSpec:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            hf = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read a model config from {path}: {exc}") from exc
        if not isinstance(hf, dict):
            raise ConfigError(f"{path}: a config.json holds a JSON object")
        return cls.from_hf_dict(hf, name=str(p.parent.name if p.name == "config.json" else p.stem) or str(p))


def _moe_spec(moe: MoEConfig | None) -> MoESpec | None:
    if moe is None:
        return None
    return MoESpec(num_experts=moe.num_experts, top_k=moe.top_k, moe_intermediate_size=moe.intermediate_size,
                   shared_intermediate_size=moe.shared_intermediate_size, num_dense_layers=len(moe.dense_layers))


def _mla_spec(mla: MLAConfig | None) -> MLASpec | None:
    if mla is None:
        return None
    return MLASpec(kv_lora_rank=mla.kv_lora_rank, qk_rope_head_dim=mla.qk_rope_head_dim,
                   qk_nope_head_dim=mla.qk_nope_head_dim, v_head_dim=mla.v_head_dim, q_lora_rank=mla.q_lora_rank)


def _hf(arch: str, **fields: object) -> dict:
    return {"architectures": [arch], **fields}


# The fields of each model's public config.json that shape its cost (the rest are left out).
_PRESET_CONFIGS: dict[str, dict] = {
    "llama-3-70b": _hf("LlamaForCausalLM", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "llama-3-8b": _hf("LlamaForCausalLM", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "smollm2-135m": _hf("LlamaForCausalLM", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "mixtral-8x7b": _hf("MixtralForCausalLM", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                        num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen3-30b-a3b": _hf("Qwen3MoeForCausalLM", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                         num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
                         mlp_only_layers=[], tie_word_embeddings=False),
    "deepseek-v3": _hf("DeepseekV3ForCausalLM", hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                       num_attention_heads=128, num_key_value_heads=128, vocab_size=129280, n_routed_experts=256,
                       num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3,
                       moe_layer_freq=1, n_group=8, topk_group=4, kv_lora_rank=512, q_lora_rank=1536,
                       qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False),
}
MODEL_PRESETS: tuple[str, ...] = tuple(_PRESET_CONFIGS)


def model_preset(name: str) -> ModelSpec:
    try:
        hf = _PRESET_CONFIGS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}, "
                          "or give a config.json path") from None
    return ModelSpec.from_hf_dict(hf, name=name)


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name, or a path to a config.json (or to the checkpoint directory holding it)."""
    if name_or_path in _PRESET_CONFIGS:
        return model_preset(name_or_path)
    if Path(name_or_path).exists():
        return ModelSpec.from_file(name_or_path)
    return model_preset(name_or_path)
