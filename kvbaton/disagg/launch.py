"""Bring up a router and its worker pools for `kvbaton serve --prefill N --decode M`."""

from __future__ import annotations

from collections.abc import Callable

from kvbaton.config import EngineConfig
from kvbaton.disagg.router import Router, RouterConfig
from kvbaton.disagg.spec import ConnectorSpec
from kvbaton.engine.tokenizer import Tokenizer
from kvbaton.wire import cluster_secret


async def start_router(config: EngineConfig, tokenizer: Tokenizer, options) -> tuple[Router, Callable[[], None] | None]:
    """Start workers (local processes or Ray actors) and a router over them. Returns the router
    and a cleanup for anything started besides the workers (a Redis server, a Ray head)."""
    secret = cluster_secret()
    cleanups: list[Callable[[], None]] = []
    redis_url = options.redis_url
    if options.kv_transport == "redis" and redis_url is None:
        from kvbaton.kv.redis_server import start_redis_server

        server = start_redis_server()
        redis_url = server.url
        cleanups.append(server.stop)
    host = "127.0.0.1"
    if options.backend == "ray":
        from kvbaton.cluster.ray import RayLauncher

        launcher = RayLauncher(secret, address=options.ray_address)
        cleanups.append(launcher.close)
        launcher.start()
        host = launcher.node_ip  # workers on other nodes must reach the router
    else:
        from kvbaton.cluster.local import LocalLauncher

        launcher = LocalLauncher(secret)
    router_config = RouterConfig(prefill_policy=options.routing, decode_policy=options.routing,
                                 local_prefill_threshold=options.local_prefill_threshold,
                                 transfer_deadline_s=options.transfer_timeout_s)
    router = Router(config, tokenizer, launcher, secret, router_config,
                    ConnectorSpec(options.kv_transport, redis_url=redis_url), host=host)
    try:
        await router.start(options.prefill, max(options.decode, 1))
    except BaseException:
        await router.shutdown()
        for cleanup in reversed(cleanups):
            cleanup()
        raise

    def cleanup_all() -> None:
        for cleanup in reversed(cleanups):
            cleanup()

    return router, cleanup_all
