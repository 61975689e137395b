"""Bring up a deployment from a typed spec: the workers (local processes or Ray actors), the router
over them, and whatever they need besides (a private redis-server for the redis transport, a
private Ray head). Every deployment is the same picture: colocated serving is a router over one
worker of role `both`, replicas are several `both` workers, PD is prefill + decode pools.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvbaton.config import KV_CACHE_DTYPES, ConfigError, EngineConfig, KVStoreConfig
from kvbaton.kv.connectors.base import TRANSPORTS
from kvbaton.kv.connectors.mooncake.engine import check_data_plane
from kvbaton.messages.worker_spec import ConnectorSpec
from kvbaton.platform.net import is_loopback
from kvbaton.router.launcher import Launcher
from kvbaton.router.policies import POLICIES
from kvbaton.router.router import Router, RouterConfig
from kvbaton.router.worker_pool import PoolConfig, WorkerPool
from kvbaton.text.tokenizer import Tokenizer
from kvbaton.wire import CurveUnavailable, cluster_secret, require_curve

logger = logging.getLogger(__name__)


class Backend(str, enum.Enum):
    LOCAL = "local"  # worker processes on this machine (the embedded default)
    RAY = "ray"  # Ray actors in placement groups, on this machine or a cluster


@dataclass(frozen=True, kw_only=True)
class DeploymentSpec:
    num_prefill: int = 0  # 0: the decode workers prefill their own requests (colocated replicas)
    num_decode: int = 1
    kv_transport: str = "shm"  # see kvbaton.kv.connectors.TRANSPORTS
    redis_url: str | None = None  # redis transport: None starts a private redis-server
    # mooncake, or an expert-parallel group's gloo sockets, off loopback (neither authenticates a peer)
    allow_insecure_kv_transport: bool = False
    backend: Backend = Backend.LOCAL
    ray_address: str | None = None  # Ray backend: join this cluster (None: start a private head)
    router: RouterConfig = field(default_factory=RouterConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    log_dir: Path | None = None  # local backend: one log file per worker (None: this process's stderr)
    encrypt_traffic: bool = False  # ZeroMQ CURVE on router <-> worker control and the tcp/shm/mooncake KV sockets
    # the prefill pool's --kv-cache-dtype when it differs from the decode pool's (None: the same); the decode
    # workers convert the blocks they receive (kvbaton.kv.convert), which mooncake cannot
    prefill_kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("a deployment needs at least one decode worker and no negative pool size")
        if self.prefill_kv_cache_dtype is not None:
            if self.prefill_kv_cache_dtype not in KV_CACHE_DTYPES:
                raise ConfigError(f"prefill KV cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                  f"not {self.prefill_kv_cache_dtype!r}")
            if self.kv_transport == "mooncake":
                raise ConfigError("--prefill-kv-cache-dtype needs a KV transport whose receiver converts (shm, tcp, "
                                  "redis): mooncake moves blocks between pools as they are")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"unknown KV transport {self.kv_transport!r}; choose one of {', '.join(TRANSPORTS)}")
        if self.kv_transport == "mooncake":
            try:  # NOTE: here, before any worker starts, not in each worker's log
                check_data_plane("127.0.0.1", self.allow_insecure_kv_transport)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        for policy in (self.router.prefill_policy, self.router.decode_policy):
            if policy not in POLICIES:
                raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if self.encrypt_traffic:
            try:
                require_curve()
            except CurveUnavailable as exc:
                raise ConfigError(str(exc)) from None


@dataclass
class Deployment:
    """A running deployment: the router (the server's EngineClient) and what to stop besides it."""

    router: Router
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        try:
            await self.router.shutdown(timeout_s)
        finally:
            run_cleanups(self.cleanups)


def run_cleanups(cleanups: list[Callable[[], None]]) -> None:
    """Last started, first stopped; one failing cleanup does not skip the others."""
    for cleanup in reversed(cleanups):
        try:
            cleanup()
        except Exception:
            logger.exception("cleanup %s failed", getattr(cleanup, "__qualname__", cleanup))


def resolve_kv_store(engine: EngineConfig, cleanups: list[Callable[[], None]]) -> EngineConfig:
    """Give the KV store what its workers share and `serve` provides: an shm arena named for this server
    (removed when it stops), a private, LRU redis-server when no URL was given, and a private Mooncake Store
    when no master was given."""
    store = engine.kv_store
    if "shm" in store.tiers and store.shm_name is None:
        from kvbaton.kv.store.shm_tier import remove_arenas, serve_arena_name

        name = serve_arena_name()
        store = dataclasses.replace(store, shm_name=name)
        cleanups.append(functools.partial(remove_arenas, name))
    if "redis" in store.tiers and store.redis_url is None:
        from kvbaton.kv.redis_server import start_redis_server

        server = start_redis_server(maxmemory_mb=max(1, int(store.redis_gb * 1024)), maxmemory_policy="allkeys-lru")
        cleanups.append(server.stop)
        store = dataclasses.replace(store, redis_url=server.url)
    if "mooncake" in store.tiers and store.mooncake_master is None:
        from kvbaton.kv.store.mooncake_store import start_mooncake_store

        mooncake = start_mooncake_store(max(1, int(store.mooncake_gb * 2**30)))
        cleanups.append(mooncake.stop)
        store = dataclasses.replace(store, mooncake_master=mooncake.master, mooncake_metadata_url=mooncake.metadata_url)
    return engine if store is engine.kv_store else dataclasses.replace(engine, kv_store=store)


def prefill_engine(engine: EngineConfig, spec: DeploymentSpec) -> EngineConfig | None:
    """The prefill pool's engine config when it differs from the decode pool's (its KV dtype)."""
    dtype = spec.prefill_kv_cache_dtype
    if dtype is None or dtype == engine.cache.kv_cache_dtype:
        return None
    return dataclasses.replace(engine, cache=dataclasses.replace(engine.cache, kv_cache_dtype=dtype))


def make_launcher(spec: DeploymentSpec, secret: bytes) -> Launcher:
    if spec.backend == Backend.RAY:
        from kvbaton.cluster.ray import RayLauncher

        return RayLauncher(secret, address=spec.ray_address)
    from kvbaton.cluster.local import LocalLauncher

    return LocalLauncher(secret, spec.log_dir)


def check_group_exposure(spec: DeploymentSpec, host: str) -> None:
    """ConfigError for expert-parallel groups meeting off loopback unless the operator allowed it: the rendezvous
    store and gloo's pair sockets (`parallel.rendezvous`) authenticate no peer, so any host that reaches them could
    join a group or feed its all-to-all."""
    if is_loopback(host) or spec.allow_insecure_kv_transport:
        return
    if max(spec.pool.decode_ep_size, spec.pool.prefill_ep_size) > 1:
        raise ConfigError(f"refusing expert-parallel groups on {host}: their rendezvous store and gloo sockets are "
                          "unauthenticated. On a private, trusted cluster network pass --allow-insecure-kv-transport; "
                          "otherwise serve on one node (127.0.0.1)")


def check_store_exposure(store: KVStoreConfig, spec: DeploymentSpec) -> None:
    """ConfigError for the mooncake store tier unless the operator allowed it: its master's HTTP metadata server and
    every client's transfer engine listen on every interface whatever host they are given, and authenticate no
    peer. Records are signed (`kv.store.records`), so nobody can plant KV; but anyone who reaches them can read
    every block (the prompts' KV) or fill the store."""
    if "mooncake" in store.tiers and not spec.allow_insecure_kv_transport:
        raise ConfigError("refusing the mooncake KV store tier: its metadata server and transfer engines listen on "
                          "every interface and authenticate no peer (anyone reaching them can read the stored KV). "
                          "On a private, trusted network pass --allow-insecure-kv-transport; otherwise use the shm, "
                          "disk or redis tiers")


async def deploy(engine: EngineConfig, tokenizer: Tokenizer | Callable[[], Tokenizer], spec: DeploymentSpec,
                 secret: bytes | None = None) -> Deployment:
    """Start everything `spec` asks for and return once every worker has joined; on failure,
    whatever was started is stopped again before the error propagates. `tokenizer` may be a function that
    loads it: it then loads (in a thread) while the workers start."""
    secret = secret or cluster_secret()
    check_store_exposure(engine.kv_store, spec)
    cleanups: list[Callable[[], None]] = []
    pool: WorkerPool | None = None
    try:
        redis_url = spec.redis_url
        if spec.kv_transport == "redis" and redis_url is None:
            from kvbaton.kv.redis_server import start_redis_server

            server = start_redis_server()
            cleanups.append(server.stop)
            redis_url = server.url
        engine = resolve_kv_store(engine, cleanups)
        launcher = make_launcher(spec, secret)
        cleanups.append(launcher.close)
        host = launcher.start()  # workers on other nodes must reach the router there
        check_group_exposure(spec, host)
        # NOTE: the KV receiver binds loopback unless told otherwise; a Ray actor rebinds it to its node
        connector = ConnectorSpec(transport=spec.kv_transport, redis_url=redis_url,
                                  allow_insecure_transport=spec.allow_insecure_kv_transport)
        pool = WorkerPool(engine, launcher, secret, spec.pool, connector, host=host,
                          encrypt_traffic=spec.encrypt_traffic, prefill_engine=prefill_engine(engine, spec))
        # NOTE: the workers load their model while this process loads the tokenizer (each takes seconds)
        pool_start = asyncio.ensure_future(pool.start(spec.num_prefill, spec.num_decode))
        try:
            loaded = tokenizer if isinstance(tokenizer, Tokenizer) else await asyncio.to_thread(tokenizer)
        except BaseException:
            pool_start.cancel()
            await asyncio.gather(pool_start, return_exceptions=True)
            raise
        router = Router(pool, loaded, spec.router)
        await router.started(pool_start)
    except BaseException:
        if pool is not None:
            await pool.shutdown()
        run_cleanups(cleanups)
        raise
    return Deployment(router, cleanups)
