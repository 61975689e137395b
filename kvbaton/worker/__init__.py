"""The worker process (`python -m kvbaton.worker.main`): one engine core in a role, driven by the router over
ZeroMQ; its heartbeat, its lifeline to the launcher, and the diagnostics it runs when asked."""
