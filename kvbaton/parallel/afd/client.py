"""An attention worker's end of its expert pool: a ZeroMQ DEALER per expert worker, the pool's placement learnt
from their welcomes, and each MoE block's dispatcher (`RemoteExperts`).

`post` routes a layer's rows to the slots of their experts (a hot expert's copies shared as expert parallelism
shares them, `choose_slots`), sends each expert worker its rows and returns at once; `wait` takes the outputs
back and combines them by the routing weights, in the order a single process sums them (fp32 output equal to
the colocated engine's). Between the two, a micro-batched step computes its next micro-batch.

An expert worker that does not answer within the timeout, answers `ExchangeFailed`, or whose connection drops
while an exchange waits on it (it died: ZeroMQ's monitor says so at once), fails the step (`ExpertPoolError`);
every exchange in flight is then abandoned and its late replies dropped. What is posted afterwards queues on the
socket until the worker's replacement (same address) connects."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvbaton.config import AttentionFFNConfig, ConfigError
from kvbaton.layers.moe.dispatch import ExpertMap, choose_slots, combine
from kvbaton.parallel.afd.frames import (
    CombinedRows,
    DispatchRows,
    ExchangeFailed,
    FromExpert,
    PoolHello,
    PoolWelcome,
    ToExpert,
    max_frame_bytes,
)
from kvbaton.parallel.afd.server import DEFAULT_MAX_ROWS, bytes_of, rows_of
from kvbaton.wire import ChannelError, SignedCodec

logger = logging.getLogger(__name__)


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
                 num_experts: int, moe_layers: list[int], max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.config = config
        self.hidden, self.dtype, self.num_experts = hidden, dtype, num_experts
        self.dtype_name = str(dtype).removeprefix("torch.")
        limit = max_frame_bytes(max_rows, hidden, self.dtype_name)
        self._codec = SignedCodec(secret, FromExpert, limit)
        self._requests = SignedCodec(secret, ToExpert, limit)
        self._ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._monitors: list[zmq.Socket] = []  # each socket's disconnections
        for address in config.experts:
            socket = self._ctx.socket(zmq.DEALER)
            socket.setsockopt(zmq.MAXMSGSIZE, limit)
            socket.setsockopt(zmq.LINGER, 0)
            self._sockets.append(socket)
            self._monitors.append(socket.get_monitor_socket(zmq.EVENT_DISCONNECTED))
            socket.connect(address)
        self._next_ticket = 1
        self._in_flight: set[int] = set()
        self._awaiting: list[set[int]] = [set() for _ in config.experts]  # per worker: tickets it has not answered
        self._lost: set[int] = set()  # tickets a dropped connection took with it
        self._early: dict[tuple[int, int], FromExpert] = {}  # (worker, ticket) answered before it was waited for
        self.stats = ClientStats()
        try:
            welcomes = [self._handshake(w, PoolHello(name, hidden, self.dtype_name, num_experts))
                        for w in range(len(self._sockets))]
            self.map = self._placement(welcomes, moe_layers)
        except BaseException:
            self.close()
            raise
        self.slot_table, self.copies = self.map.lookup(num_experts)

    def _handshake(self, worker: int, hello: PoolHello) -> PoolWelcome:
        self._sockets[worker].send(self._requests.encode(hello), copy=False)
        reply = self._receive(worker, None)
        if not isinstance(reply, PoolWelcome):
            raise ExpertPoolError(f"expert worker {self.config.experts[worker]} did not welcome this worker")
        return reply

    def _placement(self, welcomes: list[PoolWelcome], moe_layers: list[int]) -> ExpertMap:
        """The pool's placement from its workers' welcomes; ConfigError where a worker serves another model."""
        size = len(welcomes)
        for worker, w in enumerate(welcomes):
            where = self.config.experts[worker]
            if (w.rank, w.size) != (worker, size):
                raise ConfigError(f"expert worker {where} is rank {w.rank} of {w.size}, expected {worker} of {size}")
            if (w.hidden, w.dtype, w.num_experts) != (self.hidden, self.dtype_name, self.num_experts):
                raise ConfigError(f"expert worker {where} serves hidden {w.hidden}, {w.dtype}, {w.num_experts} "
                                  f"experts; this model has {self.hidden}, {self.dtype_name}, {self.num_experts}")
            if sorted(w.layers) != sorted(moe_layers):
                raise ConfigError(f"expert worker {where} holds MoE layers {w.layers}, this model has {moe_layers}")
        return ExpertMap(tuple(slot for w in welcomes for slot in w.slots), size)

    def post(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Pending:
        """Send layer `layer`'s rows x [T, H] (routed to ids [T, k] by weights [T, k]) to their experts' workers."""
        tokens, slots = choose_slots(ids, self.slot_table, self.copies, 1, self.config.index)
        order = torch.argsort(slots, stable=True)
        sorted_slots = slots[order]
        rows = x[tokens[order]].to(self.dtype)
        per = self.map.slots_per_rank
        counts = torch.bincount(sorted_slots // per, minlength=self.map.num_ranks).tolist()
        local = (sorted_slots % per).to(torch.int32)
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        parts, start = [], 0
        for worker, n in enumerate(counts):
            if not n:
                continue
            frame = self._requests.encode(DispatchRows(ticket, layer, bytes_of(rows[start:start + n]),
                                                       bytes_of(local[start:start + n])))
            self._note_disconnects(worker)  # before the send: a drop seen later can only have taken this frame
            self._sockets[worker].send(frame, copy=False)
            self._awaiting[worker].add(ticket)
            self.stats.bytes_sent += len(frame)
            parts.append((worker, n))
            start += n
        self._in_flight.add(ticket)
        self.stats.exchanges += 1
        return Pending(ticket, parts, order, x, ids, weights)

    def wait(self, pending: Pending) -> torch.Tensor:
        """The combined expert outputs [T, H] of a posted exchange."""
        began = time.perf_counter()
        try:
            outs = []
            for worker, n in pending.parts:
                reply = self._receive(worker, pending.ticket)
                if isinstance(reply, ExchangeFailed):
                    raise ExpertPoolError(f"expert worker {self.config.experts[worker]}: {reply.message}")
                assert isinstance(reply, CombinedRows)
                out = rows_of(reply.rows, self.dtype, self.hidden)
                if out.shape[0] != n:
                    raise ExpertPoolError(f"expert worker {self.config.experts[worker]} answered {out.shape[0]} "
                                          f"rows for {n}")
                outs.append(out)
        except BaseException:
            self.abandon()
            raise
        finally:
            self.stats.wait_s += time.perf_counter() - began
        self._in_flight.discard(pending.ticket)
        x = pending.x
        sorted_rows = torch.cat(outs) if outs else x.new_empty(0, self.hidden)
        rows = torch.empty(sorted_rows.shape, dtype=x.dtype)
        rows[pending.order] = sorted_rows.to(x.dtype)  # back in assignment order
        return combine(x, rows, pending.ids, pending.weights)

    def abandon(self) -> None:
        """Give up every exchange in flight (its step failed): their replies, whenever they come, are dropped."""
        self._in_flight.clear()
        self._early.clear()
        self._lost.clear()
        for tickets in self._awaiting:
            tickets.clear()

    def _note_disconnects(self, worker: int) -> None:
        """A dropped connection to `worker` (it died) loses the exchanges it had not answered."""
        monitor = self._monitors[worker]
        while monitor.poll(0):
            if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
                self._lost |= self._awaiting[worker]
                self._awaiting[worker].clear()

    def _receive(self, worker: int, ticket: int | None) -> FromExpert:
        """The reply of `worker` to `ticket` (None: its welcome); replies to other exchanges in flight are kept."""
        if ticket is not None and (worker, ticket) in self._early:
            self._awaiting[worker].discard(ticket)
            return self._early.pop((worker, ticket))
        socket, deadline = self._sockets[worker], time.monotonic() + self.config.timeout_s
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(self._monitors[worker], zmq.POLLIN)
        while True:
            if ticket in self._lost:
                raise ExpertPoolError(f"expert worker {self.config.experts[worker]} dropped its connection with an "
                                      "exchange in flight (it died)")
            left_ms = int((deadline - time.monotonic()) * 1000)
            ready = dict(poller.poll(left_ms)) if left_ms > 0 else {}
            if self._monitors[worker] in ready:
                self._note_disconnects(worker)
            if socket not in ready:
                if ready:
                    continue  # a disconnection: the loop's first check says whether it took this exchange
                raise ExpertPoolError(f"expert worker {self.config.experts[worker]} did not answer within "
                                      f"{self.config.timeout_s:g} s")
            frame = socket.recv(copy=True)
            self.stats.bytes_received += len(frame)
            try:
                reply = self._codec.decode(frame)
            except ChannelError as exc:
                logger.warning("expert pool: refused a frame from %s: %s", self.config.experts[worker], exc)
                continue
            if isinstance(reply, PoolWelcome):
                if ticket is None:
                    return reply
                continue
            self._awaiting[worker].discard(reply.ticket)
            if reply.ticket == ticket:
                return reply
            if reply.ticket in self._in_flight:
                self._early[(worker, reply.ticket)] = reply
            # else: a reply to an abandoned exchange, dropped

    def dispatcher(self, layer: int) -> RemoteExperts:
        return RemoteExperts(self, layer)

    def close(self) -> None:
        for socket, monitor in zip(self._sockets, self._monitors, strict=False):
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)
        for socket in self._sockets[len(self._monitors):]:
            socket.close(linger=0)
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
