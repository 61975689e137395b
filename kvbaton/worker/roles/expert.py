"""The expert role (attention/FFN disaggregation): a worker without an engine core. It loads its rank's routed
experts of every MoE layer (`parallel.afd.shard`) and serves them on its exchange socket (`parallel.afd.server`),
from a thread of its own, to every attention worker of the deployment; it takes no request from the router.

Its rounds only watch that the exchange thread lives: a round that raises ends the process, and the pool starts
a replacement, which binds the same port (the spec's `expert_slot`), so the attention workers' sockets reconnect
to it by themselves.
"""

from __future__ import annotations

import time

from kvbaton.engine.core import resolve_dtype
from kvbaton.messages.router_worker import (
    CheckIntegrity,
    ExchangeLoad,
    ExpertsServed,
    IntegrityReport,
    WorkerHello,
    WorkerLoad,
)
from kvbaton.messages.worker_spec import WorkerRole, WorkerSpec
from kvbaton.models.registry import resolve_model
from kvbaton.parallel.afd.server import ExpertServer
from kvbaton.parallel.afd.shard import ExpertShard, ShardSpec
from kvbaton.platform.startup import StartupClock
from kvbaton.sched.info import EngineStats
from kvbaton.worker.roles.base import Handler, Role, WorkerContext

WATCH_MS = 200  # how often a round looks at the exchange thread and reports its counters (the work is on that thread)


class ExpertRole(Role):
    role = WorkerRole.EXPERT

    def start(self, spec: WorkerSpec, secret: bytes, startup: StartupClock) -> None:
        slot = spec.expert_slot
        if slot is None:
            raise ValueError("an expert worker's spec needs its expert slot")
        engine = spec.engine
        self.shard = ExpertShard(ShardSpec(resolve_model(engine.model), slot.rank, slot.size,
                                           resolve_dtype(engine.dtype), kernels=engine.kernels,
                                           compute_path=engine.compute_path, deterministic=engine.deterministic,
                                           redundant=slot.redundant))
        startup.lap("experts")
        self.server = ExpertServer(self.shard, secret, host=spec.host, port=slot.port, encrypt=spec.encrypt_traffic)
        self.server.start()
        self.startup = startup

    def hello(self, worker: WorkerContext, index: int, pid: int, address: str) -> WorkerHello:
        shard = self.shard
        served = ExpertsServed(address=self.server.address, rank=shard.spec.rank, size=shard.spec.size,
                               experts=list(shard.slots))
        return WorkerHello(name=worker.name, role=self.role, index=index, pid=pid, address=address, info=None,
                           layout=None, receiver=None, load=worker.report_load(), experts=served,
                           startup=self.startup.phases)

    def commands(self, worker: WorkerContext) -> dict[type, Handler]:
        return {CheckIntegrity: lambda msg: self._check_integrity(worker)}

    def run_round(self, worker: WorkerContext) -> None:
        if not self.server.serving:
            raise RuntimeError("the expert exchange thread stopped")
        worker.report_load()  # the heartbeat carries its exchange counters

    def wait_ms(self) -> int:
        return WATCH_MS

    def idle(self) -> bool:
        return True  # each exchange is answered before the next is read: nothing is left in flight to drain

    def load(self, seq: int) -> WorkerLoad:
        s, shard = self.server.stats, self.shard
        epoch = shard.newest  # NOTE: read once: the exchange thread installs a placement in `held` before `newest`
        exchange = ExchangeLoad(exchanges=s.exchanges, rows=s.rows, bytes_in=s.bytes_in, bytes_out=s.bytes_out,
                                busy_s=s.busy_s, alive_s=time.monotonic() - self.server.started,
                                refused_frames=s.refused_frames, shared=s.shared, epoch=epoch,
                                owns=shard.held[epoch].slots)
        return WorkerLoad(EngineStats(), 0, 0, seq, exchange)

    def close(self) -> None:
        self.server.close()

    def _check_integrity(self, worker: WorkerContext) -> None:
        error = None if self.server.serving else "the expert exchange thread stopped"
        worker.send(IntegrityReport(worker.name, error, 0.0, 0))
