"""A streamed response that always finishes its cleanup, however the client leaves.

Starlette's `StreamingResponse` stops iterating when the client disconnects, but leaves the body
generator suspended where it was: its `finally` runs only when the garbage collector gets to it, and
the per-choice generators it had not started yet never run theirs at all. The server keeps state
per request (admission entries, the engine's requests), so it closes the body and releases that
state the moment the response ends: finished, failed, cancelled or abandoned.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStreamingResponse(StreamingResponse):
    def __init__(self, body: AsyncGenerator[str, None], on_close: Callable[[], None], media_type: str) -> None:
        super().__init__(body, media_type=media_type)
        self.generator = body
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.generator.aclose()  # runs its `finally`: aborts the choices still running
            finally:
                self.on_close()
