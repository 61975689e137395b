"""Errors a frontend's engine handle (one core, or a router over many workers) raises to the server."""


class EngineDeadError(RuntimeError):
    """No engine process is left that can serve the request."""
