"""`RayLauncher`: the `Launcher` protocol over a Ray cluster, joined or privately started.

Each worker gets its own placement group (see `placement`), and each of its ranks a `WorkerHost`
actor in that group's bundle (see `actor`). Nothing is detached: if the launching process dies,
Ray removes its actors and groups. Without `address`, `start` runs a private single-machine head
(see `head`) with every Ray address on 127.0.0.1 (checked, see `loopback`) and Ray's token
authentication on (see `auth`); a joined cluster keeps its own auth settings (the user's RAY_AUTH_*).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvbaton.cluster.ray.actor import WorkerHost, _Secret
from kvbaton.cluster.ray.auth import driver_auth, forget_driver_auth
from kvbaton.cluster.ray.head import LocalHead
from kvbaton.cluster.ray.loopback import SavedClusterMode, check_loopback, is_loopback, pin_loopback
from kvbaton.cluster.ray.placement import bundle_nodes, plan_groups, reserve_groups
from kvbaton.messages.worker_spec import WorkerRole, WorkerSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RayWorker:
    """One rank of a worker as the router's `GET /workers` shows it."""

    name: str
    role: WorkerRole
    index: int
    rank: int
    node_id: str
    node_ip: str
    placement_group_id: str
    bundle_index: int
    actor_id: str | None  # None until the actor runs
    pid: int | None  # the worker process


@dataclass(kw_only=True)
class _Hosted:
    spec: WorkerSpec
    pg: PlacementGroup
    node_ids: list[str]  # per rank
    actors: list  # WorkerHost handles, per rank
    exit_ref: ray.ObjectRef  # rank 0's worker exit code
    info_refs: list[ray.ObjectRef]
    bundles: list[int]  # its bundles of `pg` (an expert-parallel rank shares its group's)


