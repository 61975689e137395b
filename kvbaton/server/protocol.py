"""OpenAI request schemas (pydantic, validated by FastAPI) and their mapping to SamplingParams.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do; known fields are
type- and range-checked so a bad value gets a 400 naming the field. Integers are strict (a JSON
`true` is not 1, `"16"` is not 16) and floats finite, and every bound is one the engine, the wire
(msgpack carries signed 64-bit ints) and the event loop can carry.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator

from kvbaton.engine.info import MAX_STOP_TOKEN_IDS
from kvbaton.engine.sampling_params import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_CACHE_SALT_CHARS,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    SamplingParams,
)

# NOTE: OpenAI allows 4 stop sequences; each one is searched for in the text after every token, so
# their number and length bound per-token work. vLLM sets no limit; these are generous.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

Count = Annotated[int, Strict(), Field(ge=0, le=INT32_MAX)]
PositiveCount = Annotated[int, Strict(), Field(ge=1, le=INT32_MAX)]
TokenIds = list[Annotated[int, Strict()]]  # the vocabulary range is the engine's check


def utf8_text(value: str, what: str) -> str:
    """`value`, refused if it is not valid Unicode text (a JSON `\\ud800` decodes to a lone surrogate,
    which no tokenizer can encode)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode (a lone surrogate such as \\ud800)") from None
    return value


class StreamOptions(BaseModel):
    include_usage: Annotated[bool, Strict()] = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: PositiveCount | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=MIN_TOP_P, le=1.0)
    top_k: Annotated[int, Strict(), Field(ge=-1, le=INT32_MAX)] = 0
    n: Annotated[int, Strict(), Field(ge=1, le=1)] = 1
    seed: Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)] | None = None  # any int64, as vLLM
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: Annotated[bool, Strict()] = False
    min_tokens: Count = 0
    stream: Annotated[bool, Strict()] = False
    stream_options: StreamOptions | None = None
    # kvbaton/vLLM extension: lower is served first; the server narrows the range (--max-priority-range)
    priority: Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)] = 0
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    user: str | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, t: float) -> float:
        if 0.0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {t}")
        return t

    @field_validator("stop", mode="plain", json_schema_input_type=str | list[str] | None)
    @classmethod
    def _stop(cls, stop: Any) -> list[str] | None:
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must be non-empty and at most {MAX_STOP_CHARS} characters")
        return [utf8_text(s, "a stop string") for s in stops]

    @field_validator("cache_salt")
    @classmethod
    def _salt_text(cls, salt: str | None) -> str | None:
        return None if salt is None else utf8_text(salt, "cache_salt")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            cache_salt=self.cache_salt,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    # after validation: the text, or its token ids (one prompt per request)
    prompt: str | TokenIds
    max_tokens: PositiveCount | None = 16
    logprobs: Annotated[int, Strict(), Field(ge=0, le=20)] | None = None
    echo: Annotated[bool, Strict()] = False

    @field_validator("prompt", mode="plain", json_schema_input_type=str | list[int] | list[str] | list[list[int]])
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        """A string, a token list, or a batch of exactly one of either."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            raise ValueError("only one prompt per request is supported")
        if isinstance(prompt, str):
            return utf8_text(prompt, "prompt")
        if not isinstance(prompt, list) or not all(type(t) is int for t in prompt):
            raise ValueError("prompt must be a string, a list of token ids, or a list of one of either")
        if not prompt:
            raise ValueError("prompt is an empty token list")
        return prompt

    def sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None  # after validation: text parts joined

    @field_validator("content", mode="plain", json_schema_input_type=str | list[dict[str, Any]] | None)
    @classmethod
    def _text_content(cls, content: Any) -> str | None:
        """A string, None, or a list of `{"type": "text", "text": ...}` parts (joined)."""
        if content is None or isinstance(content, str):
            return None if content is None else utf8_text(content, "content")
        if not isinstance(content, list):
            raise ValueError("content must be a string, a list of content parts, or null")
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content part {i}: type {str(kind)[:40]!r} is not supported (only 'text')")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i}: text must be a string")
            texts.append(utf8_text(part["text"], f"content part {i}"))
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveCount | None = None
    logprobs: Annotated[bool, Strict()] = False
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=20)] | None = None

    def sampling_params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(self.max_completion_tokens or self.max_tokens, logprobs)

    def plain_messages(self) -> list[dict]:
        """Messages as the chat template takes them: role and text only."""
        return [{"role": m.role, "content": m.content or ""} for m in self.messages]


class AddWorkerRequest(BaseModel):
    """`POST /admin/workers`."""

    role: Literal["prefill", "decode"]
    timeout_s: float = Field(default=600.0, gt=0.0, le=3600.0, allow_inf_nan=False)


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
