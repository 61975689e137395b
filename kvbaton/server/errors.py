"""What went wrong in a request, mapped in one place to the OpenAI-style error it answers with.

A whole response answers with the status and `{"error": {...}}`; a stream that has begun (its
200 is sent) ends with the same body as an event, then `data: [DONE]`, so a client never sees a
silently cut connection.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import NamedTuple

from fastapi.responses import JSONResponse

from kvbaton.config import ConfigError
from kvbaton.mm.images import DecodedImage, ImageDecoder, ImageHold, ImageRefused
from kvbaton.router.errors import EngineError
from kvbaton.sched.sampling_params import InvalidRequestError
from kvbaton.server.protocol import error_body
from kvbaton.server.responses import sse

logger = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param


async def decoded_images(decoder: ImageDecoder, urls: list[str], hold: ImageHold) -> list[DecodedImage]:
    """A chat's images, decoded off the loop and held by `hold`; an ApiError naming why one is refused (a 503
    for a full decoder, else a 400 or 413)."""
    try:
        return await decoder.decode_all(urls, hold)
    except ImageRefused as exc:
        error = "ServiceUnavailableError" if exc.status == 503 else "BadRequestError"
        raise ApiError(exc.status, f"messages: {exc}", error, "messages") from None


class HttpError(NamedTuple):
    status: int
    message: str
    err_type: str
    param: str | None = None

    def body(self) -> dict:
        return error_body(self.message, self.err_type, self.status, self.param)

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def events(self) -> list[str]:
        """How a stream that has begun ends with this error."""
        return [sse(self.body()), sse("[DONE]")]


def http_error(exc: BaseException) -> HttpError:
    """The answer for `exc`; an unexpected one is logged with its traceback and answered 500."""
    if isinstance(exc, ApiError):
        return HttpError(exc.status, exc.message, exc.err_type, exc.param)
    if isinstance(exc, InvalidRequestError):
        return HttpError(400, str(exc), "BadRequestError", getattr(exc, "param", None))
    if isinstance(exc, ConfigError):  # e.g. chat on a model whose tokenizer has no chat template
        return HttpError(400, str(exc), "BadRequestError")
    if isinstance(exc, EngineError):
        logger.warning("request failed: %s: %s", type(exc).__name__, exc)
        return HttpError(exc.http_status, str(exc), exc.err_type)
    logger.error("unexpected error while serving a request", exc_info=exc)
    return HttpError(500, f"internal server error ({type(exc).__name__}); the server log has the details",
                     "InternalServerError")
