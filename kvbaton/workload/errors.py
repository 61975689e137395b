"""The one exception a user can cause in a workload's tools (`kvbaton bench serve`, `kvbaton sim run`, `kvbaton
plan`): bad flags, an unreachable server."""


class WorkloadError(ValueError):
    """A problem the user can fix; the CLI prints its message on one line and exits with status 2."""
