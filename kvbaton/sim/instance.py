"""One simulated worker: the real `Scheduler` over a real `KVCacheManager`, stepping in simulated time.

A step is what the engine does: `schedule()`, run the batch, `update_from_output()`. Here "run the
batch" is the latency model's answer for the step's shape, and every sampled token is the same
placeholder id (requests end by `max_tokens`, as a benchmark with `ignore_eos` does), so what the
scheduler decides is exactly what it would decide for the real engine given the same requests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvbaton.kv.layout import KVLayout
from kvbaton.sched.kv_cache_manager import KVCacheManager
from kvbaton.sched.outputs import EngineCoreOutput, ModelOutput, RemoteDecode, SchedulerOutput
from kvbaton.sched.request import Request
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.sched.scheduler import Scheduler
from kvbaton.sim.host import IDENTITY, ServedSteps
from kvbaton.sim.latency import StepShape
from kvbaton.sim.spec import InstanceSpec

PLACEHOLDER_TOKEN = 7  # every sampled token: never an EOS (requests carry none), so max_tokens ends them


@dataclass(frozen=True)
class StepStarted:
    sched: SchedulerOutput
    shape: StepShape
    seconds: float


@dataclass(frozen=True)
class Reservation:
    num_cached_tokens: int  # the decode instance's own prefix hit: those tokens need no transfer
    num_blocks: int


class ArrivalClock:
    """Strictly increasing arrival stamps. The scheduler orders its queues by (priority, arrival time); the real
    engine stamps requests with `time.monotonic()`, which never ties, so requests created in one simulated
    instant must still be stamped in creation order (a tie would put a preempted request behind its peers)."""

    def __init__(self) -> None:
        self._last = -math.inf

    def stamp(self, now: float) -> float:
        self._last = max(now, math.nextafter(self._last, math.inf))
        return self._last


def sim_request(request_id: str, prompt: tuple[int, ...], output_len: int, arrival_s: float,
                remote: RemoteDecode | None = None) -> Request:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    return Request(request_id, list(prompt), params, arrival_time=arrival_s, remote_decode=remote)


def remote_decode(reservation: Reservation, block_size: int) -> RemoteDecode:
    """What the prefill scheduler needs to hand a request off (only its presence matters to it)."""
    layout = KVLayout.standard(num_layers=1, block_size=block_size, num_kv_heads=1, head_dim=1, dtype="bfloat16")
    return RemoteDecode(receiver="sim", dst_block_ids=[], skip_blocks=reservation.num_cached_tokens // block_size,
                        layout=layout)


class SimInstance:
    """A worker's scheduler and its step clock; the simulator decides when steps start and end."""

    def __init__(self, name: str, role: str, spec: InstanceSpec, served: ServedSteps = IDENTITY, seed: int = 0) -> None:
        self.name, self.role, self.spec = name, role, spec
        self.served = served
        # NOTE: one stream per instance, seeded by its name: a run is the same whatever order instances step in
        self.rng = random.Random(f"{seed}/{name}")
        self.kv_cache = KVCacheManager(spec.num_blocks, spec.block_size, spec.enable_prefix_caching)
        self.scheduler = Scheduler(spec.scheduler, self.kv_cache, spec.max_model_len)
        self.step: StepStarted | None = None  # the step in flight, if any
        self.attempts: set[str] = set()  # requests the router sent here that are not done (its load figure)
        # Totals for InstanceStats.
        self.num_steps = 0
        self.busy_s = 0.0
        self.kv_usage_s = 0.0  # integral of usage over busy time
        self.peak_kv_usage = 0.0
        self.num_tokens = 0
        self.num_decode_steps = 0
        self.num_decode_seqs = 0

    # ---- what the router reads (kvbaton.router.policies.Candidate) ---------------------------

    @property
    def load_score(self) -> float:
        """As the real router's WorkerHandle.load_score: requests here, KV being received, in flight, usage."""
        s = self.scheduler
        return s.num_running + s.num_waiting + s.num_receiving + len(self.attempts) + self.kv_cache.usage()

    @property
    def busy(self) -> bool:
        return self.step is not None

    # ---- requests ------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.scheduler.add_request(req)
        self.attempts.add(req.request_id)

    def reserve(self, req: Request) -> Reservation | None:
        """Blocks for `req`'s whole prompt, its KV to come from a prefill instance; None: no room now."""
        reserved = self.scheduler.reserve_for_transfer(req)
        if reserved is None:
            return None
        self.attempts.add(req.request_id)
        num_cached, block_ids = reserved
        return Reservation(num_cached, len(block_ids))

    def done(self, request_id: str) -> None:
        self.attempts.discard(request_id)

    # ---- the step --------------------------------------------------------------------------------

    def start_step(self) -> StepStarted | None:
        """Schedule the next batch; None (and idle) when nothing can run now. The step lasts what the latency
        model says for its shape, as a served step of this role runs (kvbaton.sim.host)."""
        assert self.step is None, f"{self.name}: a step is already running"
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return None
        shape = StepShape.of(sched.scheduled)
        # a decode burst (kvbaton.sched.burst) is that many steps of one shape, back to back
        seconds = self.served.seconds(self.spec.latency.step_seconds(shape), shape, self.rng, sched.decode_steps)
        self.step = StepStarted(sched, shape, seconds)
        return self.step

    def end_step(self) -> list[EngineCoreOutput]:
        """The step in flight has run: its sampled tokens go back to the scheduler."""
        step, self.step = self.step, None
        assert step is not None, f"{self.name}: no step is running"
        sampled = {item.request_id: [PLACEHOLDER_TOKEN] * step.sched.decode_steps
                   for item in step.sched.scheduled if item.sample}
        usage = self.kv_cache.usage()
        steps = step.sched.decode_steps
        self.num_steps += steps
        self.busy_s += step.seconds
        self.kv_usage_s += usage * step.seconds
        self.peak_kv_usage = max(self.peak_kv_usage, usage)
        self.num_tokens += step.shape.num_tokens * steps
        if step.shape.decode_seqs:
            self.num_decode_steps += steps
            self.num_decode_seqs += step.shape.decode_seqs * steps
        return self.scheduler.update_from_output(step.sched, ModelOutput(sampled))
