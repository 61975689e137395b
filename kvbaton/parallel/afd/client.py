"""An attention worker's end of its expert pool: a ZeroMQ DEALER per expert worker, the pool's placement learnt
from their welcomes, and each MoE block's dispatcher (`RemoteExperts`).

`post` routes a layer's rows to the slots of their experts (a hot expert's copies shared as expert parallelism
shares them, `choose_slots`), sends each expert worker its rows and returns at once; `wait` takes the outputs
back and combines them by the routing weights, in the order a single process sums them (fp32 output equal to
the colocated engine's). Between the two, a micro-batched step computes its next micro-batch.

An expert worker that does not answer within the timeout, answers `ExchangeFailed`, or whose connection drops
while an exchange waits on it (it died: ZeroMQ's monitor says so at once), fails the step (`ExpertPoolError`);
every exchange in flight is then abandoned and its late replies dropped. What is posted afterwards queues on the
socket until the worker's replacement (same address) connects.

An expert worker whose welcome proves it shares this host's /dev/shm gets its rows through owner-only
shared-memory slots (`shared_rows.py`) unless the config turns that off: only small frames naming the slot cross,
over a Unix socket of this user's (`local_channel.py`), and no byte of rows is copied into a frame or signed.
Where that socket is down (its expert worker died and the replacement is not up yet) they go signed over the
ZeroMQ socket, which queues them until the replacement connects; the Unix socket is tried again now and then.

With redundant experts in the pool (`ExpertMap.mirrored`), a worker whose connection dropped is routed around
while every expert it holds has a copy on a worker that is up: only the exchanges it held fail, and the next
steps go on without waiting for its replacement, whose slots are used again once it connects.

Placements are numbered (epochs, `pool_balance.py`): every dispatch names the epoch its slot ids are of, every
answer says the newest epoch its expert worker holds. Between two steps (`between_steps`) the client switches to a
newer placement once every expert worker holds it, tells a replacement expert worker the placement in use, and,
on attention worker 0 with EPLB on, plans the next placement every interval of busy steps."""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from typing import TypeVar

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvbaton.config import AttentionFFNConfig, ConfigError
from kvbaton.layers.moe.dispatch import ExpertMap, choose_slots, combine
from kvbaton.layers.moe.eplb import rebalance_layer
from kvbaton.parallel.afd.frames import (
    CombinedRows,
    CombinedShared,
    DispatchRows,
    DispatchShared,
    ExchangeFailed,
    FromExpert,
    LoadQuery,
    PlaceExperts,
    Placing,
    PoolHello,
    PoolLoad,
    PoolWelcome,
    ToExpert,
    max_frame_bytes,
)
from kvbaton.parallel.afd.local_channel import MAX_LOCAL_FRAME_BYTES, connect_local
from kvbaton.parallel.afd.pool_balance import PoolBalancer
from kvbaton.parallel.afd.server import DEFAULT_MAX_ROWS, bytes_of, rows_of
from kvbaton.parallel.afd.shared_rows import Slot, SlotPool, probe_matches, views
from kvbaton.wire import ChannelError, Codec, SignedCodec, curve_client, curve_keys

logger = logging.getLogger(__name__)
Answer = TypeVar("Answer", PoolWelcome, Placing, PoolLoad)


UP_EVENT = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED)  # a (re)connected expert worker
LOCAL_RETRY_S = 0.05  # how often a post tries to reach a same-host expert worker's Unix socket again
RESYNC_S = 5.0  # after this long without an exchange, ask the pool for its placement before the next step
# (well under the expert workers' RETAIN_S: an idle attention worker catches up before its epoch is dropped)
PLACEMENT_POLL_S = 0.02  # how often a step waiting for a placement around down workers asks for it
DOWN_GRACE_S = 1.0  # the leader re-places a down worker's uncopied experts after this long (not on a blip)
PLAN_PATIENCE_STEPS = 50  # busy steps a leader waits for its last plan to be adopted before it plans anew
CONTROL = (PoolWelcome, Placing, PoolLoad)  # the answers a step does not wait for: taken by `_control`


