"""`--backend ray`: workers as Ray actors in gang-scheduled placement groups.

    pool "prefill"   [pg kvbaton-prefill-0: bundle 0 .. N-1]  [pg kvbaton-prefill-1: ...]
    pool "decode"    [pg kvbaton-decode-0:  bundle 0 .. N-1]  ...
                      └ one PACK placement group per worker (N = its tensor-parallel ranks)

- Gang: a worker's bundles are reserved all together or not at all (a placement group is atomic),
  and one `launch` keeps all of its placement groups or none: an impossible request fails before
  anything is reserved, one that is not granted in `placement_timeout_s` gives back all it got.
- Pools spread: the groups of a pool avoid the nodes that hold other pools (a per-bundle label
  selector `ray.io/node-id: !in(...)`), but only when the other nodes have room for the whole
  pool; otherwise the pools share nodes (a soft preference, decided from the current free CPUs).
- Each rank is a `WorkerHost` actor in its bundle. The actor starts `kvbaton.disagg.worker` as
  its child process: the worker gets its own title (`kvbaton-decode-0` in `ps`, not `ray::...`),
  its own main thread and signal handlers, and a clean exit (SIGINT: its `finally` closes the
  sockets and KV buffers; SIGKILL after a grace period); it exits by itself if the actor dies.
- The cluster secret rides in the actor's constructor arguments (never argv, never a repr, so
  never a log) and reaches the worker through its environment, as with local processes.
- Nothing is detached: if the launching process dies, Ray removes its actors and groups.

Without `address`, `start` runs a private single-machine head: `ray start --head --block` as a
child in its own session (stopped by PID and process group, never `ray stop`), with its own
temp dir, no dashboard, no token auth, and every Ray address on 127.0.0.1 (checked).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import msgspec
import ray
import ray._private.ray_constants as ray_constants
from ray._private.state import available_resources_per_node, total_resources_per_node
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvbaton.disagg.spec import SPEC_ENV, WorkerSpec
from kvbaton.wire import SECRET_ENV

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
NODE_ID_LABEL = "ray.io/node-id"
# The worker's entry point with SIGINT working again: a Ray worker ignores it, and blocks it in
# the threads that run actor methods; a child inherits both, leaving only SIGKILL to stop it.
_WORKER_BOOTSTRAP = ("import signal; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
                     "signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "from kvbaton.disagg.worker import main; main()")


class PlacementError(RuntimeError):
    """The cluster cannot hold the requested workers; nothing of the request was kept."""


class RayWorker(NamedTuple):
    """One rank of a worker as the router's `GET /workers` shows it."""

    name: str
    role: str
    index: int
    rank: int
    node_id: str
    node_ip: str
    placement_group_id: str
    bundle_index: int
    actor_id: str | None  # None until the actor runs
    pid: int | None  # the worker process


class HostInfo(NamedTuple):
    actor_id: str
    node_id: str
    node_ip: str
    pid: int


class _Secret:
    """The cluster secret on its way to an actor: pickled by Ray, never shown by a repr."""

    __slots__ = ("_value",)

    def __init__(self, value: bytes) -> None:
        self._value = value

    def __repr__(self) -> str:
        return "<cluster secret>"

    def reveal(self) -> bytes:
        return self._value


# ---- the actor ---------------------------------------------------------------------------------


def bind_to_node(spec: WorkerSpec, node_ip: str) -> WorkerSpec:
    """A loopback host in a spec means "this node": on a node with a network address, bind there."""
    if node_ip == LOOPBACK:
        return spec
    connector = spec.connector
    if _is_loopback(connector.host):
        connector = msgspec.structs.replace(connector, host=node_ip)
    host = node_ip if _is_loopback(spec.host) else spec.host
    return msgspec.structs.replace(spec, host=host, connector=connector)


