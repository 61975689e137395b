"""OpenAI request schemas (pydantic, validated by FastAPI) and their mapping to SamplingParams.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do; known fields are
type- and range-checked so a bad value gets a 400 naming the field. Integers are strict (a JSON
`true` is not 1, `"16"` is not 16) and floats finite, and every bound is one the engine, the wire
(msgpack carries signed 64-bit ints) and the event loop can carry.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvbaton.sched.grammar_spec import MAX_CHOICES, MAX_GRAMMAR_CHARS, StructuredOutput
from kvbaton.sched.info import MAX_STOP_TOKEN_IDS
from kvbaton.sched.sampling_params import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    InvalidRequestError,
    SamplingParams,
)
from kvbaton.server.tools import ToolFields, ToolMessageFields
from kvbaton.server.tools.scan import MAX_JSON_DEPTH, loads_json, nesting_depth

# NOTE: OpenAI allows 4 stop sequences; each one is searched for in the text after every token, so
# their number and length bound per-token work. vLLM sets no limit; these are generous.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
EMPTY: Mapping[str, float | int] = MappingProxyType({})
MAX_BATCH_PROMPTS = 64  # completions with a list of prompts; each is a request of its own in the engine

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


class JsonSchemaFormat(BaseModel):
    name: str = Field(default="schema", max_length=64)
    description: str | None = None
    # NOTE: OpenAI's field is `schema`; pydantic reserves the name, hence the alias.
    json_schema: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


def json_schema_spec(schema: dict[str, Any] | bool) -> StructuredOutput:
    """The schema as a spec, bounded in depth: grammar engines and the schema checks recurse over it."""
    if nesting_depth(schema, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise ValueError(f"the schema is nested more than {MAX_JSON_DEPTH} levels deep")
    return StructuredOutput.json_schema(schema)


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text, JSON mode (`json_object`), or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def spec(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput.json_schema({"type": "object"})
        if self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema")
        return json_schema_spec(self.json_schema.json_schema)


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` extension: exactly one of json / regex / choice / grammar / json_object."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1,
                                                                     max_length=MAX_CHOICES)
    grammar: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    json_object: bool | None = None

    def spec(self) -> StructuredOutput:
        given = [k for k in ("json_", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        if self.json_ is not None:
            schema = self.json_
            if isinstance(schema, str):
                try:
                    schema = loads_json(schema)
                except ValueError as exc:
                    raise ValueError(f"json is not a valid JSON schema text: {exc}") from None
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("json must be a JSON schema (an object)")
            return json_schema_spec(schema)
        if self.regex is not None:
            return StructuredOutput("regex", utf8_text(self.regex, "regex"))
        if self.choice is not None:
            return StructuredOutput.choice([utf8_text(c, "choice") for c in self.choice])
        if self.grammar is not None:
            return StructuredOutput("grammar", utf8_text(self.grammar, "grammar"))
        return StructuredOutput.json_schema({"type": "object"})


Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: PositiveCount | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=MIN_TOP_P, le=1.0)
    top_k: Annotated[int, Strict(), Field(ge=-1, le=INT32_MAX)] = 0
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] = 1  # the server's own cap: --max-n
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    prompt_logprobs: Annotated[int, Strict(), Field(ge=0, le=20)] | None = None  # vLLM's extension
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

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        # OpenAI's keys are token ids as strings ({"50256": -100}); the vocabulary range is the engine's check
        if bias is not None and not all(k.isascii() and k.isdigit() and len(k) <= 10 for k in bias):
            raise ValueError("logit_bias keys must be token ids (strings of digits)")
        return bias

    @model_validator(mode="after")
    def _one_structured_output(self) -> _SamplingFields:
        if self.response_format is not None and self.response_format.type != "text" and self.structured_outputs:
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def _prompt_logprobs(self, logprobs: int | None) -> int | None:
        return self.prompt_logprobs

    def structured_output(self) -> StructuredOutput | None:
        """What the output must match: `response_format` or vLLM's `structured_outputs`."""
        if self.structured_outputs is not None:
            try:
                return self.structured_outputs.spec()
            except ValueError as exc:
                raise InvalidRequestError(f"structured_outputs: {exc}", "structured_outputs") from None
        if self.response_format is not None:
            try:
                return self.response_format.spec()
            except ValueError as exc:
                raise InvalidRequestError(f"response_format: {exc}", "response_format") from None
        return None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         defaults: Mapping[str, float | int]) -> SamplingParams:
        """Fields the request leaves unset take the model's generation defaults (`--generation-config`)."""
        given = self.model_fields_set

        def pick(name: str, value: Any) -> Any:
            return value if name in given or name not in defaults else defaults[name]

        return SamplingParams(
            temperature=pick("temperature", self.temperature), top_p=pick("top_p", self.top_p),
            top_k=pick("top_k", self.top_k), min_p=pick("min_p", self.min_p),
            repetition_penalty=pick("repetition_penalty", self.repetition_penalty), seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=self._prompt_logprobs(logprobs),
            cache_salt=self.cache_salt, n=self.n, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            structured_output=self.structured_output(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    # after validation: a list of prompts, each its text or its token ids
    prompt: list[str | TokenIds]
    max_tokens: PositiveCount | None = 16
    logprobs: Annotated[int, Strict(), Field(ge=0, le=20)] | None = None
    echo: Annotated[bool, Strict()] = False
    suffix: str | None = None
    # NOTE: OpenAI's legacy field: `best_of` candidates, the `n` likeliest returned. Not implemented (vLLM's V1
    # engine dropped it too); accepted only where it changes nothing, refused rather than silently ignored.
    best_of: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] | None = None

    @field_validator("prompt", mode="plain", json_schema_input_type=str | list[int] | list[str] | list[list[int]])
    @classmethod
    def _prompts(cls, prompt: Any) -> list[str | list[int]]:
        """A string, a token list, or a batch (a list of either)."""
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(batch) > MAX_BATCH_PROMPTS:
            raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(batch)}")
        return [_one_prompt(p) for p in batch]

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:  # a fill-in-the-middle suffix needs a model trained for it; silently ignoring it would mislead
            raise ValueError("suffix is not supported")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _best_of_changes_nothing(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)  # validated before: a field of the base class
        if best_of is not None and best_of != n:
            raise ValueError(f"{best_of} candidates for n={n} is not supported; ask for n choices (with "
                             f"logprobs) and pick among them")
        return best_of

    def sampling_params(self, defaults: Mapping[str, float | int] = EMPTY) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs, defaults)

    def _prompt_logprobs(self, logprobs: int | None) -> int | None:
        """`echo` with `logprobs` reports the prompt's tokens' logprobs too (as OpenAI's legacy API does)."""
        if self.echo and logprobs is not None:
            return max(logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


def _one_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, str):
        return utf8_text(prompt, "prompt")
    if not isinstance(prompt, list) or not all(type(t) is int for t in prompt):
        raise ValueError("prompt must be a string, a list of token ids, or a list of either")
    if not prompt:
        raise ValueError("prompt is an empty token list")
    return prompt


