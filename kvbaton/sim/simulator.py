"""The discrete-event loop: arrivals, engine steps and KV handoffs, in simulated time.

Three kinds of event, ordered by (time, sequence number) so equal times resolve the same way on
every run: a request arrives; an instance's step ends; a KV transfer lands. Between events the
instances' schedulers are touched exactly where the real system touches them:

    arrival ─▶ admission ─▶ (frontend dispatch delay) ─▶ decode policy ─┬─ short prompt, or no prefill
                                                                         │  pool: add_request (local)
                                                                         └─ reserve_for_transfer (decode,
                                                                            once its step in flight ends)
                                                 ├─ no room: retried after each of its steps
                                                 └─ prefill policy ─▶ add_request(remote_decode)
    prefill step samples the first token (TTFT) ─▶ link ─▶ release_held + admit_transferred

What serving adds (`ClusterSpec.host`, nothing by default) is a delay before routing, drawn per request, and
each role's served steps: a step's seconds are its profiled ones times a ratio drawn from that role's
measured ones, plus the worker's gap between steps (kvbaton.sim.host). The draws are seeded: a run is the
same for the same seed.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbaton.router.policies import Policy, make_policy
from kvbaton.sched.info import EngineInfo, validate_request
from kvbaton.sched.outputs import EngineCoreOutput, FinishReason, RemoteDecode
from kvbaton.sched.request import Request
from kvbaton.sched.sampling_params import InvalidRequestError, SamplingParams
from kvbaton.server.admission import AdmissionController, AdmissionLimits
from kvbaton.sim.flight import SimFlight
from kvbaton.sim.instance import PLACEHOLDER_TOKEN, ArrivalClock, Reservation, SimInstance, remote_decode, sim_request
from kvbaton.sim.spec import ClusterSpec, SimRequest
from kvbaton.workload.records import RequestRecord, RunResult


@dataclass(frozen=True, kw_only=True)
class InstanceStats:
    """What one simulated instance did over the run."""

    name: str
    role: str  # "both" | "prefill" | "decode"
    num_steps: int
    busy_s: float  # simulated seconds spent in steps
    num_preemptions: int
    peak_kv_usage: float  # fraction of the pool's blocks in use, at its fullest
    mean_kv_usage: float  # over its busy time
    mean_batch_tokens: float  # tokens per step
    mean_decode_batch: float  # decoding sequences per step that had any
    prefix_hit_rate: float  # prompt tokens found in the prefix cache / prompt tokens admitted

    @classmethod
    def of(cls, inst: SimInstance) -> InstanceStats:
        steps = max(inst.num_steps, 1)
        return cls(name=inst.name, role=inst.role, num_steps=inst.num_steps, busy_s=inst.busy_s,
                   num_preemptions=inst.scheduler.num_preemptions, peak_kv_usage=inst.peak_kv_usage,
                   mean_kv_usage=inst.kv_usage_s / inst.busy_s if inst.busy_s else 0.0,
                   mean_batch_tokens=inst.num_tokens / steps,
                   mean_decode_batch=inst.num_decode_seqs / max(inst.num_decode_steps, 1),
                   prefix_hit_rate=inst.kv_cache.prefix_cache_stats().hit_rate)


@dataclass(frozen=True, kw_only=True)
class SimRun:
    result: RunResult  # the same records `kvbaton bench serve` produces: summarize() them
    instances: tuple[InstanceStats, ...]
    counters: dict[str, int]  # routing: disaggregated, local, refused_receives, rejected, invalid
    wall_s: float  # real seconds the simulation took


def simulate(cluster: ClusterSpec, requests: Sequence[SimRequest], *, request_rate: float = float("inf"),
             max_duration_s: float | None = None, seed: int = 0) -> SimRun:
    """Run `requests` (arrival times in simulated seconds) through `cluster`; deterministic for one `seed` (which
    draws served steps' ratios, when `cluster.host` has any).

    `request_rate` only labels the result (as the bench's RunResult does); `max_duration_s`
    cancels what is still in flight that long after the first arrival."""
    started = time.perf_counter()
    sim = _Simulation(cluster, seed)
    duration = sim.run(sorted(requests, key=lambda r: (r.arrival_s, r.request_id)), max_duration_s)
    result = RunResult(request_rate, None, duration, len(requests), tuple(sim.records()))
    return SimRun(result=result, instances=tuple(InstanceStats.of(i) for i in sim.instances),
                  counters=dict(sim.counters), wall_s=time.perf_counter() - started)


class _Simulation:
    def __init__(self, cluster: ClusterSpec, seed: int) -> None:
        self.cluster = cluster
        decode_role = "decode" if cluster.num_prefill else "both"
        self.decoders = [SimInstance(f"{decode_role}-{i}", decode_role, cluster.decode,
                                     cluster.host.steps_for(decode_role), seed) for i in range(cluster.num_decode)]
        self.prefillers = [SimInstance(f"prefill-{i}", "prefill", cluster.prefill_instance,
                                       cluster.host.steps_for("prefill"), seed) for i in range(cluster.num_prefill)]
        self.instances = self.prefillers + self.decoders
        self.decode_policy: Policy = make_policy(cluster.decode_policy, cluster.decode.block_size)
        self.prefill_policy: Policy = make_policy(cluster.prefill_policy, cluster.prefill_instance.block_size)
        self.admission = AdmissionController(AdmissionLimits(cluster.max_waiting_requests),
                                             cluster.decode.capacity_tokens, clock=lambda: self.now)
        spec = cluster.decode
        self.info = EngineInfo(max_model_len=spec.max_model_len, vocab_size=2**31 - 1, num_blocks=spec.num_blocks,
                               block_size=spec.block_size, max_num_batched_tokens=spec.scheduler.max_num_batched_tokens,
                               enable_chunked_prefill=spec.scheduler.enable_chunked_prefill, eos_token_ids=())
        self.flights: dict[str, SimFlight] = {}
        self.clock = ArrivalClock()
        self.dispatch_rng = random.Random(f"{seed}/dispatch")
        # refused for want of room:
        self.waiting_receives: dict[str, deque[SimFlight]] = {d.name: deque() for d in self.decoders}
        self.pending_receives: dict[str, list[SimFlight]] = {d.name: [] for d in self.decoders}  # its step in flight
        self.counters = {"disaggregated": 0, "local": 0, "refused_receives": 0, "rejected": 0, "invalid": 0}
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.start = 0.0
        self.last_end = 0.0

    # ---- the loop --------------------------------------------------------------------------------

    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), action))

    def run(self, requests: list[SimRequest], max_duration_s: float | None) -> float:
        """Process every event (up to the deadline); returns the run's duration as the bench measures it."""
        if not requests:
            return 0.0
        self.start = requests[0].arrival_s
        deadline = self.start + max_duration_s if max_duration_s is not None else float("inf")
        for req in requests:
            self.at(req.arrival_s, lambda r=req: self.arrive(r))  # type: ignore[misc]
        while self._events and self._events[0][0] <= deadline:
            self.now, _, action = heapq.heappop(self._events)
            action()
        cut_off = bool(self._events)
        if not cut_off:
            self.check_integrity()
        for flight in self.flights.values():
            if flight.status == "running":
                flight.status = "cancelled"
        return (deadline if cut_off else self.last_end) - self.start

    def check_integrity(self) -> None:
        """After the last event every request has ended and every block is back in its pool (a leak is a bug)."""
        for inst in self.instances:
            inst.scheduler.check_integrity()
            assert not inst.kv_cache.req_blocks, f"{inst.name}: blocks still held by {sorted(inst.kv_cache.req_blocks)}"
            assert not inst.attempts, f"{inst.name}: requests never finished: {sorted(inst.attempts)}"
        assert not any((*q, *p) for q, p in zip(self.waiting_receives.values(), self.pending_receives.values())), \
            "reservations still waiting"

    def records(self) -> list[RequestRecord]:
        return [f.record(self.start) for f in sorted(self.flights.values(), key=lambda f: f.req.request_id)]

    # ---- arrival and routing -----------------------------------------------------------------------

    def arrive(self, req: SimRequest) -> None:
        flight = SimFlight(req, arrival_s=self.now)
        self.flights[flight.id] = flight
        problem = self._invalid(req)
        if problem is not None:
            self.counters["invalid"] += 1
            flight.fail("error", problem, self.now)
            return
        refused = self.admission.try_admit(flight.id, len(req.prompt_token_ids))
        if refused is not None:
            self.counters["rejected"] += 1
            flight.fail("rejected", refused, self.now)
            return
        delay = self.cluster.host.dispatch(len(req.prompt_token_ids), self.dispatch_rng)  # kvbaton.sim.host
        if delay > 0:
            self.at(self.now + delay, lambda: self.dispatch(flight))
        else:
            self.dispatch(flight)

    def _invalid(self, req: SimRequest) -> str | None:
        """The router's own validation (`validate_request`) against the decode instance's figures."""
        try:
            validate_request(self.info, list(req.prompt_token_ids), SamplingParams(max_tokens=req.output_len))
        except InvalidRequestError as exc:
            return str(exc)
        return None

    def dispatch(self, flight: SimFlight) -> None:
        prompt = list(flight.req.prompt_token_ids)
        decode = self.decode_policy.pick(self.decoders, prompt)
        self.decode_policy.note_routed(decode.name, prompt)
        flight.decode = decode
        if self.prefillers and len(prompt) >= self.cluster.local_prefill_threshold:
            self.prepare_receive(flight)
        else:
            self.run_locally(flight)

    def run_locally(self, flight: SimFlight) -> None:
        assert flight.decode is not None
        self.counters["local"] += 1
        flight.decode.add(self.request(flight))
        self.kick(flight.decode)

    def prepare_receive(self, flight: SimFlight) -> None:
        """The decode instance reserves blocks for the prompt's KV, or the flight waits for room there. A busy
        instance reserves at the end of its step: a worker reads its commands between steps."""
        decode = flight.decode
        assert decode is not None
        if decode.busy:
            self.pending_receives[decode.name].append(flight)
            return
        reservation = decode.reserve(self.request(flight))
        if reservation is None:
            self.counters["refused_receives"] += 1
            self.waiting_receives[decode.name].append(flight)
            return
        self.start_prefill(flight, reservation)

    def start_prefill(self, flight: SimFlight, reservation: Reservation) -> None:
        decode = flight.decode
        assert decode is not None
        prompt = flight.req.prompt_token_ids
        if len(prompt) - reservation.num_cached_tokens < self.cluster.local_prefill_threshold:
            # The decode instance already holds most of the prompt: prefilling there beats a transfer.
            decode.scheduler.cancel_receive(flight.id)
            decode.done(flight.id)
            self.run_locally(flight)
            return
        self.counters["disaggregated"] += 1
        prefill = self.prefill_policy.pick(self.prefillers, list(prompt))
        self.prefill_policy.note_routed(prefill.name, list(prompt))
        flight.prefill, flight.reservation = prefill, reservation
        remote = remote_decode(reservation, self.cluster.prefill_instance.block_size)
        prefill.add(self.request(flight, remote))
        self.kick(prefill)

    def request(self, flight: SimFlight, remote: RemoteDecode | None = None) -> Request:
        """The engine request of `flight`'s current attempt, stamped as a worker would stamp it on receipt."""
        return sim_request(flight.id, flight.req.prompt_token_ids, flight.req.output_len, self.clock.stamp(self.now),
                           remote)

    # ---- steps ----------------------------------------------------------------------------------------

    def kick(self, inst: SimInstance) -> None:
        """Start `inst`'s next step if it is idle and has something to run."""
        if inst.busy:
            return
        step = inst.start_step()
        if step is not None:
            self.at(self.now + step.seconds, lambda: self.step_ended(inst))

    def step_ended(self, inst: SimInstance) -> None:
        step_s = inst.step.seconds if inst.step is not None else 0.0
        for out in inst.end_step():
            self.on_output(inst, out, step_s)
        if inst.role != "prefill":
            self.retry_receives(inst)
        self.kick(inst)

    def on_output(self, inst: SimInstance, out: EngineCoreOutput, step_s: float) -> None:
        flight = self.flights[out.request_id]
        if flight.first_token_s is None:
            self.admission.started(flight.id)
        for _ in out.new_token_ids:  # a decode burst's tokens reach the client together
            flight.token(self.now)
        if out.finish_reason == FinishReason.TRANSFER:
            self.start_transfer(flight, step_s)
        elif out.finish_reason is not None:
            inst.done(flight.id)
            if inst.role == "prefill" and flight.decode is not None:  # one token asked: the reservation is moot
                flight.decode.scheduler.cancel_receive(flight.id)
                flight.decode.done(flight.id)
            self.finish(flight)

    def retry_receives(self, decode: SimInstance) -> None:
        """After each step: reservations refused for lack of blocks are tried again, in arrival order, then those
        that waited for the step to end are tried (a refused one joins the back of the queue)."""
        queue = self.waiting_receives[decode.name]
        while queue:
            flight = queue[0]
            reservation = decode.reserve(self.request(flight))
            if reservation is None:
                break
            queue.popleft()
            self.start_prefill(flight, reservation)
        pending, self.pending_receives[decode.name] = self.pending_receives[decode.name], []
        for flight in pending:
            if queue:  # earlier ones wait for room: no overtaking
                self.counters["refused_receives"] += 1
                queue.append(flight)
            else:
                self.prepare_receive(flight)

    # ---- the KV handoff -------------------------------------------------------------------------------

    def start_transfer(self, flight: SimFlight, last_step_s: float) -> None:
        assert flight.reservation is not None
        spec, link = self.cluster.prefill_instance, self.cluster.link
        num_tokens = len(flight.req.prompt_token_ids) - flight.reservation.num_cached_tokens
        seconds = link.transfer_seconds(num_tokens * spec.kv_bytes_per_token)
        if self.cluster.layerwise_transfer:  # what the last chunk's compute did not already hide
            seconds = link.latency_us * 1e-6 + max(0.0, seconds - link.latency_us * 1e-6 - last_step_s)
        self.at(self.now + seconds, lambda: self.transfer_landed(flight))

    def transfer_landed(self, flight: SimFlight) -> None:
        prefill, decode = flight.prefill, flight.decode
        assert prefill is not None and decode is not None
        prefill.scheduler.release_held(flight.id)
        prefill.done(flight.id)
        self.kick(prefill)
        decode.scheduler.admit_transferred(flight.id, PLACEHOLDER_TOKEN)
        self.kick(decode)

    def finish(self, flight: SimFlight) -> None:
        self.admission.started(flight.id)
        flight.status = "ok"
        flight.end_s = self.now
        self.last_end = max(self.last_end, self.now)
