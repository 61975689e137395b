"""One request's choices: its prompts x n samples as engine requests, their output streams merged as they
come, and a tool-calling choice's stream chunks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass

from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.server.responses import ResponseBuilder
from kvbaton.server.tool_calling import ToolCalling
from kvbaton.server.tools import ToolCallDelta, ToolStreamParser, chat_finish_reason
from kvbaton.text.request_output import RequestOutput


def tool_chunks(builder: ResponseBuilder, index: int, out: RequestOutput, parser: ToolStreamParser,
                 tool_calling: ToolCalling | None) -> list[dict]:
    """A tool-calling choice's stream chunks for its latest output: content and call deltas as the parser
    releases them, and, once it ends, the rest and a last chunk with the finish_reason."""
    c = out.outputs[0]
    deltas = parser.feed(c.delta_text) if c.delta_text else []
    if c.finish_reason:
        deltas += parser.finish()
    if tool_calling is not None and not tool_calling.parallel:
        deltas = [d for d in deltas if not isinstance(d, ToolCallDelta) or d.index == 0]
    chunks = [builder.delta_chunk(index, d.openai()) for d in deltas]
    if c.finish_reason:
        chunks.append(builder.delta_chunk(index, {}, chat_finish_reason(c.finish_reason, bool(parser.calls)),
                                          c.stop_reason))
    return chunks


@dataclass(frozen=True)
class Choice:
    index: int
    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams


def request_choices(request_id: str, prompts: list[tuple[str | None, list[int]]],
             params: SamplingParams) -> Iterator[Choice]:
    """One engine request per prompt x n. A seeded request's samples get seeds seed, seed + 1, ... so they
    differ from each other and repeat run to run. The n samples of a prompt share its KV blocks through
    the prefix cache, even when they are admitted in the same step: a block enters the cache's index when
    it is allocated for the tokens scheduled into it, and each layer writes the step's KV before any
    attention reads it."""
    n = params.n
    for p, (prompt, token_ids) in enumerate(prompts):
        for j in range(n):
            index = p * n + j
            seed = None if params.seed is None else (params.seed + j + 2**63) % 2**64 - 2**63
            child = dataclasses.replace(params, n=1, seed=seed)
            yield Choice(index, request_id if len(prompts) * n == 1 else f"{request_id}-{index}", prompt, token_ids,
                          child)


async def merged(streams: dict[int, AsyncGenerator[RequestOutput, None]],
                  ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Outputs of several choices as they come, each with its index. An error in one ends the whole; closing
    this closes (so aborts) every choice still running."""
    if len(streams) == 1:  # the common case, without tasks
        (index, only), = streams.items()
        async with contextlib.aclosing(only) as gen:
            async for out in gen:
                yield index, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, gen: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in gen:
                await queue.put((index, out))
            await queue.put((index, None))
        except Exception as exc:
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(index, gen)) for index, gen in streams.items()]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
