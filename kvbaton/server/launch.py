"""`kvbaton serve`: bring up the deployment (workers + router), then the HTTP frontend in front of it."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbaton.cluster import janitor
from kvbaton.cluster.autoscale_policy import AutoscaleConfig, check_deployment
from kvbaton.cluster.deploy import DeploymentSpec, deploy
from kvbaton.config import ConfigError, EngineConfig
from kvbaton.mm.images import ImageLimits
from kvbaton.models.registry import DEFAULT_MODEL, resolve_model
from kvbaton.router.router import Router
from kvbaton.router.worker_pool import WorkerPool
from kvbaton.server.admission import AdmissionLimits
from kvbaton.server.settings import ServerSettings
from kvbaton.text.generation_config import AUTO, load_generation_defaults
from kvbaton.text.tokenizer import Tokenizer
from kvbaton.wire import SECRET_ENV, cluster_secret

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvbaton.cluster.autoscale import Autoscaler


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    admin_api_key: str | None = None
    max_waiting_requests: int = 256
    max_request_bytes: int = 4 * 2**20
    max_priority_range: int | None = None  # None: ServerSettings decides (0 without an API key)
    max_workers: int = 16
    max_n: int = 16
    max_request_output_tokens: int | None = None  # None: the model's default (server.output_budget)
    max_kv_session_bytes: int = 2**30
    generation_config: str = AUTO  # auto | vllm | PATH, as vLLM's --generation-config
    images: ImageLimits = field(default_factory=ImageLimits)  # vision-language models' image inputs
    deployment: DeploymentSpec = field(default_factory=DeploymentSpec)  # default: one colocated worker
    autoscale: AutoscaleConfig | None = None  # None: the pools keep their size unless told (POST /admin/workers)

    def __post_init__(self) -> None:
        if self.autoscale is None:
            return
        d = self.deployment
        if max(d.pool.prefill_ep_size, d.pool.decode_ep_size) > 1:
            raise ConfigError("--autoscale cannot resize expert-parallel groups yet (--expert-parallel-size > 1)")
        check_deployment(self.autoscale, d.num_prefill, d.num_decode, self.max_workers, d.pool.encode_workers)


def serve(config: EngineConfig, options: ServeOptions) -> int:
    # NOTE: what a killed server left (temp dirs, shm arenas) goes first, one INFO line each, shown by default
    logging.getLogger(janitor.__name__).setLevel(logging.INFO)
    janitor.sweep()
    model_dir = resolve_model(config.model)  # pull / convert once, before any worker starts
    name = options.served_model_name or (DEFAULT_MODEL if config.model in (DEFAULT_MODEL, "default")
                                         else Path(model_dir).name)
    config = dataclasses.replace(config, model=str(model_dir))
    defaults = load_generation_defaults(model_dir, options.generation_config)  # a bad PATH fails before workers
    print(f"kvbaton: {defaults.describe()}", file=sys.stderr, flush=True)
    if "disk" in config.kv_store.tiers and not os.environ.get(SECRET_ENV):
        print(f"kvbaton: the disk tier's blocks are signed under this run's fresh secret: set {SECRET_ENV} (kept "
              "the same) for the next run to read them", file=sys.stderr, flush=True)
    settings = ServerSettings(served_model_name=name, api_key=options.api_key, admin_api_key=options.admin_api_key,
                              bind_host=options.host, admission=AdmissionLimits(options.max_waiting_requests),
                              max_request_bytes=options.max_request_bytes,
                              max_priority_range=options.max_priority_range, max_workers=options.max_workers,
                              max_n=options.max_n, generation_defaults=defaults,
                              max_request_output_tokens=options.max_request_output_tokens,
                              max_kv_session_bytes=options.max_kv_session_bytes, images=options.images,
                              kv_session_secret=cluster_secret())  # the workers' too: deploy is given it
    listener = bind_listener(options.host, options.port)  # a port in use fails here, before any worker starts
    try:
        # NOTE: the tokenizer loads while the workers start (`deploy`), not before: each takes seconds
        return asyncio.run(_serve(config, functools.partial(Tokenizer, model_dir), settings, options, listener))
    finally:
        listener.close()


def bind_listener(host: str, port: int) -> socket.socket:
    """The HTTP frontend's socket, bound (not yet listening: a client is refused until the workers are up)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait for TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot serve on {host}:{port}: {exc.strerror or exc} (choose another --port or --host)") \
            from exc
    sock.set_inheritable(True)
    return sock


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


