"""The checkpoint's tokenizer and chat template (HF `transformers` / `tokenizers`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from kvbaton.config import ConfigError, ModelConfig
from kvbaton.text.generation_config import generation_eos_token_ids


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        if not (Path(model_dir) / "tokenizer.json").is_file() and not (Path(model_dir) / "tokenizer.model").is_file():
            raise ConfigError(f"no tokenizer (tokenizer.json) in model directory {model_dir}")
        self.model_dir = Path(model_dir)
        self.hf = _hf_tokenizer(self.model_dir)
        self.backend = self.hf.backend_tokenizer
        self.vocab_size = len(self.hf)
        self._token_texts: dict[int, str] = {}

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return _one_text(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """`tools`: OpenAI function definitions, for a template that renders them itself."""
        if not self.hf.chat_template:
            raise ConfigError("this model's tokenizer has no chat template")
        return _one_text(self.hf.apply_chat_template(messages, tokenize=False, tools=list(tools) if tools else None,
                                                     add_generation_prompt=add_generation_prompt))

    def token_text(self, token_id: int) -> str:
        """One token's text. NOTE: cached (at most one entry per vocabulary id): logprobs look up 1 + top N tokens
        per position, and a decode call costs more than rendering the rest of the entry."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = _one_text(self.hf.decode([token_id]))
        return text

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        """Incremental detokenizer: yields text only once it no longer changes (UTF-8 safe)."""
        return DecodeStream(skip_special_tokens=skip_special_tokens)


# The classes transformers builds straight from tokenizer.json (PreTrainedTokenizerFast is an alias of the other).
_TOKENIZERS_BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _hf_tokenizer(model_dir: Path) -> Any:
    """transformers' tokenizer of `model_dir`.

    NOTE: a checkpoint whose tokenizer_config names transformers' tokenizers-backed class gets that class itself:
    `AutoTokenizer` imports torch (~2.4 s, and the HTTP process runs without it) to build the very same object."""
    config = model_dir / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if name in _TOKENIZERS_BACKEND_CLASSES and (model_dir / "tokenizer.json").is_file():
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def eos_token_ids(model_config: ModelConfig, model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids from the checkpoint config, its generation_config.json and the tokenizer, merged."""
    # NOTE: some checkpoints list their end-of-turn token (e.g. Llama 3 Instruct's <|eot_id|>) only in
    # generation_config.json; without it generation runs on past the answer.
    ids = set(model_config.eos_token_ids) | set(generation_eos_token_ids(Path(model_dir)))
    eos = tokenizer_eos_token_id(model_dir)
    if eos is not None:
        ids.add(eos)
    return tuple(sorted(ids))


def tokenizer_eos_token_id(model_dir: str | Path) -> int | None:
    """The tokenizer's EOS id, as `AutoTokenizer(model_dir).eos_token_id` gives it, read from its files with
    `tokenizers` alone where it can be: a worker needs no more of the tokenizer than this, and importing
    transformers' tokenizer stack costs it ~1.5 s of its start."""
    model_dir = Path(model_dir)
    token = _configured_eos_token(model_dir)
    if (model_dir / "tokenizer.json").is_file() and token is not None:
        from tokenizers import Tokenizer as FastTokenizer

        token_id = FastTokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(token)
        if token_id is not None:
            return token_id
    return Tokenizer(model_dir).eos_token_id  # a SentencePiece-only or unusual tokenizer: transformers decides


def tokenizer_json(model_dir: str | Path) -> str:
    """The tokenizer serialised as HF tokenizer.json text, as the grammar engine takes it: the checkpoint's own
    file where it has one (what transformers' fast tokenizer serialises back, without the ~1.5-5 s it takes to
    import and build one), else transformers' conversion of its tokenizer."""
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer as FastTokenizer

        return FastTokenizer.from_file(str(path)).to_str()  # NOTE: parsed, so a bad file fails here, not later
    return Tokenizer(model_dir).backend.to_str()


def _configured_eos_token(model_dir: Path) -> str | None:
    """The EOS token's text from tokenizer_config.json, else special_tokens_map.json (a string, or an
    AddedToken's dict with its `content`)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        token = json.loads(path.read_text()).get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            return token
    return None


def _one_text(out: object) -> str:
    """transformers types decode / apply_chat_template as maybe returning lists or token ids (batched or
    tokenized calls); for one sequence with tokenize=False it is always one string."""
    if not isinstance(out, str):
        raise TypeError(f"expected one string from the tokenizer, got {type(out).__name__}")
    return out
