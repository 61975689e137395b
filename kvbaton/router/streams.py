"""One request's outputs as an async stream, fed by a frontend's output loop through a queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable

from kvbaton.text.request_output import RequestOutput


async def stream_outputs(queue: asyncio.Queue, on_unfinished_exit: Callable[[], Awaitable[None]]
                         ) -> AsyncGenerator[RequestOutput, None]:
    """Yield outputs until the finished one; an Exception put in the queue is raised here.
    If the consumer stops early (client gone, task cancelled), `on_unfinished_exit` runs: it
    aborts the request wherever it runs, so its KV blocks are freed."""
    finished = False
    try:
        while not finished:
            item = await queue.get()
            if isinstance(item, Exception):
                finished = True
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            await on_unfinished_exit()