@ray.remote(max_concurrency=4, max_restarts=0)
class WorkerHost:
    """Hosts one worker process (one rank) inside its placement-group bundle; threaded, so
    `wait` can block while `stop` and `info` answer."""

    def __init__(self, spec_json: bytes, secret: _Secret) -> None:
        context = ray.get_runtime_context()
        node_ip = ray.util.get_node_ip_address()
        spec = bind_to_node(msgspec.json.decode(spec_json, type=WorkerSpec), node_ip)
        env = {**os.environ, SECRET_ENV: secret.reveal().decode(), SPEC_ENV: msgspec.json.encode(spec).decode(),
               "TOKENIZERS_PARALLELISM": "false"}
        if spec.engine.num_threads:
            env["OMP_NUM_THREADS"] = str(spec.engine.num_threads)
        cmd = [sys.executable, "-c", _WORKER_BOOTSTRAP, "--exit-with-parent"]
        self.proc = subprocess.Popen(cmd, env=env)
        self._info = HostInfo(context.get_actor_id(), context.get_node_id(), node_ip, self.proc.pid)

    def info(self) -> HostInfo:
        return self._info

    def wait(self) -> int:
        """The worker's exit code, once it exits."""
        return self.proc.wait()

    def stop(self, grace_s: float) -> int:
        """SIGINT, then SIGKILL after `grace_s` (at once if 0); the worker's exit code."""
        if self.proc.poll() is None and grace_s > 0:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.proc.kill()  # a no-op once it has exited
        return self.proc.wait()


# ---- placement ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupPlan:
    """One worker's gang: a bundle per rank, packed."""

    spec: WorkerSpec
    bundles: tuple[dict[str, float], ...]

    @property
    def pool(self) -> str:
        return self.spec.role

    @property
    def cpus(self) -> float:
        return sum(b["CPU"] for b in self.bundles)


def plan_groups(specs: Sequence[WorkerSpec], cpus_per_worker: float, ranks: int = 1) -> list[GroupPlan]:
    if cpus_per_worker <= 0 or (cpus_per_worker > 1 and cpus_per_worker != int(cpus_per_worker)):
        raise ValueError(f"cpus_per_worker must be a fraction of 1 or a whole number, not {cpus_per_worker}")
    if ranks < 1:
        raise ValueError("a worker has at least one rank")
    return [GroupPlan(spec, tuple({"CPU": float(cpus_per_worker)} for _ in range(ranks))) for spec in specs]


def check_feasible(groups: Sequence[GroupPlan], node_cpus: dict[str, float]) -> None:
    """Fail before reserving anything when no cluster state could hold `groups`."""
    largest, total = max(node_cpus.values(), default=0.0), sum(node_cpus.values())
    for g in groups:
        if max(b["CPU"] for b in g.bundles) > largest:
            raise PlacementError(f"cannot place the {g.pool} pool: {g.spec.name} needs {g.bundles[0]['CPU']:g} CPU "
                                 f"per rank but the largest node has {largest:g}; {_cluster_summary()}")
    demand = sum(g.cpus for g in groups)
    if demand > total:
        raise PlacementError(f"cannot place {_describe_pools(groups)}: {demand:g} CPU in all, but "
                             f"{_cluster_summary()}")


def spread_selector(avoid: set[str], pool_cpus: float, largest_bundle: float,
                    free_cpus: dict[str, float]) -> dict[str, str] | None:
    """A label selector that keeps a pool off the `avoid` nodes, if the other nodes have room."""
    others = {node: cpus for node, cpus in free_cpus.items() if node not in avoid}
    if not avoid or not others or sum(others.values()) < pool_cpus or max(others.values()) < largest_bundle:
        return None
    return {NODE_ID_LABEL: f"!in({','.join(sorted(avoid))})"}


def _describe_pools(groups: Sequence[GroupPlan]) -> str:
    pools: dict[str, list[GroupPlan]] = {}
    for g in groups:
        pools.setdefault(g.pool, []).append(g)
    return " + ".join(f"the {pool} pool ({len(gs)} worker(s) x {len(gs[0].bundles)} rank(s) x "
                      f"{gs[0].bundles[0]['CPU']:g} CPU)" for pool, gs in pools.items())


def _cluster_summary() -> str:
    try:
        totals, free = total_resources_per_node(), available_resources_per_node()
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    except Exception as exc:  # noqa: BLE001 - only for the error message
        return f"the cluster's resources are unknown ({exc})"
    nodes = ", ".join(f"{ips.get(node, node[:8])}: {res.get('CPU', 0):g} CPU, {free.get(node, {}).get('CPU', 0):g} free"
                      for node, res in totals.items())
    total = sum(res.get("CPU", 0) for res in totals.values())
    return f"the cluster has {total:g} CPU on {len(totals)} node(s) ({nodes})"


def _cpus(per_node: dict[str, dict[str, float]]) -> dict[str, float]:
    return {node: res.get("CPU", 0.0) for node, res in per_node.items()}


def _is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


# ---- the launcher ------------------------------------------------------------------------------