class ExpertPoolError(RuntimeError):
    """An exchange with the expert pool failed: the step fails, its requests go the failure path."""


@dataclass
class Pending:
    """One posted exchange: what `wait` needs to take its outputs back."""

    ticket: int
    parts: list[tuple[int, int]]  # (expert worker, rows sent to it), in pool-rank order
    order: torch.Tensor  # assignment indices sorted by slot (the order the rows went out)
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


@dataclass
class ClientStats:
    exchanges: int = 0
    wait_s: float = 0.0  # attention blocked on the experts (the attention side's bubble)
    step_s: float = 0.0  # the model steps the waits fell in (the engine counts them)
    bytes_sent: int = 0
    bytes_received: int = 0


class ExpertPoolClient:
    def __init__(self, config: AttentionFFNConfig, secret: bytes, name: str, hidden: int, dtype: torch.dtype,
                 num_experts: int, moe_layers: list[int], max_rows: int = DEFAULT_MAX_ROWS, num_groups: int = 1,
                 ) -> None:
        self.config = config
        self.hidden, self.dtype, self.num_experts = hidden, dtype, num_experts
        self.moe_layers = list(moe_layers)
        self.dtype_name = str(dtype).removeprefix("torch.")
        self._row_bytes = hidden * dtype.itemsize
        limit = max_frame_bytes(max_rows, hidden, self.dtype_name)
        self._codec = SignedCodec(secret, FromExpert, limit)
        self._requests = SignedCodec(secret, ToExpert, limit)
        self._ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._monitors: list[zmq.Socket] = []  # each socket's disconnections
        curve = curve_keys(secret, config.encrypt)
        for address in config.experts:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.MAXMSGSIZE, limit)
            dealer.setsockopt(zmq.LINGER, 0)
            curve_client(dealer, curve)
            self._sockets.append(dealer)
            self._monitors.append(dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED | UP_EVENT))
            dealer.connect(address)
        self._next_ticket = 1
        self._in_flight: set[int] = set()
        self._awaiting: list[set[int]] = [set() for _ in config.experts]  # per worker: tickets it has not answered
        self._lost: set[int] = set()  # tickets a dropped connection took with it
        self._down: set[int] = set()  # workers whose connection dropped and is not back
        self._routed_without: frozenset[int] = frozenset()  # the down workers the slot table leaves out
        self._early: dict[tuple[int, int], FromExpert] = {}  # (worker, ticket) answered before it was waited for
        self._shared: list[SlotPool | None] = []  # per worker: its shared-memory slots (None: rows in frames)
        self._in_slot: dict[tuple[int, int], Slot] = {}  # (worker, ticket): the slot an exchange's rows are in
        self._local: list[socket.socket | None] = [None for _ in config.experts]  # same-host control sockets
        self._local_names: list[str] = ["" for _ in config.experts]
        self._local_retry = [0.0 for _ in config.experts]  # when to try a down one again
        self._local_requests = Codec(ToExpert, MAX_LOCAL_FRAME_BYTES)
        self._local_replies = Codec(FromExpert, MAX_LOCAL_FRAME_BYTES)
        self.stats = ClientStats()
        self._hello = PoolHello(name, hidden, self.dtype_name, num_experts)
        self.epoch = 0  # the placement this worker routes by
        self.maps: dict[int, ExpertMap] = {}  # per MoE layer, at `epoch`
        self._placement: list[list[int]] = []  # the same, as PlaceExperts carries it
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per layer: (slot table, copies)
        self._ready = [0 for _ in config.experts]  # per worker: the newest epoch it said it holds
        self._needs_place: set[int] = set()  # workers to tell the placement in use (a replacement)
        self._last_exchange = time.monotonic()
        self._placing = 0  # the newest epoch this worker (the leader) handed out
        self._placed_at = 0  # in busy steps (an epoch never adopted is given up after PLAN_PATIENCE_STEPS)
        self._down_since: tuple[frozenset[int], float] | None = None  # the workers down, and since when
        self._around: tuple[tuple[frozenset[int], int] | None, bool] = (None, True)  # `_routes_around`'s last answer
        self.rebalances = 0  # newer placements switched to
        self.balancer = PoolBalancer(config.rebalance_interval_steps, num_experts, num_groups,
                                     "active_experts" if config.balance_objective == "active_experts" else "tokens",
                                     ) if config.index == 0 and config.rebalance_interval_steps else None
        try:
            welcomes = self._welcomes()
            deadline = time.monotonic() + config.timeout_s
            while not self._adopt(welcomes):  # a rebalance half-way through: its workers hold different epochs
                if time.monotonic() > deadline:
                    raise ExpertPoolError("the expert workers did not agree on a placement within "
                                          f"{config.timeout_s:g} s")
                welcomes = self._welcomes()
            self._shared = [SlotPool(self._row_bytes) if config.shared_memory and probe_matches(w.probe, w.probe_token)
                            else None for w in welcomes.values()]
            for worker, w in welcomes.items():
                if self._shared[worker] is not None and w.local:
                    self._local_names[worker] = w.local
                    self._local[worker] = connect_local(w.local, config.timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def shared_memory(self) -> list[bool]:
        """Per expert worker: whether its rows go through shared memory."""
        return [pool is not None for pool in self._shared]

    @property
    def local_channels(self) -> list[bool]:
        """Per expert worker: whether its frames go over a same-host Unix socket now."""
        return [sock is not None for sock in self._local]

    def _control(self, worker: int, msg: ToExpert, answer: type[Answer]) -> Answer:
        """Send a control frame to `worker` and wait for its answer (between steps: nothing else waits on it)."""
        self._sockets[worker].send(self._requests.encode(msg), copy=False)
        reply = self._receive(worker, None, answer)
        if not isinstance(reply, answer):
            raise ExpertPoolError(f"expert worker {self.config.experts[worker]} answered {type(reply).__name__} "
                                  f"to {type(msg).__name__}")
        return reply

    def _welcomes(self, workers: list[int] | None = None) -> dict[int, PoolWelcome]:
        """The welcome of each of `workers` (default: all), by pool rank."""
        return {w: self._control(w, self._hello, PoolWelcome)
                for w in (range(len(self._sockets)) if workers is None else workers)}

    def _adopt(self, welcomes: dict[int, PoolWelcome]) -> bool:
        """Route by the placement the welcomes (of every worker, or of those up) describe; False (nothing changed)
        while they hold different newest epochs. ConfigError where a worker serves another model."""
        size = len(self._sockets)
        for worker, w in welcomes.items():
            where = self.config.experts[worker]
            if (w.rank, w.size) != (worker, size):
                raise ConfigError(f"expert worker {where} is rank {w.rank} of {w.size}, expected {worker} of {size}")
            if (w.hidden, w.dtype, w.num_experts) != (self.hidden, self.dtype_name, self.num_experts):
                raise ConfigError(f"expert worker {where} serves hidden {w.hidden}, {w.dtype}, {w.num_experts} "
                                  f"experts; this model has {self.hidden}, {self.dtype_name}, {self.num_experts}")
            if sorted(w.layers) != sorted(self.moe_layers) or len(w.placement) != len(w.layers):
                raise ConfigError(f"expert worker {where} holds MoE layers {w.layers}, this model has "
                                  f"{self.moe_layers}")
            self._ready[worker] = w.epoch
        first = next(iter(welcomes.values()))
        if len({w.epoch for w in welcomes.values()}) > 1 or any(w.placement != first.placement
                                                                for w in welcomes.values()):
            return False
        rows = dict(zip(first.layers, first.placement, strict=True))
        try:
            self.maps = {layer: ExpertMap(tuple(rows[layer]), size) for layer in self.moe_layers}
        except ValueError as exc:
            raise ExpertPoolError(f"the expert pool's placement does not split over its workers: {exc}") from exc
        self.epoch = first.epoch
        self._placement = [list(self.maps[layer].physical_to_logical) for layer in self.moe_layers]  # what it hands on
        self._tables.clear()
        return True

    @property
    def down(self) -> frozenset[int]:
        """The expert workers (pool ranks) whose connection dropped and is not back, as of now."""
        for worker in range(len(self._sockets)):
            self._note_disconnects(worker)
        return frozenset(self._down)

    def _routing(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer`'s slot table for the next exchange: without the down workers' slots while copies of all their
        experts are up elsewhere (redundant experts); with them otherwise (their rows wait for the replacement)."""
        down = self.down
        if down != self._routed_without:
            self._tables.clear()
            self._routed_without = down
            if down:
                logger.warning("expert pool: workers %s down; routing around them where copies of their experts "
                               "are up", sorted(down))
        table = self._tables.get(layer)
        if table is None:
            expert_map = self.maps[layer]
            try:
                table = expert_map.lookup(self.num_experts, down)
            except ValueError:  # some expert has no copy up: its rows queue for the replacement
                table = expert_map.lookup(self.num_experts)
            self._tables[layer] = table
        return table

    def post(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Pending:
        """Send layer `layer`'s rows x [T, H] (routed to ids [T, k] by weights [T, k]) to their experts' workers."""
        if self._down and self.config.rebalance_interval_steps and not self._routes_around(self.down):
            self._wait_for_placement_around()
        slot_table, copies = self._routing(layer)
        tokens, slots = choose_slots(ids, slot_table, copies, 1, self.config.index)
        order = torch.argsort(slots, stable=True)
        sorted_slots = slots[order]
        rows = x[tokens[order]].to(self.dtype)
        expert_map = self.maps[layer]
        per = expert_map.slots_per_rank
        counts = torch.bincount(sorted_slots // per, minlength=expert_map.num_ranks).tolist()
        local = (sorted_slots % per).to(torch.int32)
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        parts, start = [], 0
        for worker, n in enumerate(counts):
            if not n:
                continue
            # NOTE: a replacement holds placement 0 only: the placement in use goes first, and the dispatch after
            # it on the same socket (not the Unix one, which could overtake it): the worker loads, then serves it
            placing = bool(self.epoch) and (worker in self._down or worker in self._needs_place)
            if placing:
                self.stats.bytes_sent += self._send_placement(worker)
            msg = self._dispatch(worker, ticket, layer, rows[start:start + n], local[start:start + n])
            self.stats.bytes_sent += self._send(worker, msg, local=not placing)
            self._awaiting[worker].add(ticket)
            parts.append((worker, n))
            start += n
        self._in_flight.add(ticket)
        self.stats.exchanges += 1
        self._last_exchange = time.monotonic()
        return Pending(ticket, parts, order, x, ids, weights)

    def _send(self, worker: int, msg: DispatchRows | DispatchShared, local: bool = True) -> int:
        """Send a dispatch to `worker` (over its Unix socket where it has one up, unless not `local`); the
        frame's bytes."""
        sock = self._local_socket(worker) if local and isinstance(msg, DispatchShared) else None
        if sock is not None:
            frame = self._local_requests.encode(msg)
            try:
                sock.send(frame)
                return len(frame)
            except OSError:  # it died: what it had not answered is lost; this one goes over ZeroMQ
                self._local_down(worker)
        frame = self._requests.encode(msg)
        self._note_disconnects(worker)  # before the send: a drop seen later can only have taken this frame
        self._sockets[worker].send(frame, copy=False)
        return len(frame)

    def _send_placement(self, worker: int) -> int:
        """Hand `worker` the placement in use without waiting (its `Placing` answer is dropped: a refusal shows
        as a failed dispatch, and `between_steps` tries again); the frame's bytes."""
        frame = self._requests.encode(PlaceExperts(self.epoch, self._placement))
        self._sockets[worker].send(frame, copy=False)
        self._needs_place.discard(worker)
        return len(frame)

    def _local_socket(self, worker: int) -> socket.socket | None:
        """`worker`'s same-host socket, reconnected (at most every LOCAL_RETRY_S) where it went down."""
        sock = self._local[worker]
        if sock is None and self._local_names[worker] and time.monotonic() >= self._local_retry[worker]:
            sock = self._local[worker] = connect_local(self._local_names[worker], self.config.timeout_s)
            self._local_retry[worker] = time.monotonic() + LOCAL_RETRY_S
            if sock is not None:  # it listens again (it had only dropped this connection, or was replaced)
                self._up(worker)
        return sock

    def _local_down(self, worker: int) -> None:
        """`worker`'s same-host socket closed: the process died, taking every exchange it had not answered."""
        sock = self._local[worker]
        if sock is not None:
            sock.close()
            self._local[worker] = None
            self._local_retry[worker] = time.monotonic() + LOCAL_RETRY_S
        self._lost |= self._awaiting[worker]
        self._awaiting[worker].clear()
        self._down.add(worker)

    def _dispatch(self, worker: int, ticket: int, layer: int, rows: torch.Tensor, local: torch.Tensor
                  ) -> DispatchRows | DispatchShared:
        """The dispatch of `rows` (and their slot ids `local`) to `worker`: the rows themselves, or, through
        shared memory, the slot they were copied into."""
        slots = self._shared[worker]
        if slots is None:
            return DispatchRows(ticket, layer, self.epoch, bytes_of(rows), bytes_of(local))
        n = rows.shape[0]
        try:
            slot = slots.take(n)
        except OSError as exc:  # /dev/shm full (a container's 64 MiB): this exchange's rows go in the frame
            logger.warning("expert pool: no shared-memory slot for %d rows (%s); sending them in the frame", n, exc)
            return DispatchRows(ticket, layer, self.epoch, bytes_of(rows), bytes_of(local))
        shared_rows, shared_ids, _ = views(slot.segment, slot.layout, n, self.dtype, self.hidden)
        shared_rows.copy_(rows)
        shared_ids.copy_(local)
        self._in_slot[(worker, ticket)] = slot
        self.stats.bytes_sent += n * (self._row_bytes + 4)
        return DispatchShared(ticket, layer, self.epoch, slot.name, slot.layout.capacity, n)

    def _outputs(self, worker: int, ticket: int, reply: CombinedRows | CombinedShared, n: int) -> torch.Tensor:
        """A reply's output rows [n, hidden] (over the frame or the slot: read them before the slot goes back)."""
        if isinstance(reply, CombinedShared):
            slot = self._in_slot.get((worker, ticket))
            if slot is None:
                raise ExpertPoolError(f"expert worker {self.config.experts[worker]} answered through shared "
                                      "memory an exchange that was not sent so")
            self.stats.bytes_received += n * self._row_bytes
            return views(slot.segment, slot.layout, n, self.dtype, self.hidden)[2]
        out = rows_of(reply.rows, self.dtype, self.hidden)
        if out.shape[0] != n:
            raise ExpertPoolError(f"expert worker {self.config.experts[worker]} answered {out.shape[0]} "
                                  f"rows for {n}")
        return out

    def wait(self, pending: Pending) -> torch.Tensor:
        """The combined expert outputs [T, H] of a posted exchange."""
        began = time.perf_counter()
        try:
            outs = []
            for worker, n in pending.parts:
                reply = self._receive(worker, pending.ticket)
                if isinstance(reply, ExchangeFailed):
                    if reply.ready < self.epoch:  # a replacement, or it lost the placement: tell it before the next
                        self._needs_place.add(worker)
                    raise ExpertPoolError(f"expert worker {self.config.experts[worker]}: {reply.message}")
                assert isinstance(reply, CombinedRows | CombinedShared)
                outs.append(self._outputs(worker, pending.ticket, reply, n))
            x = pending.x
            sorted_rows = torch.cat(outs) if outs else x.new_empty(0, self.hidden)
            rows = torch.empty(sorted_rows.shape, dtype=x.dtype)
            rows[pending.order] = sorted_rows.to(x.dtype)  # back in assignment order (a copy: slots can go back)
        except BaseException:
            self.abandon()
            raise
        finally:
            self.stats.wait_s += time.perf_counter() - began
        self._in_flight.discard(pending.ticket)
        for worker, _ in pending.parts:
            slot = self._in_slot.pop((worker, pending.ticket), None)
            pool = self._shared[worker]
            if slot is not None and pool is not None:
                pool.give_back(slot)
        return combine(x, rows, pending.ids, pending.weights)

    def abandon(self) -> None:
        """Give up every exchange in flight (its step failed): their replies, whenever they come, are dropped."""
        self._in_flight.clear()
        self._early.clear()
        self._lost.clear()
        for tickets in self._awaiting:
            tickets.clear()
        for slot in self._in_slot.values():  # never reused: a late expert worker may still write them
            slot.retire()
        self._in_slot.clear()

    def _note_disconnects(self, worker: int) -> None:
        """A dropped connection to `worker` (it died) loses the exchanges it had not answered."""
        monitor = self._monitors[worker]
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._lost |= self._awaiting[worker]
                self._awaiting[worker].clear()
                self._down.add(worker)
            elif event == UP_EVENT:
                self._up(worker)

    def _up(self, worker: int) -> None:
        """`worker`'s connection is up again: if it had dropped, the process may be a replacement, which holds the
        first placement only until told the one in use."""
        if worker in self._down:
            self._down.discard(worker)
            self._needs_place.add(worker)

    # ---- placements ------------------------------------------------------------------------------

    def between_steps(self, busy: bool = True) -> None:
        """Before a step, with nothing in flight: a replacement told the placement in use, the switch to a newer
        placement once every expert worker holds it, and (attention worker 0, EPLB on) the next plan every
        interval of busy steps. ExpertPoolError if an expert worker fails to answer (the step fails)."""
        down = self.down
        if self.epoch and self._needs_place - down:
            for worker in sorted(self._needs_place - down):
                self._place(worker, self.epoch, self._placement)
        up = [w for w in range(len(self._sockets)) if w not in down]
        if not down:
            self._down_since = None
        elif self.balancer is not None:
            self._place_around(down, up)
        if any(self._ready[w] != self.epoch for w in up) or time.monotonic() - self._last_exchange > RESYNC_S:
            self._sync(up)
        if down:
            return  # (EPLB waits: a plan needs every expert worker's load and every one to load it)
        if busy and self.balancer is not None and self.balancer.due():
            if not self._plan_pending():
                self._rebalance()

    def _plan_pending(self) -> bool:
        """The leader handed out a placement not adopted yet, and has not given up waiting for it."""
        return self._placing > self.epoch and self.balancer is not None \
            and self.balancer.busy_steps < self._placed_at + PLAN_PATIENCE_STEPS

    def _place(self, worker: int, epoch: int, placement: list[list[int]]) -> bool:
        """Hand `worker` placement `epoch`; whether it holds or loads it now."""
        reply = self._control(worker, PlaceExperts(epoch, placement), Placing)
        if reply.refused:
            logger.warning("expert pool: %s refused placement epoch %d: %s", self.config.experts[worker], epoch,
                           reply.refused)
            return False
        self._needs_place.discard(worker)
        return True

    def _sync(self, workers: list[int]) -> None:
        """Catch `workers` (those up) up to the newest placement any of them holds (hand it to those behind: a
        replacement, one that missed a plan), and route by it once every one holds it."""
        self._last_exchange = time.monotonic()
        if not workers:
            return
        welcomes = self._welcomes(workers)
        newest = max(welcomes.values(), key=lambda w: w.epoch)
        for worker, w in welcomes.items():
            if w.epoch < newest.epoch:
                self._place(worker, newest.epoch, newest.placement)
        before = self.epoch
        if self._adopt(welcomes) and self.epoch != before:
            self.rebalances += 1
            logger.info("expert pool: placement epoch %d (was %d); first MoE layer: %s", self.epoch, before,
                        self.maps[self.moe_layers[0]].physical_to_logical)

    def _place_around(self, down: frozenset[int], up: list[int]) -> None:
        """The leader, with expert workers down: if some expert has no copy on a worker that is up, and has not
        for DOWN_GRACE_S, place the experts anew over the workers that are up (when their slots can hold every
        expert), so the steps go on without waiting for a replacement. The down workers' slots keep what they
        held: nothing routes to them while they are down, and a replacement is handed this placement."""
        now = time.monotonic()
        if self._down_since is None or not down <= self._down_since[0]:
            self._down_since = (down, now)
        if now - self._down_since[1] < DOWN_GRACE_S or self._plan_pending() or not up or self._routes_around(down):
            return
        per = self.maps[self.moe_layers[0]].slots_per_rank
        if per * len(up) < self.num_experts:
            return  # the survivors' slots cannot hold every expert: the pool waits for a replacement
        assert self.balancer is not None
        spread = rebalance_layer([1.0] * self.num_experts, num_replicas=per * len(up),
                                 num_groups=self.balancer.num_groups, num_nodes=1, num_ranks=len(up))
        placement = []
        for layer in self.moe_layers:
            held = self.maps[layer].physical_to_logical
            row: list[int] = []
            for worker in range(len(self._sockets)):
                source = (spread.physical_to_logical, up.index(worker)) if worker in up else (held, worker)
                row += source[0][source[1] * per:(source[1] + 1) * per]
            placement.append(row)
        epoch = max(self.epoch, self._placing, *self._ready) + 1
        self._placing = epoch
        self._placed_at = self.balancer.busy_steps
        placed = sum(self._place(w, epoch, placement) for w in up)
        logger.warning("expert pool: workers %s down with experts no copy of which is up: placement epoch %d puts "
                       "every expert on the %d workers up (%d took it)", sorted(down), epoch, len(up), placed)

    def _wait_for_placement_around(self) -> None:
        """Workers are down and some expert has no copy up, with EPLB on: rather than queue rows for a replacement
        that may never come, wait (the step in flight) until the connection is back or a placement that puts every
        expert on the workers up is held by all of them (the leader makes it, `_place_around`). Where the workers
        up cannot hold every expert, the rows queue for the replacement as without EPLB."""
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            down = self.down
            up = [w for w in range(len(self._sockets)) if w not in down]
            if not down or self._routes_around(down):
                return
            if self.maps[self.moe_layers[0]].slots_per_rank * len(up) < self.num_experts:
                return
            if time.monotonic() > deadline:
                raise ExpertPoolError(f"expert workers {sorted(down)} are down, no copy of some of their experts is "
                                      f"up, and no placement around them came within {self.config.timeout_s:g} s")
            if self.balancer is not None:
                self._place_around(down, up)
            self._sync(up)
            time.sleep(PLACEMENT_POLL_S)

    def _routes_around(self, down: frozenset[int]) -> bool:
        """Whether every expert of every layer has a slot on a worker that is not `down` (at this placement)."""
        key = (down, self.epoch)
        if self._around[0] != key:
            every = set(range(self.num_experts))
            maps = [self.maps[layer] for layer in self.moe_layers]
            around = all(every <= {e for slot, e in enumerate(m.physical_to_logical)
                                   if slot // m.slots_per_rank not in down} for m in maps)
            self._around = (key, around)
        return self._around[1]

    def _rebalance(self) -> None:
        """EPLB's turn (the leader): plan from the pool's load since the last plan and hand it out."""
        assert self.balancer is not None
        loads = [self._control(w, LoadQuery(), PoolLoad) for w in range(len(self._sockets))]
        window = self.balancer.window([load.counts for load in loads])
        placement = self.balancer.plan(window, [self.maps[layer] for layer in self.moe_layers])
        if placement is None:
            return
        epoch = max(self.epoch, self._placing, *self._ready) + 1
        self._placing, self._placed_at = epoch, self.balancer.busy_steps
        placed = sum(self._place(w, epoch, placement) for w in range(len(self._sockets)))
        logger.info("expert pool: EPLB placement epoch %d handed to %d of %d expert workers", epoch, placed,
                    len(self._sockets))

    def _receive(self, worker: int, ticket: int | None, answer: type = PoolWelcome) -> FromExpert:
        """The reply of `worker` to `ticket` (None: its next control answer of type `answer`; one of another type
        is left over from a placement sent without waiting, and dropped); replies to other exchanges in flight
        are kept."""
        if ticket is not None and (worker, ticket) in self._early:
            self._awaiting[worker].discard(ticket)
            return self._early.pop((worker, ticket))
        zsocket, deadline = self._sockets[worker], time.monotonic() + self.config.timeout_s
        while True:
            if ticket in self._lost:
                raise ExpertPoolError(f"expert worker {self.config.experts[worker]} dropped its connection with an "
                                      "exchange in flight (it died)")
            if ticket is None and worker in self._down:  # a control frame's answer: it went with the connection
                raise ExpertPoolError(f"expert worker {self.config.experts[worker]} dropped the connection before "
                                      "it answered (it died, or refused the handshake: --encrypt-traffic on one "
                                      "side only?)")
            poller = zmq.Poller()
            poller.register(zsocket, zmq.POLLIN)
            poller.register(self._monitors[worker], zmq.POLLIN)
            local = self._local[worker]
            if local is not None:
                poller.register(local, zmq.POLLIN)
            left_ms = int((deadline - time.monotonic()) * 1000)
            ready = dict(poller.poll(left_ms)) if left_ms > 0 else {}
            if self._monitors[worker] in ready:
                self._note_disconnects(worker)
            if local is not None and local.fileno() in ready:  # a plain socket comes back as its fd
                reply = self._read_local(worker, local)
            elif zsocket in ready:
                reply = self._read(worker, zsocket.recv(copy=True))
            elif ready:
                continue  # a disconnection: the loop's first check says whether it took this exchange
            else:
                raise ExpertPoolError(f"expert worker {self.config.experts[worker]} did not answer within "
                                      f"{self.config.timeout_s:g} s")
            if reply is None:
                continue
            self._ready[worker] = reply.epoch if isinstance(reply, PoolWelcome) else reply.ready
            if isinstance(reply, CONTROL):
                if ticket is None and isinstance(reply, answer):
                    return reply
                continue
            self._awaiting[worker].discard(reply.ticket)
            if reply.ticket == ticket:
                return reply
            if reply.ticket in self._in_flight:
                self._early[(worker, reply.ticket)] = reply
            # else: a reply to an abandoned exchange, dropped

    def _read(self, worker: int, frame: bytes) -> FromExpert | None:
        """A frame from `worker`'s ZeroMQ socket, verified and decoded (None: refused)."""
        self.stats.bytes_received += len(frame)
        try:
            return self._codec.decode(frame)
        except ChannelError as exc:
            logger.warning("expert pool: refused a frame from %s: %s", self.config.experts[worker], exc)
            return None

    def _read_local(self, worker: int, sock: socket.socket) -> FromExpert | None:
        """A frame from `worker`'s same-host socket (None: refused, or the socket closed: `_local_down`)."""
        try:
            frame = sock.recv(MAX_LOCAL_FRAME_BYTES + 1)
        except OSError:
            frame = b""
        if not frame:
            self._local_down(worker)
            return None
        self.stats.bytes_received += len(frame)
        try:
            reply = self._local_replies.decode(frame)
        except ChannelError as exc:
            logger.warning("expert pool: refused a same-host frame from %s: %s", self.config.experts[worker], exc)
            return None
        return None if isinstance(reply, CONTROL) else reply

    def dispatcher(self, layer: int) -> RemoteExperts:
        return RemoteExperts(self, layer)

    def close(self) -> None:
        self.abandon()
        for pool in self._shared:
            if pool is not None:
                pool.close()
        for sock in self._local:
            if sock is not None:
                sock.close()
        for dealer, monitor in zip(self._sockets, self._monitors, strict=False):
            dealer.disable_monitor()
            monitor.close(linger=0)
            dealer.close(linger=0)
        for dealer in self._sockets[len(self._monitors):]:
            dealer.close(linger=0)
        self._ctx.term()


class RemoteExperts:
    """A MoE block's dispatcher (`layers.moe.dispatch.ExpertDispatcher`) when its experts are in the pool."""

    def __init__(self, pool: ExpertPoolClient, layer: int) -> None:
        self.pool = pool
        self.layer = layer

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.pool.wait(self.pool.post(self.layer, x, ids, weights))

    def post(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Pending:
        return self.pool.post(self.layer, x, ids, weights)

    def wait(self, pending: Pending) -> torch.Tensor:
        return self.pool.wait(pending)

    def idle_exchange(self, hidden_size: int, dtype: torch.dtype) -> None:
        """Nothing: the expert pool serves whoever sends, no lockstep to keep."""
