"""Prompts to token ids off the event loop, the cheap length checks before the expensive work.

Tokenizing a few MB of text takes seconds of CPU; on the event loop it would stall every stream
the server is sending. The HF fast tokenizer encodes in Rust with the GIL released and is safe to
call from several threads as long as none changes its truncation / padding (nothing here does),
so templating and encoding run in a small thread pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

from kvbaton.server.chat_encoding import ChatEncoder
from kvbaton.server.errors import ApiError
from kvbaton.text.tokenizer import Tokenizer

PROMPT_THREADS = 2
T = TypeVar("T")
R = TypeVar("R")


def max_token_bytes(tokenizer: Tokenizer) -> int:
    """An upper bound on the bytes of text one token stands for: its vocabulary string's UTF-8 length
    (byte-level BPE spells a byte with a 1-2 byte character, SentencePiece a space with 3 bytes and a
    fallback byte as `<0x0A>`: each spelling is at least as long as the text)."""
    return max((len(token.encode()) for token in tokenizer.backend.get_vocab()), default=1)


class PromptEncoder:
    """Chat templating and tokenization, bounded by the context before they run."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # NOTE: a text of c characters has at least c bytes, and a prompt that fits has fewer than
        # max_model_len tokens, each at most max_token_bytes long: anything longer cannot fit. (Sound for
        # tokenizers that keep every character, as byte-level BPE and SentencePiece do.)
        self.max_chars = max_model_len * max_token_bytes(tokenizer)
        self.chat_encoder = ChatEncoder(tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=PROMPT_THREADS, thread_name_prefix="kvbaton-prompt")

    async def completion(self, prompt: str | list[int],
                         add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, list):
            if len(prompt) >= self.max_model_len:
                raise ApiError(400, f"prompt has {len(prompt)} tokens but the model's context length is "
                                    f"{self.max_model_len}", "BadRequestError", "prompt")
            return None, prompt
        self._check_chars(prompt, "prompt")
        return prompt, await self._run(partial(self.tokenizer.encode, add_special_tokens=add_special_tokens), prompt)

    async def chat(self, messages: list[dict], add_generation_prompt: bool = True,
                   add_special_tokens: bool = True, tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """The rendered chat and its token ids, in which message text cannot forge special tokens (`ChatEncoder`)."""
        template = partial(self.tokenizer.apply_chat_template, add_generation_prompt=add_generation_prompt,
                           tools=tools)
        text = await self._run(template, messages)
        self._check_chars(text, "messages")
        encode = partial(self.chat_encoder.encode, text, tools=tools, render=template,
                         add_special_tokens=add_special_tokens)
        return text, await self._run(encode, messages)

    async def decode(self, token_ids: list[int]) -> str:
        """Token ids back to text, special tokens kept (the caller bounds their number and range)."""
        return await self._run(partial(self.tokenizer.decode, skip_special_tokens=False), token_ids)

    def _check_chars(self, text: str, param: str) -> None:
        if len(text) > self.max_chars:
            raise ApiError(400, f"{param} has {len(text)} characters, more than the {self.max_chars} that could "
                                f"fit in the model's context of {self.max_model_len} tokens", "BadRequestError",
                           param)

    async def _run(self, fn: Callable[[T], R], arg: T) -> R:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, arg)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
