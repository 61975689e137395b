"""A request's logprobs kept as columns of numbers, and rendered to vLLM's shape only when read.

vLLM's shape (`list[dict[int, Logprob]]`, each `Logprob` with its decoded text) costs ~2.5 KB per
position at top 20 (a dict, 21 objects, 21 strings), and `RequestOutput` copied the whole list on
every step: a request of 8,000 tokens copied 32 M entries over its life, and 256 of them held
~9 GB in the frontend (hardening issue 27, item 3). Here a position costs 16 bytes per entry in
flat arrays, appended once; each step's output gets a `LogprobsView` of the first n positions
(the columns only grow, so a view never changes under its reader), and the text of a token is
looked up when a position is rendered, by the response builder, for the positions it sends.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import overload

from kvbaton.sched.outputs import TokenLogprobs
from kvbaton.text.request_output import Logprob


class LogprobColumns:
    """Per position: the chosen token, its logprob and rank, and its top N (ids and logprobs, rank order)."""

    def __init__(self) -> None:
        self.chosen = array("q")
        self.chosen_logprob = array("d")
        self.chosen_rank = array("q")
        self.top_end = array("q")  # position i's top N are top_ids[top_end[i-1]:top_end[i]]
        self.top_ids = array("q")
        self.top_logprobs = array("d")

    def __len__(self) -> int:
        return len(self.chosen)

    def append(self, entry: TokenLogprobs) -> None:
        self.chosen.append(entry.token_id)
        self.chosen_logprob.append(entry.logprob)
        self.chosen_rank.append(entry.rank)
        for token_id, logprob in entry.top:
            self.top_ids.append(token_id)
            self.top_logprobs.append(logprob)
        self.top_end.append(len(self.top_ids))

    def render(self, i: int, token_text: Callable[[int], str]) -> dict[int, Logprob]:
        """Position i as vLLM has it: the chosen token first, then the top N by rank (a top token that is the
        chosen one appears once)."""
        chosen = self.chosen[i]
        ranked = {chosen: Logprob(self.chosen_logprob[i], self.chosen_rank[i], token_text(chosen))}
        start = self.top_end[i - 1] if i else 0
        for rank, j in enumerate(range(start, self.top_end[i]), start=1):
            token_id = self.top_ids[j]
            if token_id not in ranked:
                ranked[token_id] = Logprob(self.top_logprobs[j], rank, token_text(token_id))
        return ranked


class LogprobsView(Sequence[dict[int, Logprob]]):
    """The first `length` positions of a request's `LogprobColumns`, read as `list[dict[int, Logprob]]`."""

    def __init__(self, columns: LogprobColumns, length: int, token_text: Callable[[int], str]) -> None:
        self._columns, self._length, self._token_text = columns, length, token_text

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> dict[int, Logprob]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[int, Logprob]]: ...

    def __getitem__(self, index: int | slice) -> dict[int, Logprob] | list[dict[int, Logprob]]:
        if isinstance(index, slice):
            return [self._columns.render(i, self._token_text) for i in range(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError("logprobs index out of range")
        return self._columns.render(index, self._token_text)

    def __iter__(self) -> Iterator[dict[int, Logprob]]:
        return (self._columns.render(i, self._token_text) for i in range(self._length))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == self._length and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, as the list it stands for

    def __repr__(self) -> str:
        return f"LogprobsView({list(self)!r})"


class PromptLogprobsView(Sequence[dict[int, Logprob] | None]):
    """vLLM's `prompt_logprobs` over columns of prompt positions 1..n-1: None first (nothing predicts the first
    prompt token), then each position rendered when read."""

    def __init__(self, columns: LogprobColumns, token_text: Callable[[int], str]) -> None:
        self._generated = LogprobsView(columns, len(columns), token_text)

    def __len__(self) -> int:
        return len(self._generated) + 1

    @overload
    def __getitem__(self, index: int) -> dict[int, Logprob] | None: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[int, Logprob] | None]: ...

    def __getitem__(self, index: int | slice) -> dict[int, Logprob] | None | list[dict[int, Logprob] | None]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        return None if index == 0 else self._generated[index - 1]

    def __iter__(self) -> Iterator[dict[int, Logprob] | None]:
        yield None
        yield from self._generated

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PromptLogprobsView({list(self)!r})"