class ChatMessage(ToolMessageFields):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None  # after validation: text parts joined
    # the message's `image_url` parts' URLs, in order, and (with any) its parts as a chat template takes them:
    # {"type": "text", "text": ...} and {"type": "image"} (private: no client sets them but through `content`)
    _image_urls: list[str] = PrivateAttr(default_factory=list)
    _template_parts: list[dict[str, Any]] | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _take_images(cls, data: Any, handler: Any) -> ChatMessage:
        """`image_url` parts (`{"type": "image_url", "image_url": {"url": ...}}`), once `_text_content` checked
        every part: their URLs in `_image_urls`, and the parts as a template takes them in `_template_parts`."""
        message = handler(data)
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list) and any(_is_image_part(p) for p in content):
            message._image_urls = [_image_url(p, i) for i, p in enumerate(content) if _is_image_part(p)]
            message._template_parts = [{"type": "image"} if _is_image_part(p) else {"type": "text", "text": p["text"]}
                                       for p in content]
        return message

    @property
    def image_urls(self) -> list[str]:
        return self._image_urls

    @field_validator("content", mode="plain", json_schema_input_type=str | list[dict[str, Any]] | None)
    @classmethod
    def _text_content(cls, content: Any) -> str | None:
        """A string, None, or a list of `{"type": "text", "text": ...}` parts (joined) and `image_url` parts
        (their URLs checked here, taken by `_take_images`)."""
        if content is None or isinstance(content, str):
            return None if content is None else utf8_text(content, "content")
        if not isinstance(content, list):
            raise ValueError("content must be a string, a list of content parts, or null")
        texts = []
        for i, part in enumerate(content):
            if _is_image_part(part):
                _image_url(part, i)
                continue
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"content part {i}: type {str(kind)[:40]!r} is not supported ('text' or "
                                 "'image_url')")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i}: text must be a string")
            texts.append(utf8_text(part["text"], f"content part {i}"))
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveCount | None = None
    logprobs: Annotated[bool, Strict()] = False
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=20)] | None = None

    def sampling_params(self, defaults: Mapping[str, float | int] = EMPTY) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        if max_tokens is None:  # the model's bound (generation_config's max_new_tokens), else the context
            max_tokens = defaults.get("max_tokens")  # type: ignore[assignment]
        return self._sampling_params(max_tokens, logprobs, defaults)

    def plain_messages(self) -> list[dict]:
        return plain_messages(self.messages)

    def image_urls(self) -> list[str]:
        """Every message's images, in the order the prompt holds them."""
        return [url for m in self.messages for url in m.image_urls]


MAX_IMAGE_URL_CHARS = 64 * 2**20  # a data: URL's base64 (the request body's own bound comes first)


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _image_url(part: dict, index: int) -> str:
    """An `image_url` part's URL: `{"image_url": {"url": ...}}` (OpenAI) or `{"image_url": "..."}`."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ValueError(f"content part {index}: image_url needs a url (a data: URL or an http(s) URL)")
    if len(url) > MAX_IMAGE_URL_CHARS:
        raise ValueError(f"content part {index}: the image URL is over {MAX_IMAGE_URL_CHARS} characters")
    return url


def plain_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them: role, text (a message with images: its parts, each image a
    `{"type": "image"}` part), and the tool parts of the history."""
    out = []
    for m in messages:
        parts = m._template_parts
        message: dict[str, Any] = {"role": m.role, "content": parts if parts is not None else m.content or ""}
        if m.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


class AddWorkerRequest(BaseModel):
    """`POST /admin/workers`."""

    role: Literal["prefill", "decode", "encode"]
    timeout_s: float = Field(default=600.0, gt=0.0, le=3600.0, allow_inf_nan=False)


class KVSaveRequest(BaseModel):
    """`POST /admin/kv/save`: whose KV to save: a completion prompt (text or token ids), or a chat's messages so
    far (rendered without the generation prompt, so the next turn's prompt starts with them)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | TokenIds | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @model_validator(mode="after")
    def _one_source(self) -> KVSaveRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None:
            _one_prompt(self.prompt)
        if self.cache_salt is not None:
            utf8_text(self.cache_salt, "cache_salt")
        return self


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
