"""Synthetic request sets: `random`, `shared-prefix` and `mixed` (a few long prompts among short chats).

Each generator is a pure function of its config, a prompt source and a seeded RNG, so a run
can be replayed exactly from the seed that `kvbaton bench serve` prints at its start.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvbaton.workload.errors import WorkloadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DATASETS = ("random", "shared-prefix", "mixed")

# NOTE: short common words each encode to about one token in any BPE vocabulary, so without
# a tokenizer the word count is a fair estimate of the prompt length in tokens.
_WORDS = tuple("""
the of and to in is it you that he was for on are as with his they at be this have from or one
had by word but not what all were we when your can said there use an each which she do how their
if will up other about out many then them these so some her would make like him into time has look
two more write go see number no way could people my than first water been call who oil its now find
long down day did get come made may part over new sound take only little work know place year live
me back give most very after thing our just name good sentence man think say great where help through
much before line right too mean old any same tell boy follow came want show also around form three
small set put end does another well large must big even such because turn here why ask went men read
need land different home us move try kind hand picture again change off play spell air away animal
house point page letter mother answer found study still learn should world high every near add food
""".split())


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: a prompt, how long it is, and how many tokens to ask for."""

    request_id: int
    prompt: str  # the user turn (chat), or the text after `system` (completions)
    prompt_len: int  # tokens when a tokenizer was given, else words (an estimate)
    output_len: int
    system: str | None = None  # a shared prefix; sent as the system message on chat endpoints
    group: int | None = None  # which shared prefix this request uses

    def completion_text(self) -> str:
        return self.prompt if self.system is None else f"{self.system}\n\n{self.prompt}"


@dataclass(frozen=True)
class DatasetConfig:
    """Shape of a synthetic dataset; lengths are in tokens, each drawn from [L(1-r), L(1+r)]."""

    name: str = "random"
    num_prompts: int = 200
    input_len: int = 1024  # shared-prefix: the unique part after the prefix
    output_len: int = 128
    range_ratio: float = 0.0
    num_prefixes: int = 4
    prefix_len: int = 1024
    long_fraction: float = 0.05
    long_input_len: int = 4096
    short_input_len: int = 128

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise WorkloadError(f"unknown dataset {self.name!r}; choose one of {', '.join(DATASETS)}")
        lengths = (self.input_len, self.output_len, self.prefix_len, self.long_input_len, self.short_input_len)
        if self.num_prompts < 1 or min(lengths) < 1 or self.num_prefixes < 1:
            raise WorkloadError("--num-prompts, --num-prefixes and every length must be at least 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise WorkloadError("--range-ratio must be in [0, 1)")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise WorkloadError("--long-fraction must be in [0, 1]")


class PromptSource(Protocol):
    """Makes prompt text of about `num_tokens` tokens; returns the text and its measured length."""

    def make(self, rng: np.random.Generator, num_tokens: int) -> tuple[str, int]: ...


class WordPrompts:
    """Random common words: no tokenizer needed, lengths are word counts."""

    def make(self, rng: np.random.Generator, num_tokens: int) -> tuple[str, int]:
        picks = rng.integers(0, len(_WORDS), num_tokens)
        return " ".join(_WORDS[i] for i in picks), num_tokens


class TokenizerPrompts:
    """Random (non-special) token ids decoded with the served model's tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        special = set(tokenizer.all_special_ids)
        self.token_ids = np.array([i for i in range(len(tokenizer)) if i not in special])

    @classmethod
    def from_dir(cls, path: str) -> TokenizerPrompts:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def make(self, rng: np.random.Generator, num_tokens: int) -> tuple[str, int]:
        text = self._decode(rng.choice(self.token_ids, num_tokens).tolist())
        # NOTE: decode->encode is not an identity (neighbouring pieces merge), so cut the
        # re-encoded ids to length once and report the length actually measured.
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
        text = self._decode(ids)
        return text, len(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids)  # typed `str | list[str]`: a list only for batched ids
        if not isinstance(text, str):
            raise TypeError(f"expected one string from the tokenizer, got {type(text).__name__}")
        return text


def sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> np.ndarray:
    """`n` integer lengths uniform in [floor(mean(1-r)), ceil(mean(1+r))], never below 1."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, n)


def random_requests(cfg: DatasetConfig, source: PromptSource, rng: np.random.Generator) -> list[BenchRequest]:
    input_lens = sample_lengths(rng, cfg.input_len, cfg.range_ratio, cfg.num_prompts)
    return _requests_with_lengths(input_lens, cfg, source, rng)


def shared_prefix_requests(cfg: DatasetConfig, source: PromptSource,
                           rng: np.random.Generator) -> list[BenchRequest]:
    """Request i uses prefix i % num_prefixes followed by its own `input_len`-token question."""
    prefixes = [source.make(rng, cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    suffix_lens = sample_lengths(rng, cfg.input_len, cfg.range_ratio, cfg.num_prompts)
    output_lens = sample_lengths(rng, cfg.output_len, cfg.range_ratio, cfg.num_prompts)
    requests = []
    for i, (suffix_len, output_len) in enumerate(zip(suffix_lens, output_lens)):
        group = i % cfg.num_prefixes
        prefix, prefix_len = prefixes[group]
        text, text_len = source.make(rng, int(suffix_len))
        requests.append(BenchRequest(i, text, prefix_len + text_len, int(output_len), system=prefix, group=group))
    return requests


def mixed_requests(cfg: DatasetConfig, source: PromptSource, rng: np.random.Generator) -> list[BenchRequest]:
    """Exactly round(long_fraction * N) long prompts at random positions; the rest are short chats."""
    input_lens = sample_lengths(rng, cfg.short_input_len, cfg.range_ratio, cfg.num_prompts)
    num_long = round(cfg.long_fraction * cfg.num_prompts)
    long_positions = rng.choice(cfg.num_prompts, num_long, replace=False)
    input_lens[long_positions] = sample_lengths(rng, cfg.long_input_len, cfg.range_ratio, num_long)
    return _requests_with_lengths(input_lens, cfg, source, rng)


def _requests_with_lengths(input_lens: np.ndarray, cfg: DatasetConfig, source: PromptSource,
                           rng: np.random.Generator) -> list[BenchRequest]:
    output_lens = sample_lengths(rng, cfg.output_len, cfg.range_ratio, len(input_lens))
    requests = []
    for i, (input_len, output_len) in enumerate(zip(input_lens, output_lens)):
        text, measured = source.make(rng, int(input_len))
        requests.append(BenchRequest(i, text, measured, int(output_len)))
    return requests


_GENERATORS: dict[str, Callable[[DatasetConfig, PromptSource, np.random.Generator], list[BenchRequest]]] = {
    "random": random_requests,
    "shared-prefix": shared_prefix_requests,
    "mixed": mixed_requests,
}


def build_requests(cfg: DatasetConfig, source: PromptSource, seed: int) -> list[BenchRequest]:
    """The dataset named by `cfg.name`, deterministic in `seed`."""
    return _GENERATORS[cfg.name](cfg, source, np.random.default_rng([seed, 0]))
