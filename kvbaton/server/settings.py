"""What `kvbaton serve` was told about its HTTP frontend (keys, limits, defaults): a plain frozen record, importable
without the HTTP stack, so `kvbaton serve` checks it before any worker starts and imports FastAPI while they do."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbaton.config import ConfigError
from kvbaton.mm.images import ImageLimits
from kvbaton.sched.sampling_params import INT64_MAX, MAX_N
from kvbaton.server.admission import AdmissionLimits
from kvbaton.text.generation_config import GenerationDefaults

KEYED_PRIORITY_RANGE = 10**6  # client priorities behind an API key, unless --max-priority-range says otherwise


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None  # /v1/*
    admin_api_key: str | None = None  # /admin/*, /workers (see guards.AdminAccess)
    bind_host: str = "127.0.0.1"
    admission: AdmissionLimits = AdmissionLimits()
    retry_after_s: int = 1
    max_request_bytes: int = 4 * 2**20
    # NOTE: a client may ask to be served before others, but only by so much: |priority| <= this (0: client
    # priorities are refused, everyone is equal). None: 0 without an API key, where any client could jump the
    # queue, and KEYED_PRIORITY_RANGE behind one, where the clients are known.
    max_priority_range: int | None = None
    max_workers: int = 16
    max_n: int = 16  # choices per request (n); more is a 400
    # choices x max_tokens x (1 + top logprobs) per request (see output_budget); None: its default for the model
    max_request_output_tokens: int | None = None
    # the model's recommended sampling settings: the fields a request leaves unset take these
    generation_defaults: GenerationDefaults = GenerationDefaults()
    max_kv_session_bytes: int = 2**30  # POST /admin/kv/restore's body: a session file
    # signs KV session files (the deployment's cluster secret; None: sessions are unavailable)
    kv_session_secret: bytes | None = field(default=None, repr=False)
    images: ImageLimits = field(default_factory=ImageLimits)  # vision-language models: what a request's images may be

    def __post_init__(self) -> None:
        if min(self.max_request_bytes, self.max_kv_session_bytes) < 1024:
            raise ConfigError("max_request_bytes and max_kv_session_bytes must be >= 1024")
        if self.max_priority_range is not None and not 0 <= self.max_priority_range <= INT64_MAX:
            raise ConfigError("max_priority_range must be in [0, 2**63)")
        if self.max_workers < 1:
            raise ConfigError("max_workers must be >= 1")
        if self.max_request_output_tokens is not None and self.max_request_output_tokens < 1:
            raise ConfigError("max_request_output_tokens must be >= 1")
        if not 1 <= self.max_n <= MAX_N:
            raise ConfigError(f"max_n must be in [1, {MAX_N}]")

    @property
    def priority_range(self) -> int:
        if self.max_priority_range is not None:
            return self.max_priority_range
        return KEYED_PRIORITY_RANGE if self.api_key else 0
