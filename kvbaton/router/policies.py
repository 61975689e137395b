"""How the router picks a worker for a request: round-robin, least-loaded, prefix-cache-aware.

A policy sees only what the router knows: each worker's last reported load and which prompt
blocks the router itself sent there (`PrefixIndex`), so picking costs no round trip.
Length-aware conditional disaggregation is a separate rule in the router (`RouterConfig.
local_prefill_threshold`): it decides *whether* to use a prefill worker at all.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol, TypeVar

from kvbaton.kv.hashing import chained_block_hashes, salted_root
from kvbaton.sched.request import ImageSpan, digests_between


class Candidate(Protocol):
    """All a policy may read of a worker."""

    @property
    def name(self) -> str: ...

    @property
    def load_score(self) -> float: ...


C = TypeVar("C", bound=Candidate)


class Policy(ABC):
    """Pick one of `candidates` (never empty) for a prompt; `note_routed` learns from the choice. `cache_salt`
    is the request's: its blocks are cached under hashes of their own, shared with no other salt; `images`: the
    prompt's images (their placeholders are the same tokens for every image, so their digests name the blocks
    that hold them, as in the engines' prefix caches)."""

    @abstractmethod
    def pick(self, candidates: list[C], prompt_token_ids: list[int], cache_salt: str | None = None,
             images: Sequence[ImageSpan] = ()) -> C:
        ...

    def note_routed(self, worker_name: str, prompt_token_ids: list[int],  # noqa: B027
                    cache_salt: str | None = None, images: Sequence[ImageSpan] = ()) -> None:
        """Optional: policies that learn from routing decisions override this."""

    def forget_worker(self, worker_name: str) -> None:  # noqa: B027
        """Optional: drop what is known about a worker that left."""


class RoundRobin(Policy):
    def __init__(self, block_size: int = 16) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: list[C], prompt_token_ids: list[int], cache_salt: str | None = None,
             images: Sequence[ImageSpan] = ()) -> C:
        return candidates[next(self._counter) % len(candidates)]


class LeastLoaded(Policy):
    """Fewest requests in flight (running + waiting + KV being moved), then lowest KV usage."""

    def __init__(self, block_size: int = 16) -> None:
        pass

    def pick(self, candidates: list[C], prompt_token_ids: list[int], cache_salt: str | None = None,
             images: Sequence[ImageSpan] = ()) -> C:
        return min(candidates, key=lambda w: w.load_score)


class PrefixIndex:
    """Per worker, the block hashes of prompts recently routed there (bounded LRU), the same
    chained hashes the engines' prefix caches use, so "longest cached prefix" is a lookup."""

    def __init__(self, block_size: int, max_blocks_per_worker: int = 65536) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks_per_worker
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def hashes(self, token_ids: list[int], cache_salt: str | None = None,
               images: Sequence[ImageSpan] = ()) -> list[bytes]:
        return chained_block_hashes(token_ids, self.block_size, parent=salted_root(cache_salt),
                                    images=partial(digests_between, images) if images else None)

    def matched_blocks(self, worker: str, hashes: list[bytes]) -> int:
        known = self._blocks.get(worker)
        if not known:
            return 0
        n = 0
        for h in hashes:
            if h not in known:
                break
            n += 1
        return n

    def add(self, worker: str, hashes: list[bytes]) -> None:
        known = self._blocks.setdefault(worker, OrderedDict())
        for h in hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > self.max_blocks:
            known.popitem(last=False)

    def forget(self, worker: str) -> None:
        self._blocks.pop(worker, None)


class PrefixAware(Policy):
    """The worker most likely to hold the longest cached prefix of the prompt; ties (and
    prompts nobody has seen) go to the least loaded."""

    def __init__(self, block_size: int = 16) -> None:
        self.index = PrefixIndex(block_size)

    def pick(self, candidates: list[C], prompt_token_ids: list[int], cache_salt: str | None = None,
             images: Sequence[ImageSpan] = ()) -> C:
        hashes = self.index.hashes(prompt_token_ids, cache_salt, images)
        return max(candidates, key=lambda w: (self.index.matched_blocks(w.name, hashes), -w.load_score))

    def note_routed(self, worker_name: str, prompt_token_ids: list[int], cache_salt: str | None = None,
                    images: Sequence[ImageSpan] = ()) -> None:
        self.index.add(worker_name, self.index.hashes(prompt_token_ids, cache_salt, images))

    def forget_worker(self, worker_name: str) -> None:
        self.index.forget(worker_name)


POLICIES: dict[str, Callable[[int], Policy]] = {"round_robin": RoundRobin, "least_loaded": LeastLoaded,
                                               "prefix_aware": PrefixAware}


def make_policy(name: str, block_size: int) -> Policy:
    try:
        return POLICIES[name](block_size)
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}") from None