class RayLauncher:
    """Starts, watches and stops kvbaton workers on a Ray cluster (see the module docstring).

    Implements `kvbaton.router.launcher.Launcher`; besides it, `launch_many` places several
    workers at once (all or nothing), `reserve` only their placement groups, `list_workers` shows
    every rank, and `exit_codes` keeps each stopped worker's exit code."""

    backend = "ray"
    pid_timeout_s = 10.0  # how long `pid` waits for a just-launched actor to report its worker

    def __init__(self, secret: bytes, address: str | None = None, *, num_cpus: int | None = None,
                 cpus_per_worker: float | None = None, placement_timeout_s: float = 30.0,
                 startup_timeout_s: float = 60.0, object_store_bytes: int = 256 * 2**20) -> None:
        self.secret, self.address = secret, address  # address: a cluster's GCS `host:port`; None: a private head
        self.num_cpus = num_cpus  # the private head's; None: all of this machine's
        self.cpus_per_worker = cpus_per_worker  # None: the engine's num_threads, else 1
        self.placement_timeout_s, self.startup_timeout_s = placement_timeout_s, startup_timeout_s
        self.object_store_bytes = object_store_bytes
        self.head: LocalHead | None = None
        self.gcs_address: str | None = None  # set while connected
        self.exit_codes: dict[str, int | None] = {}  # by worker name, as last stopped (None: unknown)
        self._hosted: dict[str, _Hosted] = {}
        self._gangs: dict[str, tuple[PlacementGroup, int, float]] = {}  # by worker name: its gang's group, bundle
        self._owns_connection = False
        self._saved_mode: SavedClusterMode | None = None

    # ---- cluster -------------------------------------------------------------------------

    def start(self) -> str:
        """Join the cluster at `address` (run this on one of its nodes, as any Ray driver), or
        start a private local head. Returns the router host (`node_ip`); the cluster's address is
        then `gcs_address`. Idempotent; `launch` calls it if nobody did."""
        if self.gcs_address is None:
            self._join()
        return self.node_ip

    @property
    def node_ip(self) -> str:
        """This process's node address: where a router must listen for workers on other nodes."""
        return ray.util.get_node_ip_address()

    def _join(self) -> None:
        address = self.address
        loopback = address is None or is_loopback(address.rsplit(":", 1)[0])
        if loopback:
            self._saved_mode = pin_loopback()
        try:
            if address is None:
                self.head = LocalHead(self.num_cpus or os.cpu_count() or 1, self.object_store_bytes)
                address = self.head.start(self.startup_timeout_s)
            self._connect(address, self.head.token_path if self.head else None)
            if loopback:
                check_loopback()
        except BaseException:
            self.close()
            raise
        self.gcs_address = ray.get_runtime_context().gcs_address

    def _connect(self, address: str, token_path: Path | None) -> None:
        """Join as a driver; with `token_path` (our head's), authenticate with that token."""
        if ray.is_initialized():
            raise RuntimeError("this process is already connected to a Ray cluster")
        with driver_auth(token_path) if token_path else contextlib.nullcontext():
            ray.init(address=address, namespace=f"kvbaton-{secrets.token_hex(4)}", logging_level=logging.WARNING)
        self._owns_connection = True

    # ---- workers -------------------------------------------------------------------------

    def launch(self, spec: WorkerSpec) -> None:
        """Start one worker: into its bundle if it belongs to a gang whose placement group lives (`launch_gang`;
        a replacement too), else in a placement group of its own (see `launch_many`)."""
        place = self._gangs.get(spec.name)
        if place is None:
            self.launch_many([spec])
            return
        if spec.name in self._hosted:
            raise ValueError(f"{spec.name} is running already")
        pg, bundle, cpus = place
        self._hosted[spec.name] = self._host(spec, pg, cpus, _Secret(self.secret), bundles=[bundle])

    def launch_many(self, specs: Sequence[WorkerSpec], cpus_per_worker: float | None = None) -> list[RayWorker]:
        """Reserve a placement group per worker (all or nothing, see `reserve`) and start the
        workers in them. Returns their ranks without waiting for the workers to load their models."""
        specs = list(specs)
        names = [s.name for s in specs]
        if len(set(names)) < len(names) or set(names) & set(self._hosted):
            raise ValueError(f"worker names must be unique and not running yet: {', '.join(names)}")
        self.start()
        cpus = cpus_per_worker or self.cpus_per_worker or specs[0].engine.num_threads or 1
        pgs = self.reserve(specs, cpus)
        sealed = _Secret(self.secret)
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

    def launch_group(self, specs: list[WorkerSpec]) -> None:
        """The ranks of one expert-parallel group in one PACK placement group, a bundle per rank (all or
        nothing); each rank's actor runs its own worker."""
        names = [s.name for s in specs]
        if len(set(names)) < len(names) or set(names) & set(self._hosted):
            raise ValueError(f"worker names must be unique and not running yet: {', '.join(names)}")
        self.start()
        cpus = self.cpus_per_worker or specs[0].engine.num_threads or 1
        [pg] = self.reserve(specs[:1], cpus, ranks=len(specs))
        sealed = _Secret(self.secret)
        try:
            for rank, spec in enumerate(specs):
                self._hosted[spec.name] = self._host(spec, pg, cpus, sealed, bundles=[rank])
        except BaseException:
            self._stop([n for n in names if n in self._hosted], timeout_s=0)
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
            raise

    def launch_gang(self, specs: list[WorkerSpec], joining: list[str]) -> None:
        """`specs` and the workers named `joining` in one PACK placement group, a bundle each (all or nothing);
        `specs` start now, each of `joining` when `launch` is called for it, into its bundle. Every bundle has
        the same CPUs (`cpus_per_worker`, else the first spec's threads)."""
        names = [s.name for s in specs] + list(joining)
        if len(set(names)) < len(names) or set(names) & set(self._hosted):
            raise ValueError(f"worker names must be unique and not running yet: {', '.join(names)}")
        self.start()
        cpus = self.cpus_per_worker or specs[0].engine.num_threads or 1
        [pg] = self.reserve(specs[:1], cpus, ranks=len(names))
        self._gangs.update({name: (pg, bundle, cpus) for bundle, name in enumerate(names)})
        sealed = _Secret(self.secret)
        try:
            for spec in specs:
                self._hosted[spec.name] = self._host(spec, pg, cpus, sealed, bundles=[self._gangs[spec.name][1]])
        except BaseException:
            self._stop([n for n in names if n in self._hosted], timeout_s=0)
            self._forget_gang(pg)
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
            raise

    def _forget_gang(self, pg: PlacementGroup) -> None:
        self._gangs = {name: place for name, place in self._gangs.items() if place[0].id != pg.id}

    def reserve(self, specs: Sequence[WorkerSpec], cpus_per_worker: float, ranks: int = 1) -> list[PlacementGroup]:
        """One ready PACK placement group per spec, with a `cpus_per_worker` bundle per rank;
        pools spread over nodes (see `placement`). All or nothing: PlacementError otherwise."""
        held: dict[WorkerRole, set[str]] = {}
        for h in self._hosted.values():
            held.setdefault(h.spec.role, set()).update(h.node_ids)
        return reserve_groups(plan_groups(specs, cpus_per_worker, ranks), held, self.placement_timeout_s)

    def _host(self, spec: WorkerSpec, pg: PlacementGroup, cpus: float, secret: _Secret,
              bundles: list[int] | None = None) -> _Hosted:
        # NOTE: an actor per bundle of the worker (all of the group's by default), each running the spec's
        # worker; an expert-parallel rank takes one bundle of its group's placement group.
        spec_json = msgspec.json.encode(spec)
        bundles = list(range(pg.bundle_count)) if bundles is None else bundles
        actors = [WorkerHost.options(  # type: ignore[attr-defined]  # added by @ray.remote
            num_cpus=cpus, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
        ).remote(spec_json, secret) for b in bundles]
        nodes = bundle_nodes(pg)
        return _Hosted(spec=spec, pg=pg, node_ids=[nodes[b] for b in bundles], actors=actors,
                       exit_ref=actors[0].wait.remote(), info_refs=[a.info.remote() for a in actors], bundles=bundles)

    def is_alive(self, name: str) -> bool:
        hosted = self._hosted.get(name)
        if hosted is None:
            return False
        done, _ = ray.wait([hosted.exit_ref], timeout=0)
        return not done

    def pid(self, name: str) -> int | None:
        hosted = self._hosted.get(name)
        if hosted is None:
            return None
        try:
            return ray.get(hosted.info_refs[0], timeout=self.pid_timeout_s).pid
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return None

    def list_workers(self) -> list[RayWorker]:
        """Every rank of every worker, with its actor, node and pid where known (non-blocking)."""
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        workers = []
        for h in self._hosted.values():
            for rank, (node_id, ref) in enumerate(zip(h.node_ids, h.info_refs)):
                info = _resolved(ref)
                workers.append(RayWorker(name=h.spec.name, role=h.spec.role, index=h.spec.index, rank=rank,
                                         node_id=node_id, node_ip=ips.get(node_id, ""),
                                         placement_group_id=h.pg.id.hex(), bundle_index=h.bundles[rank],
                                         actor_id=info and info.actor_id, pid=info and info.pid))
        return workers

    def stop(self, name: str, timeout_s: float = 10.0) -> None:
        """Wait for a worker told to shut down; interrupt it, then kill it, if it does not exit in
        time. Its actors and placement group go with it; its exit code goes to `exit_codes`."""
        self._stop([name], timeout_s)

    def stop_all(self, timeout_s: float = 10.0) -> None:
        self._stop(list(self._hosted), timeout_s)

    def kill(self, name: str) -> None:
        """SIGKILL a worker declared dead (fencing: a stalled one cannot come back), then its actors."""
        self._stop([name], timeout_s=0, grace_s=0)

    def _stop(self, names: list[str], timeout_s: float, grace_s: float = 5.0) -> None:
        hosted = [self._hosted.pop(n) for n in names if n in self._hosted]
        if not hosted:
            return
        ray.wait([h.exit_ref for h in hosted], num_returns=len(hosted), timeout=timeout_s)
        stops = [[a.stop.remote(grace_s) for a in h.actors] for h in hosted]
        flat = [ref for refs in stops for ref in refs]
        ray.wait(flat, num_returns=len(flat), timeout=grace_s + 5.0)
        codes = {h.spec.name: _resolved(refs[0]) for h, refs in zip(hosted, stops)}
        self.exit_codes.update(codes)
        for h in hosted:
            for actor in h.actors:
                ray.kill(actor, no_restart=True)
            if not any(other.pg.id == h.pg.id for other in self._hosted.values()):  # its group's last rank
                remove_placement_group(h.pg)
                self._forget_gang(h.pg)
            logger.info("stopped %s (exit code %s)", h.spec.name, codes[h.spec.name])

    def close(self) -> None:
        """Stop every worker, give back every placement group, disconnect, stop our head."""
        if ray.is_initialized() and self._owns_connection:
            self.stop_all(timeout_s=0)
            ray.shutdown()
            if self.head is not None:
                forget_driver_auth()
        self._owns_connection, self.gcs_address = False, None
        if self.head is not None:
            self.head.stop()
            self.head = None
        if self._saved_mode is not None:
            self._saved_mode.restore()
            self._saved_mode = None

    def __enter__(self) -> RayLauncher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolved(ref: ray.ObjectRef) -> Any:
    """The value of a finished task, or None if it has not finished or failed (non-blocking)."""
    done, _ = ray.wait([ref], timeout=0)
    if not done:
        return None
    try:
        return ray.get(ref)
    except ray.exceptions.RayError:
        return None