async def _serve(config: EngineConfig, tokenizer: Callable[[], Tokenizer], settings: ServerSettings,
                 options: ServeOptions, listener: socket.socket) -> int:
    # NOTE: uvicorn re-raises the SIGTERM it caught once it has stopped; with the default handler the
    # process would die right there, before `deployment.shutdown()` stops the workers (one still loading
    # its model would outlive us). As an exception it unwinds through the `finally` below.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # NOTE: each worker's readiness (time from its launch, and where its own start went) shows by default
    logging.getLogger(WorkerPool.__module__).setLevel(logging.INFO)
    http_stack = asyncio.ensure_future(asyncio.to_thread(_import_http_stack))  # while the workers start
    try:
        deployment = await deploy(config, tokenizer, options.deployment, secret=settings.kv_session_secret)
    finally:
        await http_stack
    import uvicorn

    from kvbaton.server.api import build_app

    autoscaler = None
    try:
        app = build_app(deployment.router, settings)
        if options.autoscale is not None:
            autoscaler = _start_autoscaler(app, deployment.router, options.autoscale, options.max_workers)
        server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level="warning",
                                               timeout_graceful_shutdown=5))
        _print_banner(settings, options.host, listener.getsockname()[1])
        await server.serve(sockets=[listener])
    finally:
        if autoscaler is not None:
            await autoscaler.stop()
        await deployment.shutdown()
    return 0


def _import_http_stack() -> None:
    """FastAPI, uvicorn and the API's own modules (~0.6 s on 2 cores): imported in a thread while the workers load,
    not before they are launched."""
    import uvicorn  # noqa: F401

    import kvbaton.cluster.autoscale
    import kvbaton.server.api
    import kvbaton.server.metrics  # noqa: F401


def _start_autoscaler(app: FastAPI, router: Router, config: AutoscaleConfig, max_workers: int) -> Autoscaler:
    """The autoscaler task, fed the server's finished requests, its decisions in /metrics and `GET /admin/autoscaler`
    (an admin route: guarded as /workers is)."""
    from kvbaton.cluster.autoscale import Autoscaler
    from kvbaton.server.metrics import AutoscalerMetrics

    server = app.state.server
    autoscaler = Autoscaler(router, config, max_workers)
    metrics = AutoscalerMetrics(server.metrics.registry, server.settings.served_model_name)
    autoscaler.listeners.append(metrics.observe)
    autoscaler.threshold_listeners.append(metrics.observe_threshold)
    server.metrics.finished_listeners.append(autoscaler.observe_finished)
    logging.getLogger(autoscaler.__module__).setLevel(logging.INFO)  # NOTE: its decisions show at the default level

    @app.get("/admin/autoscaler")
    async def autoscaler_view() -> dict[str, Any]:
        return autoscaler.view()

    autoscaler.start()
    return autoscaler


# NOTE: a question SmolLM2-135M answers well at its recommended temperature 0.2 / top_p 0.9 (one correct
# sentence of ~25 tokens in six of six tries), streamed and bounded so a first try shows text at once and ends.
EXAMPLE_QUESTION = "What is photosynthesis? Answer in one sentence."


def _print_banner(settings: ServerSettings, host: str, port: int) -> None:
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    auth = f" -H 'Authorization: Bearer {'$KVBATON_API_KEY'}'" if settings.api_key else ""
    body = (f'{{"model": "{settings.served_model_name}", '
            f'"messages": [{{"role": "user", "content": "{EXAMPLE_QUESTION}"}}], "max_tokens": 64, "stream": true}}')
    print(f"kvbaton is serving {settings.served_model_name} at {url}  (metrics: {url}/metrics)\n"
          f"try:  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
          f"        -d '{body}'", file=sys.stderr, flush=True)