@dataclass
class _Hosted:
    spec: WorkerSpec
    pg: PlacementGroup
    node_ids: list[str]  # per rank
    actors: list  # WorkerHost handles, per rank
    exit_ref: ray.ObjectRef  # rank 0's worker exit code
    info_refs: list[ray.ObjectRef]


class RayLauncher:
    """Starts, watches and stops kvbaton workers on a Ray cluster (see the module docstring).

    The router drives it like the local launcher: `launch(spec)`, `is_alive(name)`, `pid(name)`,
    `stop(name)`, `kill(name)`, `stop_all()`; `close()` also disconnects and stops a head it started."""

    backend = "ray"

    def __init__(self, secret: bytes, address: str | None = None, *, num_cpus: int | None = None,
                 cpus_per_worker: float | None = None, placement_timeout_s: float = 30.0,
                 startup_timeout_s: float = 60.0, object_store_bytes: int = 256 * 2**20) -> None:
        self.secret, self.address, self.num_cpus = secret, address, num_cpus
        self.cpus_per_worker = cpus_per_worker  # None: the engine's num_threads, else 1
        self.placement_timeout_s, self.startup_timeout_s = placement_timeout_s, startup_timeout_s
        self.object_store_bytes = object_store_bytes
        self.head: LocalHead | None = None
        self.gcs_address: str | None = None
        self._hosted: dict[str, _Hosted] = {}
        self._owns_connection = False
        self._saved_single_machine: tuple[bool, str | None] | None = None

    # ---- cluster -------------------------------------------------------------------------

    def start(self, address: str | None = None, num_cpus: int | None = None) -> str:
        """Join the cluster at `address` (`host:port`; run this on one of its nodes, as any Ray
        driver), or start a private local head with `num_cpus` CPUs (default: all of this
        machine's). Returns the GCS address. `launch` calls it if nobody did."""
        if self.gcs_address is not None:
            return self.gcs_address
        address = address or self.address
        loopback = address is None or _is_loopback(address.rsplit(":", 1)[0])
        if loopback:
            self._pin_loopback()
        try:
            if address is None:
                self.head = LocalHead(num_cpus or self.num_cpus or os.cpu_count() or 1, self.object_store_bytes)
                address = self.head.start(self.startup_timeout_s)
            self._connect(address)
            if loopback:
                check_loopback()
        except BaseException:
            self.close()
            raise
        self.gcs_address = ray.get_runtime_context().gcs_address
        return self.gcs_address

    @property
    def node_ip(self) -> str:
        """This process's node address: where a router must listen for workers on other nodes."""
        return ray.util.get_node_ip_address()

    def _pin_loopback(self) -> None:
        # NOTE: Ray swaps 127.0.0.1 for the host's network address whenever it picks a node IP,
        # except in its single-machine mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the default on
        # macOS and Windows), where the GCS, every node and every worker use 127.0.0.1. The
        # variable reaches the head we start and all it starts; this process read it when it
        # imported Ray, so the constant Ray consults at each lookup is set as well (restored by
        # `close`). `check_loopback` verifies the outcome.
        self._saved_single_machine = (ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(SINGLE_MACHINE_ENV))
        os.environ[SINGLE_MACHINE_ENV] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False

    def _connect(self, address: str) -> None:
        if ray.is_initialized():
            raise RuntimeError("this process is already connected to a Ray cluster")
        ray.init(address=address, namespace=f"kvbaton-{secrets.token_hex(4)}", logging_level=logging.WARNING)
        self._owns_connection = True

    # ---- workers -------------------------------------------------------------------------

    def launch(self, specs: WorkerSpec | Sequence[WorkerSpec], cpus_per_worker: float | None = None,
               secret: bytes | None = None) -> list[RayWorker]:
        """Reserve a placement group per worker (all or nothing, see `reserve`) and start the
        workers in them. Returns without waiting for the workers to load their models."""
        specs = [specs] if isinstance(specs, WorkerSpec) else list(specs)
        names = [s.name for s in specs]
        if len(set(names)) < len(names) or set(names) & set(self._hosted):
            raise ValueError(f"worker names must be unique and not running yet: {', '.join(names)}")
        self.start()
        cpus = cpus_per_worker or self.cpus_per_worker or specs[0].engine.num_threads or 1
        pgs = self.reserve(specs, cpus)
        sealed = _Secret(secret or self.secret)
        try:
            for spec, pg in zip(specs, pgs):
                self._hosted[spec.name] = self._host(spec, pg, cpus, sealed)
        except BaseException:
            self._stop(names, timeout_s=0)  # the hosted ones, with their groups
            for spec, pg in zip(specs, pgs):
                if spec.name not in self._hosted:
                    remove_placement_group(pg)
            raise
        return [w for w in self.list_workers() if w.name in names]

    def reserve(self, specs: Sequence[WorkerSpec], cpus_per_worker: float, ranks: int = 1) -> list[PlacementGroup]:
        """One ready PACK placement group per spec, with a `cpus_per_worker` bundle per rank;
        pools spread over nodes (module docstring). All or nothing: PlacementError otherwise."""
        groups = plan_groups(specs, cpus_per_worker, ranks)
        check_feasible(groups, _cpus(total_resources_per_node()))
        deadline = time.monotonic() + self.placement_timeout_s
        created: dict[str, PlacementGroup] = {}  # by worker name, in the order of `groups`
        try:
            for pool in dict.fromkeys(g.pool for g in groups):
                avoid = self._nodes_of_others(pool) | {node for g in groups if g.pool != pool and g.spec.name in created
                                                       for node in bundle_nodes(created[g.spec.name])}
                self._reserve_pool([g for g in groups if g.pool == pool], avoid, deadline, created)
        except BaseException:
            for pg in created.values():
                remove_placement_group(pg)
            raise
        return [created[g.spec.name] for g in groups]

    def _nodes_of_others(self, pool: str) -> set[str]:
        return {node for h in self._hosted.values() if h.spec.role != pool for node in h.node_ids}

    def _reserve_pool(self, groups: list[GroupPlan], avoid: set[str], deadline: float,
                      created: dict[str, PlacementGroup]) -> None:
        selector = spread_selector(avoid, sum(g.cpus for g in groups), max(g.bundles[0]["CPU"] for g in groups),
                                   _cpus(available_resources_per_node()))
        for g in groups:
            labels = [selector] * len(g.bundles) if selector else None
            created[g.spec.name] = placement_group(list(g.bundles), strategy="PACK", name=g.spec.name,
                                                   bundle_label_selector=labels)
        pgs = [created[g.spec.name] for g in groups]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs),
                            timeout=max(0.0, deadline - time.monotonic()))
        if len(ready) < len(pgs):
            waiting = [g.spec.name for g, pg in zip(groups, pgs) if not _is_ready(pg)]
            raise PlacementError(f"cannot place {_describe_pools(groups)}: {', '.join(waiting)} not granted within "
                                 f"{self.placement_timeout_s:g} s; {_cluster_summary()}. Nothing was kept.")

    def _host(self, spec: WorkerSpec, pg: PlacementGroup, cpus: float, secret: _Secret) -> _Hosted:
        # NOTE: an actor per bundle, each running the spec's worker. `launch` reserves one rank per
        # worker because a WorkerSpec has no rank yet; a tensor-parallel worker would add one here.
        spec_json = msgspec.json.encode(spec)
        actors = [WorkerHost.options(num_cpus=cpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=rank)).remote(spec_json, secret) for rank in range(pg.bundle_count)]
        return _Hosted(spec, pg, bundle_nodes(pg), actors, actors[0].wait.remote(), [a.info.remote() for a in actors])

    def is_alive(self, name: str) -> bool:
        hosted = self._hosted.get(name)
        if hosted is None:
            return False
        done, _ = ray.wait([hosted.exit_ref], timeout=0)
        return not done

    def pid(self, name: str, timeout_s: float = 10.0) -> int | None:
        hosted = self._hosted.get(name)
        if hosted is None:
            return None
        try:
            return ray.get(hosted.info_refs[0], timeout=timeout_s).pid
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return None

    def list_workers(self) -> list[RayWorker]:
        """Every rank of every worker, with its actor, node and pid where known (non-blocking)."""
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        workers = []
        for h in self._hosted.values():
            for rank, (node_id, ref) in enumerate(zip(h.node_ids, h.info_refs)):
                info = _resolved(ref)
                workers.append(RayWorker(h.spec.name, h.spec.role, h.spec.index, rank, node_id, ips.get(node_id, ""),
                                         h.pg.id.hex(), rank, info and info.actor_id, info and info.pid))
        return workers

    def stop(self, name: str, timeout_s: float = 10.0) -> int | None:
        """Wait for a worker told to shut down; interrupt it, then kill it, if it does not exit in
        time. Its actors and placement group go with it. Returns its exit code, if known."""
        return self._stop([name], timeout_s).get(name)

    def stop_all(self, timeout_s: float = 10.0) -> dict[str, int | None]:
        return self._stop(list(self._hosted), timeout_s)

    def kill(self, name: str) -> None:
        """SIGKILL a worker declared dead (fencing: a stalled one cannot come back), then its actors."""
        self._stop([name], timeout_s=0, grace_s=0)

    def _stop(self, names: list[str], timeout_s: float, grace_s: float = 5.0) -> dict[str, int | None]:
        hosted = [self._hosted.pop(n) for n in names if n in self._hosted]
        if not hosted:
            return {}
        ray.wait([h.exit_ref for h in hosted], num_returns=len(hosted), timeout=timeout_s)
        stops = [[a.stop.remote(grace_s) for a in h.actors] for h in hosted]
        flat = [ref for refs in stops for ref in refs]
        ray.wait(flat, num_returns=len(flat), timeout=grace_s + 5.0)
        codes = {h.spec.name: _resolved(refs[0]) for h, refs in zip(hosted, stops)}
        for h in hosted:
            for actor in h.actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(h.pg)
            logger.info("stopped %s (exit code %s)", h.spec.name, codes[h.spec.name])
        return codes

    def close(self) -> None:
        """Stop every worker, give back every placement group, disconnect, stop our head."""
        if ray.is_initialized() and self._owns_connection:
            self.stop_all(timeout_s=0)
            ray.shutdown()
        self._owns_connection, self.gcs_address = False, None
        if self.head is not None:
            self.head.stop()
            self.head = None
        if self._saved_single_machine is not None:
            ray_constants.ENABLE_RAY_CLUSTER, env = self._saved_single_machine
            if env is None:
                os.environ.pop(SINGLE_MACHINE_ENV, None)
            else:
                os.environ[SINGLE_MACHINE_ENV] = env
            self._saved_single_machine = None

    def __enter__(self) -> RayLauncher:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bundle_nodes(pg: PlacementGroup) -> list[str]:
    """The node of each bundle of a ready placement group."""
    by_index = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    return [by_index[i] for i in range(pg.bundle_count)]


