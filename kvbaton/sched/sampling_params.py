"""Per-request sampling parameters, named as in vLLM so users can switch without edits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvbaton.sched.grammar_spec import StructuredOutput

# NOTE: below this, `logits / temperature` can overflow float32 to inf, and softmax of inf is NaN, which
# `torch.multinomial` refuses: 1e-39 took an engine down. vLLM clamps below 1e-2 with a warning; we refuse.
MIN_TEMPERATURE = 1e-2
# NOTE: a positive top_p as small as 5e-324 (a subnormal) reached a worker as 0.0 (a CPU flushing subnormals
# to zero) and was refused there, after the router had accepted it; below this floor top_p keeps one token.
MIN_TOP_P = 1e-8
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what msgpack (and a torch.Generator seed) carries signed
INT32_MAX = 2**31 - 1  # token counts and top_k: far above any context, far below any overflow
MAX_CACHE_SALT_CHARS = 256
MAX_N = 128  # the frontend's own cap (--max-n) is at most this
MAX_LOGIT_BIAS = 1024  # entries; OpenAI allows 300. Each is one scatter into the row's logits per step.
MAX_PENALTY = 2.0  # presence / frequency, as OpenAI
MAX_REPETITION_PENALTY = 100.0  # any positive finite value is well defined; past this it is only a way to overflow
# and the same below 1: a seen token's logit is divided by it (5e-324 turned logits into inf and the sampler's
# probabilities into NaN, failing the step)
MIN_REPETITION_PENALTY = 1.0 / MAX_REPETITION_PENALTY


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
    # top-N logprobs of each prompt token after the first (vLLM's); the prompt is then computed in full,
    # without prefix-cache hits, since a cached block has no logits
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's request field: requests with different salts never share prefix-cache blocks (so one
    # tenant cannot probe another's prompts by timing). It travels with the params to every worker.
    cache_salt: str | None = None
    # OpenAI's penalties on the tokens generated so far: logit -= presence * (count > 0) + frequency * count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' / vLLM's, over prompt and output tokens: a seen token's logit divided by it (multiplied if < 0)
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top token's (after temperature)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] as OpenAI
    structured_output: StructuredOutput | None = None  # a grammar every sampled token must obey
    # NOTE: set by the router when a request resumes on another worker: the last this-many prompt tokens are
    # output of an earlier attempt, so penalties count them as generated and the grammar has matched them.
    resumed_output_tokens: int = 0

    def __post_init__(self) -> None:
        # NOTE: `stop` is declared as the forms callers may pass; from here on it is always a list.
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop = stop
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logit_bias, dict):
            try:  # JSON object keys are strings: OpenAI sends {"50256": -100}
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(f"logit_bias maps token ids to numbers: {exc}", "logit_bias") from None
        self._validate(stop)

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as the list `__post_init__` made of it."""
        assert isinstance(self.stop, list)
        return self.stop

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def _validate(self, stop: list[str]) -> None:
        t = self.temperature
        checks = [
            (isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", f"n must be in [1, {MAX_N}], got {self.n}"),
            (isinstance(t, (int, float)) and (t == 0.0 or MIN_TEMPERATURE <= t), "temperature",
             f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {t}"),
            (MIN_TOP_P <= self.top_p <= 1.0, "top_p", f"top_p must be in [{MIN_TOP_P}, 1], got {self.top_p}"),
            (-1 <= self.top_k <= INT32_MAX, "top_k",
             f"top_k must be -1, 0 (disabled) or a positive count <= {INT32_MAX}, got {self.top_k}"),
            (self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "seed", "seed must fit in a signed 64-bit int"),
            (self.max_tokens is None or 1 <= self.max_tokens <= INT32_MAX, "max_tokens",
             f"max_tokens must be in [1, {INT32_MAX}], got {self.max_tokens}"),
            (0 <= self.min_tokens <= INT32_MAX, "min_tokens", f"min_tokens must be in [0, {INT32_MAX}]"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", f"logprobs must be >= 0, got {self.logprobs}"),
            (self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
             "prompt_logprobs", f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}"),
            (all(isinstance(s, str) and s for s in stop), "stop", "stop strings must be non-empty strings"),
            (all(isinstance(t, int) and 0 <= t <= INT64_MAX for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be token ids"),
            (self.cache_salt is None or (isinstance(self.cache_salt, str)
                                         and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS), "cache_salt",
             f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"),
            (_in_range(self.presence_penalty, -MAX_PENALTY, MAX_PENALTY), "presence_penalty",
             f"presence_penalty must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {self.presence_penalty}"),
            (_in_range(self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY), "frequency_penalty",
             f"frequency_penalty must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {self.frequency_penalty}"),
            (_in_range(self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
             "repetition_penalty",
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
             f"got {self.repetition_penalty}"),
            (_in_range(self.min_p, 0.0, 1.0), "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (self.logit_bias is None or (isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS
                                         and all(_in_range(v, -100.0, 100.0) for v in self.logit_bias.values())),
             "logit_bias", f"logit_bias: at most {MAX_LOGIT_BIAS} token ids, each biased by a value in [-100, 100]"),
            (self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
             "structured_outputs", "structured_output must be a StructuredOutput"),
            (isinstance(self.resumed_output_tokens, int) and 0 <= self.resumed_output_tokens <= INT32_MAX,
             "resumed_output_tokens", "resumed_output_tokens must be a token count"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param)


def _in_range(value: object, low: float, high: float) -> bool:
    # NOTE: NaN compares false with everything, so it fails here as it should; bools are not numbers here.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and low <= value <= high
