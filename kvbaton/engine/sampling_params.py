"""Per-request sampling parameters, named as in vLLM so users can switch without edits."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message names the offending field."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is always included)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # NOTE: `stop` is declared as the forms callers may pass; from here on it is always a list.
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop = stop
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate(stop)

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as the list `__post_init__` made of it."""
        assert isinstance(self.stop, list)
        return self.stop

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def _validate(self, stop: list[str]) -> None:
        checks = [
            (self.n == 1, "n: only n=1 is supported"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}"),
            (all(isinstance(s, str) and s for s in stop), "stop strings must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
