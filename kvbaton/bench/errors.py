"""The one exception a user can cause in `kvbaton bench serve` (bad flags, unreachable server)."""


class BenchError(ValueError):
    """A problem the user can fix; the CLI prints its message on one line and exits with status 2."""
