"""Errors a frontend's engine handle (the router over the workers) raises to the server.

Each carries the HTTP status and OpenAI error type the server answers with, so the mapping lives
in one place and a streamed response's error event says the same as a whole one's.
(`InvalidRequestError`, a 400, lives with `SamplingParams`: the offline API raises it too.)
"""


class EngineError(RuntimeError):
    """A request the engines could not complete; its subclass says why."""

    http_status = 500
    err_type = "InternalServerError"


class EngineDeadError(EngineError):
    """No engine process is left that can serve the request (now: one may be restarting)."""

    http_status = 503
    err_type = "ServiceUnavailableError"


class RequestFailedError(EngineError):
    """The engine failed this request (a step that raised on it, again on a second worker)."""


class RequestTimeoutError(EngineError):
    """The request made no progress within the server's `--request-timeout`; it was aborted."""

    http_status = 504
    err_type = "TimeoutError"


class EngineOverloadedError(EngineError):
    """A queue the request would join is full (the encoder pool's): retry later."""

    http_status = 503
    err_type = "ServiceUnavailableError"
