"""`POST /tokenize`, `POST /detokenize` and `GET /version`, beside /v1 as vLLM serves them.

Text goes through the server's own `PromptEncoder`, so `/tokenize` answers with the very ids a
generation request with the same prompt or messages would be given (its `count` is what that
request would be charged), computed off the event loop within the same length bounds.

    POST /tokenize    {"prompt": "Hi"}                   -> {"count": 1, "max_model_len": 1024, "tokens": [6004]}
                      {"messages": [...], "add_generation_prompt": true}
    POST /detokenize  {"tokens": [6004]}                 -> {"prompt": "Hi"}
    GET  /version                                        -> {"version": "0.1.0"}
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator

from kvbaton import __version__
from kvbaton.mm.images import ImageDecoder, ImageHold
from kvbaton.mm.placeholders import Placeholders
from kvbaton.sched.sampling_params import InvalidRequestError
from kvbaton.server.errors import ApiError, decoded_images
from kvbaton.server.guards import bearer_matches
from kvbaton.server.prompts import PromptEncoder
from kvbaton.server.protocol import ChatMessage, TokenIds, plain_messages, utf8_text


class TokenizeRequest(BaseModel):
    """Either `prompt` (text, as /v1/completions takes it) or `messages` (a chat, as /v1/chat/completions)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: Annotated[bool, Strict()] = True
    # NOTE: default True, as this server encodes every prompt for generation (vLLM's chat default is
    # False because its chat path encodes without them; either way the default is what generation uses).
    add_special_tokens: Annotated[bool, Strict()] = True

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, prompt: str | None) -> str | None:
        return None if prompt is None else utf8_text(prompt, "prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: TokenIds  # strict ints: `true` or `"5"` is refused by name; the vocabulary range is checked below


@dataclass(frozen=True)
class Tokenization:
    """The two endpoints' work, on the server's encoder and its model check."""

    prompts: PromptEncoder
    check_model: Callable[[str | None], None]
    placeholders: Placeholders | None = None  # a vision-language model's image placeholders
    images: ImageDecoder | None = None  # for placeholders that depend on an image's size (a tile grid)

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give either prompt (a text) or messages (a chat), not both nor neither",
                           "BadRequestError", "messages" if req.messages is not None else "prompt")
        if req.messages is not None:
            param = "messages"
            # NOTE: an image counts as the placeholders it will take: LLaVA's do not depend on its pixels (none
            # is decoded), a tile grid's on its size (decoded as a generation request's, in the same bounds)
            urls = [url for m in req.messages for url in m.image_urls]
            if urls and self.placeholders is None:
                raise ApiError(400, "this model does not take images", "BadRequestError", "messages")
            sizes = await self._sizes(urls)
            messages = [{"role": m["role"], "content": m["content"]} for m in plain_messages(req.messages)]
            _, ids = await self.prompts.chat(messages, req.add_generation_prompt, req.add_special_tokens)
            if urls and self.placeholders is not None:
                try:
                    ids = self.placeholders.expand(ids, sizes)
                except InvalidRequestError as exc:
                    raise ApiError(400, str(exc), "BadRequestError", "messages") from None
        else:
            param = "prompt"
            _, ids = await self.prompts.completion(req.prompt or "", req.add_special_tokens)
        limit = self.prompts.max_model_len
        if len(ids) > limit:
            raise ApiError(400, f"{param} has {len(ids)} tokens, more than the model's context length of {limit}",
                           "BadRequestError", param)
        return {"count": len(ids), "max_model_len": limit, "tokens": ids}

    async def _sizes(self, urls: list[str]) -> list[tuple[int, int]]:
        """Each image's (width, height) where its placeholders depend on it, else (0, 0)s."""
        if not urls or self.placeholders is None or not self.placeholders.need_sizes or self.images is None:
            return [(0, 0)] * len(urls)
        hold = ImageHold(self.images)
        try:
            decoded = await decoded_images(self.images, urls, hold)
        finally:
            hold.release()
        return [(im.width, im.height) for im in decoded]

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, str]:
        self.check_model(req.model)
        limit, vocab_size = self.prompts.max_model_len, self.prompts.tokenizer.vocab_size
        if len(req.tokens) > limit:
            raise ApiError(400, f"tokens has {len(req.tokens)} ids, more than the model's context length of {limit}",
                           "BadRequestError", "tokens")
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"tokens[{bad}] = {_clipped(req.tokens[bad])} is not a token id of this model: "
                                f"ids are in [0, {vocab_size})", "BadRequestError", "tokens")
        return {"prompt": await self.prompts.decode(req.tokens)}


def _clipped(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} digits)"


def add_tokenize_routes(app: FastAPI, work: Tokenization, api_key: str | None) -> None:
    """`/tokenize`, `/detokenize` (behind the API key) and `/version` on `app`, doing `work`."""
    # NOTE: vLLM checks --api-key only on paths under /v1, so its /tokenize and /detokenize are open to
    # anyone who reaches the port. Here they need the key: they run the chat template and the tokenizer on
    # up to --max-request-bytes of text in the same two threads that encode prompts for generation, so an
    # unauthenticated client could slow every authorized request. /version stays open, as /health and
    # /metrics do: it costs nothing and tells a probe what is running.
    keyed = _key_required(api_key)

    @app.post("/tokenize", dependencies=keyed)
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return await work.tokenize(req)

    @app.post("/detokenize", dependencies=keyed)
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        return await work.detokenize(req)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}


def _key_required(api_key: str | None) -> list[Any]:
    """Route dependencies that refuse a request without `Authorization: Bearer API_KEY` (none without a key)."""
    if not api_key:
        return []

    def require_key(request: Request) -> None:
        if not bearer_matches(request.headers, api_key):
            raise ApiError(401, "invalid or missing API key", "AuthenticationError")

    return [Depends(require_key)]
