"""Frozen, validated configuration dataclasses.

Each config describes one resource; they are built once (from a checkpoint's config.json
or from user arguments) and never mutated afterwards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ConfigError(ValueError):
    """A configuration or checkpoint that kvbaton cannot serve; the message says why."""


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (`rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a decoder-only transformer, as read from an HF `config.json`."""

    architecture: str  # "llama" | "qwen2" | "qwen3"
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
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if min(self.hidden_size, self.num_hidden_layers, self.vocab_size, self.head_dim) < 1:
            raise ConfigError("model dimensions must be positive")

    @classmethod
    def from_hf_dict(cls, hf: dict) -> ModelConfig:
        arch_names = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in arch_names if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise ConfigError(f"unsupported architecture {arch_names or '(none)'}; supported: {supported}")
        text = hf.get("text_config") or hf
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
            rope_scaling=_parse_rope_scaling(text.get("rope_scaling") or rope_params),
            attention_bias=arch == "qwen2" or bool(text.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            bos_token_id=text.get("bos_token_id", hf.get("bos_token_id")),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in model directory {model_dir}")
        try:
            return cls.from_hf_dict(json.loads(path.read_text()))
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: missing or invalid field {exc}") from exc


def _parse_rope_scaling(raw: dict) -> RopeScaling | None:
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ConfigError(f"unsupported rope scaling type {kind!r}; supported: default, llama3")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )


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

    def __post_init__(self) -> None:
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
    disk: a directory of checksummed block files, bounded, kept across restarts (L3); one per worker.
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


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of continuous batching."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # >0: cap one request's prefill chunk per step

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")


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

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype must be auto, float32 or bfloat16, not {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len must be >= 1")
        if self.deterministic and self.compile:
            raise ConfigError("--deterministic runs kvbaton's batch-invariant kernels; torch.compile would replace "
                              "them: leave --compile off")
        if self.kv_store.enabled and not self.cache.enable_prefix_caching:
            raise ConfigError("the KV store names blocks by the prefix cache's hashes: leave prefix caching on")
        if not self.kernels and self.compute_path not in ("auto", "torch"):
            raise ConfigError(f"compute path {self.compute_path!r} needs the C kernels, which kernels=False turns off")
