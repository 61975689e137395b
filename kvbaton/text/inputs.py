"""Normalize the prompt forms users pass (text, token ids, vLLM-style dicts) to token ids."""

from __future__ import annotations

from kvbaton.sched.sampling_params import InvalidRequestError
from kvbaton.text.tokenizer import Tokenizer

PromptType = str | list[int] | dict


def tokenize_prompt(tokenizer: Tokenizer, prompt: PromptType) -> tuple[str | None, list[int]]:
    """Returns (prompt text if known, prompt token ids)."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], tokenizer.encode(prompt["prompt"])
        raise InvalidRequestError("prompt dict needs 'prompt' (str) or 'prompt_token_ids' (list of int)")
    if isinstance(prompt, list):
        return None, list(prompt)
    raise InvalidRequestError(f"prompt must be a string, a token id list or a dict, not {type(prompt).__name__}")
