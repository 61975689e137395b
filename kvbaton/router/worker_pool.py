"""The router's pool of workers: who is in it, in which role, how loaded, and whether alive.

It starts workers through a `Launcher`, registers them when they say hello, keeps their last
reported load, watches their heartbeats and processes, fences (kills) a worker that falls silent
or exits, drains and retires workers on request, and aggregates the pool's stats. It knows
nothing of requests: every request-level message, and the news that a worker is gone, goes to
its `PoolListener` (the router).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from kvbaton.config import AttentionFFNConfig, ConfigError, EngineConfig, ExpertParallelConfig
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.processes import free_port
from kvbaton.messages.router_worker import (
    CheckIntegrity,
    Drain,
    Drained,
    ExpertsServed,
    FromWorker,
    Heartbeat,
    IntegrityReport,
    Shutdown,
    WorkerHello,
    WorkerLoad,
    WorkerOutputs,
)
from kvbaton.messages.worker_spec import ROUTER_NAME, ConnectorSpec, ExpertSlot, WorkerRole, WorkerSpec, worker_name
from kvbaton.router.errors import EngineDeadError
from kvbaton.router.expert_view import every_expert_served, expert_view
from kvbaton.router.launcher import Launcher
from kvbaton.router.supervision import RestartPolicy, SlotState, Supervisor, TaskGuard
from kvbaton.sched.info import AfdStats, EngineInfo, EngineStats
from kvbaton.wire import MAX_CONTROL_FRAME_BYTES, Peer, SequencedCodec, curve_client, curve_keys, curve_server

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolConfig:
    heartbeat_s: float = 0.5
    dead_after_s: float = 5.0  # no heartbeat for this long: the worker is gone
    start_timeout_s: float = 600.0
    restart: RestartPolicy = RestartPolicy()  # how a worker declared dead is replaced (see `supervision`)
    # ranks per expert-parallel group: a prefill (decode, colocated) "worker" is a group of this many
    prefill_ep_size: int = 1
    decode_ep_size: int = 1
    ep_int8_dispatch: bool = False  # int8 activations on the groups' dispatch wire
    # EPLB in every group: redundant expert slots, re-placement every this many busy steps (0: never), objective
    num_redundant_experts: int = 0
    eplb_interval_steps: int = 0
    eplb_objective: str = "tokens"
    # attention/FFN disaggregation: this many expert workers hold every MoE layer's routed experts, and the decode
    # (colocated) workers are attention workers that dispatch to them, each decode step in this many micro-batches
    expert_workers: int = 0
    afd_micro_batches: int = 1  # 0: auto (each attention worker measures its own steps)
    # E/P/D: this many encoder workers encode requests' images (0: the language workers encode them), each taking at
    # most `encode_queue` images waiting or encoding: a request whose images would pass the pool's bound gets a 503
    encode_workers: int = 0
    encode_queue: int = 32

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.dead_after_s:
            raise ConfigError(f"need 0 < heartbeat_s ({self.heartbeat_s}) < dead_after_s ({self.dead_after_s})")
        if min(self.prefill_ep_size, self.decode_ep_size) < 1:
            raise ConfigError("expert-parallel sizes must be >= 1")
        if self.encode_workers < 0 or self.encode_queue < 1:
            raise ConfigError("need --encode >= 0 and --encode-queue >= 1")
        if self.expert_workers < 0 or self.afd_micro_batches < 0:
            raise ConfigError("need --expert-workers >= 0 and --afd-micro-batches auto or >= 1")
        if self.expert_workers and self.decode_ep_size > 1:
            raise ConfigError("--expert-workers puts the decode workers' experts in an expert pool: it cannot be "
                              "combined with --expert-parallel-size for them")
        if self.expert_workers and self.eplb_interval_steps and self.prefill_ep_size > 1:
            raise ConfigError("--eplb-interval with --expert-workers applies to the expert pool: not also to "
                              "prefill expert-parallel groups")
        if self.expert_workers and self.num_redundant_experts and self.prefill_ep_size > 1:
            raise ConfigError("--num-redundant-experts with --expert-workers applies to the expert pool: not also "
                              "to prefill expert-parallel groups")

    def ep_size(self, role: WorkerRole) -> int:
        if role == WorkerRole.PREFILL:
            return self.prefill_ep_size
        return self.decode_ep_size if role.decodes else 1


@dataclass(kw_only=True)
class WorkerHandle:
    name: str
    role: WorkerRole
    index: int
    pid: int
    address: str
    info: EngineInfo | None  # None: no engine core (an expert worker)
    layout: KVLayout | None
    receiver: str | None
    load: WorkerLoad
    socket: zmq.asyncio.Socket
    experts: ExpertsServed | None = None  # an expert worker's exchange and experts
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    draining: bool = False
    attempts: set[str] = field(default_factory=set)  # attempt ids it works on
    ready_after_s: float | None = None  # from its launch to its hello (None: launched by another pool)
    startup: dict[str, float] = field(default_factory=dict)  # its own account of its start, per phase

    @property
    def load_score(self) -> float:
        s = self.load.stats
        return s.num_running + s.num_waiting + self.load.num_receiving + len(self.attempts) + s.kv_cache_usage

    @property
    def can_decode(self) -> bool:
        return self.role.decodes

    @property
    def takes_requests(self) -> bool:
        """An engine worker (prefill, decode, both) or an encoder worker (a request's images); an expert worker
        serves the others and takes none."""
        return self.info is not None or self.role == WorkerRole.ENCODE

    @property
    def routable(self) -> bool:
        return self.alive and not self.draining and self.takes_requests

    @property
    def engine_info(self) -> EngineInfo:
        """Its engine's info: every worker that takes requests has one."""
        if self.info is None:
            raise RuntimeError(f"{self.name} has no engine core (role {self.role.value})")
        return self.info

    @property
    def kv_layout(self) -> KVLayout:
        """Its KV layout: every worker that takes requests has one."""
        if self.layout is None:
            raise RuntimeError(f"{self.name} has no KV cache (role {self.role.value})")
        return self.layout

    def view(self) -> dict[str, Any]:
        s = self.load.stats
        return {"name": self.name, "role": self.role.value, "index": self.index, "pid": self.pid,
                "address": self.address, "healthy": self.alive, "draining": self.draining,
                "num_running": s.num_running, "num_waiting": s.num_waiting, "num_receiving": self.load.num_receiving,
                "num_sending": self.load.num_sending, "kv_cache_usage": s.kv_cache_usage,
                "in_flight": len(self.attempts), "compute_path": self.info.compute_path if self.info else None,
                "kv_dtype": self.layout.dtype if self.layout else None, "ready_after_s": self.ready_after_s,
                "startup_s": self.startup,
                "experts": self._experts_view(), "encode": self._encode_view()}

    def _encode_view(self) -> dict[str, Any] | None:
        """An encoder worker's queue, what it encoded and how fast, and its encoder cache."""
        e, cache = self.load.encode, self.load.stats.encoder_cache
        if e is None:
            return None
        view: dict[str, Any] = {"queued_images": e.queued_images, "encoded": e.encoded, "busy_s": round(e.busy_s, 3),
                                "images_per_s": round(e.encoded / e.busy_s, 2) if e.busy_s else None}
        if cache is not None:
            view.update(cache_hits=cache.hits, cache_misses=cache.misses, cache_bytes=cache.bytes)
        return view

    def _experts_view(self) -> dict[str, Any] | None:
        """An expert worker's place in the expert pool, and its exchanges so far. `owns`: the logical expert of
        each of its slots in the first MoE layer (at placement epoch 0 every layer alike); `owns_by_layer`: every
        MoE layer's, at `placement_epoch` (EPLB re-places each layer on its own)."""
        if self.experts is None:
            return None
        e, x = self.experts, self.load.exchange
        view: dict[str, Any] = {"rank": e.rank, "size": e.size, "owns": e.experts, "exchange": e.address}
        if x is not None:
            view.update(exchanges=x.exchanges, rows=x.rows, bytes_in=x.bytes_in, bytes_out=x.bytes_out,
                        idle_fraction=x.idle_fraction, refused_frames=x.refused_frames,
                        shared_exchanges=x.shared, placement_epoch=x.epoch,
                        owns_by_layer={str(layer): slots for layer, slots in sorted(x.owns.items())})
            if x.owns:
                view["owns"] = x.owns[min(x.owns)]
        return view


class PoolListener(Protocol):
    """What the pool tells the router."""

    async def on_worker_message(self, worker: WorkerHandle, msg: msgspec.Struct) -> None:
        """A request-level message (outputs, receive ready / refused, failures) from a live worker."""
        ...

    async def on_worker_lost(self, worker: WorkerHandle, reason: str) -> None:
        """`worker` was declared dead, fenced and dropped from the pool; its attempts need a new home."""
        ...

    def on_worker_retired(self, worker: WorkerHandle) -> None:
        """`worker` was drained and stopped: nothing was in flight on it."""
        ...

    def on_pool_health(self, reason: str | None) -> None:
        """The pool can serve again (None), or cannot: why (a worker restarting, a slot down, a pool task dead)."""
        ...


class WorkerPool:
    def __init__(self, engine: EngineConfig, launcher: Launcher, secret: bytes, config: PoolConfig = PoolConfig(),
                 connector: ConnectorSpec | None = None, host: str = "127.0.0.1",
                 encrypt_traffic: bool = False, prefill_engine: EngineConfig | None = None) -> None:
        self.engine_config, self.launcher, self.config, self.host = engine, launcher, config, host
        self.prefill_engine_config = prefill_engine or engine  # e.g. another KV dtype for the prefill pool
        self.connector = connector or ConnectorSpec()
        self.encrypt_traffic = encrypt_traffic  # CURVE on every control socket, ours and the workers'
        self._curve = curve_keys(secret, encrypt_traffic)
        self.listener: PoolListener | None = None
        self.workers: dict[str, WorkerHandle] = {}
        self.info: EngineInfo | None = None
        self._stats = EngineStats()
        self._stats_stale = False  # a worker's load changed since `stats` was last summed
        self.address = ""
        # NOTE: one session per pool: workers get it in their spec and take commands only from it; each
        # worker's session is learnt from its hello, which the codec admits only for a session never seen.
        self._codec = SequencedCodec(secret, FromWorker, Peer.fresh(ROUTER_NAME))
        self._ctx = zmq.asyncio.Context()
        self._next_index = dict.fromkeys(WorkerRole, 0)
        self._expert_exchanges: tuple[str, ...] = ()  # AFD: each expert worker's exchange address, by rank
        self._pool_experts: set[int] = set()  # AFD: every expert the pool's workers said they own
        self._ep_groups: dict[str, str] = {}  # worker name -> its expert-parallel group
        self._hello = asyncio.Event()
        self._launched_at: dict[str, float] = {}  # worker name -> when it was launched (monotonic), until its hello
        self._integrity: dict[str, asyncio.Future] = {}
        self._guard = TaskGuard(self._fail)
        self.supervisor = Supervisor(config.restart, self._relaunch, self._health_changed, self._guard.spawn)
        self.failed: str | None = None  # a pool task died: the pool is down for good (see `_fail`)
        self._reported_health: str | None = "not started"
        self._closing = False

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self, num_prefill: int, num_decode: int) -> None:
        """Start `num_prefill` prefill and `num_decode` decode workers (colocated `both` workers when
        there is no prefill pool) and wait until every one has said hello."""
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_FRAME_BYTES)
        curve_server(self._events, self._curve)
        port = self._events.bind_to_random_port(f"tcp://{self.host}")
        self.address = f"tcp://{self.host}:{port}"
        self._guard.spawn(self._event_loop(), "event loop", forever=True)
        self._guard.spawn(self._watchdog(), "watchdog", forever=True)
        decode_role = WorkerRole.DECODE if num_prefill else WorkerRole.BOTH
        if self.config.expert_workers:
            await self._start_expert_pool(decode_role, num_decode)
        names = [n for _ in range(num_prefill) for n in await self._add_unit(WorkerRole.PREFILL)]
        names += [n for _ in range(num_decode) for n in await self._add_unit(decode_role)]
        names += [n for _ in range(self.config.encode_workers) for n in await self._add_unit(WorkerRole.ENCODE)]
        await self.wait_for_workers(names, self.config.start_timeout_s)

    async def _start_expert_pool(self, attention_role: WorkerRole, num_attention: int) -> None:
        """The expert pool first (an attention worker's engine connects to every expert worker as it starts),
        placed together with the attention workers to come (`Launcher.launch_gang`: on Ray, one placement
        group). Each expert worker binds a port of the OS's choice and says which in its hello; its spec then
        keeps that port, so a replacement listens where the attention workers connect."""
        specs = [self._expert_spec(self.engine_config) for _ in range(self.config.expert_workers)]
        first = self._next_index[attention_role]
        joining = [worker_name(attention_role, first + i) for i in range(num_attention)]
        self._launched_at.update((spec.name, time.monotonic()) for spec in specs)
        await asyncio.to_thread(self.launcher.launch_gang, specs, joining)
        for spec in specs:
            self.supervisor.add(spec)
        await self.wait_for_workers([spec.name for spec in specs], self.config.start_timeout_s)
        exchanges = []
        for spec in specs:
            served, slot = self.workers[spec.name].experts, spec.expert_slot
            assert served is not None and slot is not None
            port = int(served.address.rsplit(":", 1)[1])
            self.supervisor.slots[spec.name].spec = msgspec.structs.replace(
                spec, expert_slot=msgspec.structs.replace(slot, port=port))
            exchanges.append(served.address)
        self._expert_exchanges = tuple(exchanges)

    async def add_worker(self, role: WorkerRole) -> str:
        """Start one more worker in `role` (an expert-parallel group: all its ranks; their names, joined by
        commas); it joins the pool when it says hello."""
        return ",".join(await self._add_unit(role))

    async def _add_unit(self, role: WorkerRole) -> list[str]:
        if role == WorkerRole.EXPERT:
            raise ValueError("expert workers are started with the pool (--expert-workers), not added one by one")
        engine = self.prefill_engine_config if role == WorkerRole.PREFILL else self.engine_config
        specs = self._unit_specs(role, engine)
        self._launched_at.update((spec.name, time.monotonic()) for spec in specs)
        # NOTE: off the event loop: a Ray launch waits for its placement group. A group's ranks are all
        # launched before any is waited for: each waits for the others at its rendezvous.
        if len(specs) > 1:
            await asyncio.to_thread(self.launcher.launch_group, specs)
        else:
            await asyncio.to_thread(self.launcher.launch, specs[0])
        for spec in specs:
            self.supervisor.add(spec)
            if spec.ep_group is not None:
                self._ep_groups[spec.name] = spec.ep_group
        return [spec.name for spec in specs]

    def _expert_spec(self, engine: EngineConfig) -> WorkerSpec:
        """An expert worker's spec: its rank of the expert pool is its index (it keeps both when replaced); its
        port is the OS's choice until its hello says which (`_start_expert_pool`)."""
        rank = self._next_index[WorkerRole.EXPERT]
        return self._spec(WorkerRole.EXPERT, engine,
                          expert_slot=ExpertSlot(rank=rank, size=self.config.expert_workers, port=0,
                                                 redundant=self.config.num_redundant_experts))

    def _unit_specs(self, role: WorkerRole, engine: EngineConfig) -> list[WorkerSpec]:
        if role.decodes and self._expert_exchanges:  # an attention worker of the expert pool
            engine = dataclasses.replace(engine, attention_ffn=AttentionFFNConfig(
                experts=self._expert_exchanges, index=self._next_index[role],
                micro_batches=self.config.afd_micro_batches, encrypt=self.encrypt_traffic,
                rebalance_interval_steps=self.config.eplb_interval_steps, balance_objective=self.config.eplb_objective))
        size = self.config.ep_size(role)
        if size == 1:
            return [self._spec(role, engine)]
        port = free_port(self.host)  # rank 0's rendezvous (a restarted group meets there again)
        group = f"kvbaton-{role.value}-ep{self._next_index[role] // size}"
        c = self.config
        return [self._spec(role, dataclasses.replace(engine, expert_parallel=ExpertParallelConfig(
            size=size, rank=rank, init_method=f"tcp://{self.host}:{port}", int8_dispatch=c.ep_int8_dispatch,
            num_redundant_experts=c.num_redundant_experts, rebalance_interval_steps=c.eplb_interval_steps,
            balance_objective=c.eplb_objective)), ep_group=group) for rank in range(size)]

    def _spec(self, role: WorkerRole, engine: EngineConfig, ep_group: str | None = None,
              expert_slot: ExpertSlot | None = None) -> WorkerSpec:
        spec = WorkerSpec(role=role, index=self._next_index[role], engine=engine, router=self.address,
                          router_session=self._codec.me.session.hex(),
                          host=self.host, connector=self.connector, heartbeat_s=self.config.heartbeat_s,
                          encrypt_traffic=self.encrypt_traffic, ep_group=ep_group, expert_slot=expert_slot)
        self._next_index[role] += 1
        return spec

    def ep_group_of(self, name: str) -> list[str]:
        """The names of `name`'s expert-parallel group (itself alone if it is in none)."""
        group = self._ep_groups.get(name)
        return [n for n, g in self._ep_groups.items() if g == group] if group is not None else [name]

    async def wait_for_workers(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(n in self.workers for n in names):
            dead = [n for n in names if n not in self.workers and not self.launcher.is_alive(n)]
            if dead:
                raise EngineDeadError(f"worker(s) {', '.join(dead)} exited during start-up")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"workers not ready after {timeout_s:.0f} s")
            self._hello.clear()
            try:
                await asyncio.wait_for(self._hello.wait(), 0.5)
            except TimeoutError:
                pass
        self._health_changed()

    async def drain_worker(self, name: str) -> None:
        """Stop routing to `name`; it shuts down once its requests are done (`Drained`).
        KeyError: no live worker of that name; ValueError: it is the last of its role."""
        worker = self.workers.get(name)
        if worker is None or not worker.alive:
            raise KeyError(name)
        if worker.role == WorkerRole.EXPERT:
            raise ValueError(f"{name} is an expert worker: every attention worker dispatches to it, so it cannot be "
                             "drained (stop the deployment, or let a failure replace it)")
        if name in self._ep_groups:
            raise ValueError(f"{name} is a rank of expert-parallel group {self._ep_groups[name]}; draining a "
                             "group is not supported yet (stop the deployment, or let a failure restart it)")
        # NOTE: the last encoder worker may go: the language workers encode what it would have
        if worker.role != WorkerRole.ENCODE and not any(
                w.routable and w.role == worker.role and w is not worker for w in self.workers.values()):
            raise ValueError(f"{name} is the last {worker.role.value} worker; add another before draining it")
        worker.draining = True
        await self.send(worker, Drain())

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        await self._guard.close()  # the restarts too: a replacement that had not joined yet is killed
        for worker in self.workers.values():
            if worker.alive:
                await self.send(worker, Shutdown())
        await asyncio.to_thread(self.launcher.stop_all, timeout_s)
        for worker in self.workers.values():
            worker.socket.close(linger=0)
        if self.address:
            self._events.close(linger=0)
        self._ctx.term()

    # ---- who is there ----------------------------------------------------------------------

    def routable(self, role: WorkerRole) -> list[WorkerHandle]:
        """Live, non-draining workers that can take `role`'s part (a `both` worker decodes too)."""
        return [w for w in self.workers.values()
                if w.routable and (w.role == role or (role == WorkerRole.DECODE and w.role == WorkerRole.BOTH))]

    def get(self, name: str | None) -> WorkerHandle | None:
        """The worker of that name if it is in the pool (None for None: a flight's unset slot)."""
        return self.workers.get(name) if name is not None else None

    @property
    def can_decode(self) -> bool:
        return any(w.alive and w.can_decode for w in self.workers.values())

    @property
    def down_reason(self) -> str | None:
        """None while the pool can serve; else why not (what /health and the 503s say)."""
        if self.failed is not None:
            return self.failed
        lost = [s.describe(self.config.restart) for s in self.supervisor.not_up()
                if s.spec.role == WorkerRole.EXPERT and s.state == SlotState.DOWN]
        # NOTE: a restarting one is not: what the attention workers post waits for its replacement; nor is one
        # whose experts all have copies on expert workers that are up (redundant experts: routed to them)
        if lost and not self._experts_served_by_live_workers() and not self._placed_around_soon():
            return f"{'; '.join(lost)}; the attention workers cannot compute the MoE layers without its experts"
        if self.can_decode:
            return None
        slots = [s.describe(self.config.restart) for s in self.supervisor.not_up() if s.spec.role.decodes]
        return f"engine core exited: {'; '.join(slots)}; no worker can decode" if slots else "no worker can decode"

    def _placed_around_soon(self) -> bool:
        """With EPLB on, attention worker 0 places the experts over the expert workers that are up once some
        expert has no copy among them, if their slots can hold every expert: the pool is not down meanwhile."""
        slots = sum(len(w.experts.experts) for w in self.workers.values() if w.alive and w.experts is not None)
        return bool(self.config.eplb_interval_steps) and slots >= len(self._pool_experts)

    def _experts_served_by_live_workers(self) -> bool:
        live = [(w.experts.experts, w.load.exchange.owns if w.load.exchange is not None else {})
                for w in self.workers.values() if w.alive and w.experts is not None]
        return every_expert_served(self._pool_experts, live)

    def view(self) -> list[dict[str, Any]]:
        """The workers in the pool, each with its slot's restart count, then the slots that are down for good.
        NOTE: a slot whose replacement is still starting shows once the replacement has joined."""
        joined = [{**w.view(), "restarts": self.supervisor.restarts(w.name), "ep_group": self._ep_groups.get(w.name)}
                  for w in self.workers.values()]
        down = [s.view(self.config.restart) for s in self.supervisor.not_up() if s.state == SlotState.DOWN]
        return joined + down

    def expert_view(self) -> dict[str, Any] | None:
        """The MoE load behind `GET /experts` (None: a dense model), see `expert_view`."""
        loads = {w.name: w.load.stats.expert_load for w in self.workers.values()
                 if w.alive and w.load.stats.expert_load is not None}
        return expert_view({n: load for n, load in loads.items() if load is not None}, self._ep_groups)

    @property
    def stats(self) -> EngineStats:
        """The pool's load and cache counters, summed over its workers when asked for (`/stats`, a `/metrics`
        scrape), not on each of their messages: a decode step's outputs carry its worker's load."""
        if self._stats_stale:
            self._stats_stale = False
            loads = [w.load.stats for w in self.workers.values() if w.alive and w.can_decode]
            if loads:  # none: the last figures stay (no worker can take requests now)
                # NOTE: load from the workers that take requests; cache counters from every worker (prefill ones too)
                self._stats = EngineStats.total(loads, [w.load.stats for w in self.workers.values() if w.alive])
                experts = [w.load.exchange for w in self.workers.values() if w.alive and w.load.exchange is not None]
                if experts and self._stats.afd is not None:  # AFD: the expert side's half of the bubble
                    expert_side = AfdStats(expert_busy_s=sum(x.busy_s for x in experts),
                                           expert_alive_s=sum(x.alive_s for x in experts))
                    self._stats = dataclasses.replace(self._stats, afd=self._stats.afd + expert_side)
        return self._stats

    async def check_integrity(self, timeout_s: float = 10.0) -> dict[str, IntegrityReport]:
        """Every live worker's KV integrity report (for tests and operators)."""
        loop = asyncio.get_running_loop()
        live = [w for w in self.workers.values() if w.alive]
        futures = {w.name: self._integrity.setdefault(w.name, loop.create_future()) for w in live}
        for worker in live:
            await self.send(worker, CheckIntegrity())
        try:
            done = await asyncio.wait_for(asyncio.gather(*futures.values()), timeout_s)
        finally:
            for name in futures:
                self._integrity.pop(name, None)
        return dict(zip(futures, done))

    async def send(self, worker: WorkerHandle, msg: msgspec.Struct) -> None:
        await worker.socket.send(self._codec.encode(msg, worker.name), copy=False)

    # ---- worker events ---------------------------------------------------------------------

    async def _event_loop(self) -> None:
        while True:
            frame = await self._events.recv(copy=False)
            received = self._codec.try_decode(frame.buffer, "router", hello=WorkerHello)
            if received is None:
                continue
            msg = received.msg
            if msg.name != received.header.sender.name:
                logger.warning("router: refused a frame: %s signed a message for %s", received.header.sender.name,
                               msg.name)
                continue
            try:
                await self._on_event(msg)
            except Exception:  # one bad event must not stop routing for everyone
                logger.exception("router: failed to handle %s", type(msg).__name__)

    async def _on_event(self, msg: FromWorker) -> None:
        if isinstance(msg, WorkerHello):
            self._register(msg)
            return
        worker = self.workers.get(msg.name)
        if worker is None or not worker.alive:
            return  # a worker declared dead: whatever it still says is ignored
        worker.last_seen = time.monotonic()
        if isinstance(msg, (Heartbeat, WorkerOutputs)) and msg.load.seq >= worker.load.seq:
            worker.load = msg.load
            self._stats_stale = True
        if isinstance(msg, Heartbeat):
            return
        if isinstance(msg, IntegrityReport):
            future = self._integrity.get(msg.name)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, Drained):
            if worker.draining:
                await self._retire(worker)
            else:  # NOTE: only a drain we sent is answered by retiring: a stray Drained must not stop a worker
                logger.warning("router: ignored a Drained from %s: no drain was sent to it", worker.name)
        elif self.listener is not None:
            await self.listener.on_worker_message(worker, msg)

    def _register(self, msg: WorkerHello) -> None:
        """A hello the codec admitted: a session it never saw (a worker started, or restarted under its name)."""
        socket = self._ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        curve_client(socket, self._curve)
        socket.connect(msg.address)
        launched = self._launched_at.pop(msg.name, None)
        ready_after = None if launched is None else time.monotonic() - launched
        self.workers[msg.name] = WorkerHandle(name=msg.name, role=msg.role, index=msg.index, pid=msg.pid,
                                              address=msg.address, info=msg.info, layout=msg.layout,
                                              receiver=msg.receiver, load=msg.load, socket=socket,
                                              experts=msg.experts, ready_after_s=ready_after,
                                              startup=dict(msg.startup))
        if self.info is None and msg.info is not None:
            self.info = msg.info
        if msg.experts is not None:
            self._pool_experts.update(msg.experts.experts)
        after = "" if ready_after is None else f" {ready_after:.1f} s after its launch"
        start = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in msg.startup.items())
        logger.info("%s ready%s (pid %d, %s; its start in s: %s)", msg.name, after, msg.pid, msg.address, start)
        self._stats_stale = True
        self._hello.set()

    async def _retire(self, worker: WorkerHandle) -> None:
        await self.send(worker, Shutdown())
        worker.alive = False
        await asyncio.to_thread(self.launcher.stop, worker.name)
        self._forget(worker)
        self.supervisor.remove(worker.name)
        self._health_changed()
        logger.info("%s drained and stopped", worker.name)
        if self.listener is not None:
            self.listener.on_worker_retired(worker)

    def _forget(self, worker: WorkerHandle) -> None:
        worker.socket.close(linger=0)
        del self.workers[worker.name]
        self._stats_stale = True

    # ---- failure detection -----------------------------------------------------------------

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(0.2, self.config.heartbeat_s))
            now = time.monotonic()
            for worker in list(self.workers.values()):
                if not worker.alive:
                    continue
                if not self.launcher.is_alive(worker.name):
                    await self._declare_dead(worker, "its process exited")
                elif now - worker.last_seen > self.config.dead_after_s:
                    await self._declare_dead(worker, f"no heartbeat for {now - worker.last_seen:.1f} s")

    async def _declare_dead(self, worker: WorkerHandle, reason: str) -> None:
        logger.error("%s is gone (%s); re-dispatching its %d request(s)", worker.name, reason, len(worker.attempts))
        worker.alive = False
        # NOTE: fence it: a worker that was only stalled must not come back and act on old requests.
        await asyncio.to_thread(self.launcher.kill, worker.name)
        self._forget(worker)
        if worker.draining or self._closing or self.failed is not None:
            self.supervisor.remove(worker.name)  # it was leaving anyway: nothing replaces it
        else:
            self.supervisor.worker_died(worker.name, reason)
        self._health_changed()  # before the re-dispatch: a request with nowhere to go fails with the reason
        if self.listener is not None:
            await self.listener.on_worker_lost(worker, reason)
        # NOTE: its group's other ranks cannot step without it (their exchanges would wait for it until they
        # time out): they go with it now, their requests re-dispatched, and the group restarts together
        for mate in self.ep_group_of(worker.name):
            other = self.workers.get(mate)
            if other is not None and other.alive:
                await self._declare_dead(other, f"its expert-parallel group lost {worker.name} ({reason})")

    # ---- supervision -----------------------------------------------------------------------

    async def _relaunch(self, spec: WorkerSpec) -> None:
        """The supervisor's restart: start `spec`'s worker again and wait for its hello. On failure
        (it exited, it timed out, we are shutting down) nothing of it is left running."""
        # NOTE: shielded: a launch cancelled half-way must still finish, so that what it started is killed.
        self._launched_at[spec.name] = time.monotonic()
        launch = asyncio.ensure_future(asyncio.to_thread(self.launcher.launch, spec))
        try:
            await asyncio.shield(launch)
            await self.wait_for_workers([spec.name], self.config.start_timeout_s)
        except BaseException:
            await asyncio.wait({launch})
            await asyncio.to_thread(self.launcher.kill, spec.name)
            raise

    def _health_changed(self) -> None:
        """Tell the router when the pool goes down (and why) or can serve again."""
        reason = self.down_reason
        if reason == self._reported_health:
            return
        self._reported_health = reason
        if reason is None:
            logger.info("the pool can serve")
        else:
            logger.warning("the pool cannot serve: %s", reason)
        if self.listener is not None:
            self.listener.on_pool_health(reason)

    # ---- a pool task that died ---------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        # NOTE: a pool task that dies is a bug in kvbaton, not a worker fault: restarting it would most
        # likely die the same way, in a loop, while requests hang. So the pool goes down for good,
        # loudly: /health says why (so an orchestrator restarts the server) and every request fails.
        if self.failed is not None:
            return
        self.failed = f"internal error, restart the server: {reason}"
        logger.error("the pool is down for good: %s", self.failed)
        self._guard.spawn(self._take_down(), "take-down")

    async def _take_down(self) -> None:
        """Fence every worker and fail their requests (the router finds no worker left to re-dispatch to)."""
        try:
            lost = list(self.workers.values())
            for worker in lost:
                worker.alive = False
            await self.supervisor.close()
            for worker in lost:
                await asyncio.to_thread(self.launcher.kill, worker.name)
                self._forget(worker)
            self._health_changed()
            for worker in lost:
                if self.listener is not None:
                    await self.listener.on_worker_lost(worker, str(self.failed))
        except Exception:
            logger.exception("the pool could not take itself down cleanly")