def _is_ready(pg: PlacementGroup) -> bool:
    return ray.util.placement_group_table(pg)["state"] == "CREATED"


def _resolved(ref: ray.ObjectRef):
    done, _ = ray.wait([ref], timeout=0)
    if not done:
        return None
    try:
        return ray.get(ref)
    except ray.exceptions.RayError:
        return None


def check_loopback() -> None:
    """Raise unless the GCS and every live node of the connected cluster are on 127.0.0.1."""
    gcs = ray.get_runtime_context().gcs_address
    nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    if not gcs.startswith(f"{LOOPBACK}:") or any(ip != LOOPBACK for ip in nodes):
        raise RuntimeError(f"Ray is not on loopback: GCS at {gcs}, nodes at {nodes}")


# ---- a private head ----------------------------------------------------------------------------


class LocalHead:
    """`ray start --head --block` as our child, in its own session: one machine, 127.0.0.1 only."""

    def __init__(self, num_cpus: int, object_store_bytes: int) -> None:
        self.num_cpus, self.object_store_bytes = int(num_cpus), object_store_bytes
        # NOTE: short and under /tmp: Ray's unix socket paths live in here (108-byte limit).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="kvbray-", dir="/tmp"))
        self.log_path = self.temp_dir / "head.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> str:
        """Start it and return its GCS address, which `ray start` writes once the node is up."""
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port=0",
               f"--temp-dir={self.temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
               f"--num-cpus={self.num_cpus}", "--num-gpus=0", f"--object-store-memory={self.object_store_bytes}"]
        env = {**os.environ, SINGLE_MACHINE_ENV: "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        marker, deadline = self.temp_dir / "ray_current_cluster", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Ray head exited ({self.proc.returncode}):\n{self._log_tail()}")
            address = marker.read_text().strip() if marker.exists() else ""
            if address:
                logger.info("private Ray head (pid %d) at %s, temp dir %s", self.proc.pid, address, self.temp_dir)
                return address
            time.sleep(0.1)
        raise RuntimeError(f"the Ray head did not start within {timeout_s:g} s:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM: `ray start --block` stops what it started; then SIGKILL its process group."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning("the Ray head (pid %d) ignored SIGTERM; killing its group", self.proc.pid)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of its session, if any
            except ProcessLookupError:
                pass
            self.proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
