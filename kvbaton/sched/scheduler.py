"""Iteration-level continuous batching under a per-step token budget (no torch here).

There is no separate "prefill phase": each step, every request catches its
`num_computed_tokens` up towards `num_tokens` by as many tokens as the budget allows.
Order of a step: running requests in their decode phase (so decodes are never starved),
then running requests still prefilling (chunked), then waiting requests by
(priority, arrival). When blocks run out, the lowest-priority, latest running request is
preempted: its blocks are freed and it is recomputed later (cheaply, via prefix caching).
"""

from __future__ import annotations

import time
from bisect import insort
from collections.abc import Iterable
from dataclasses import dataclass

from kvbaton.config import SchedulerConfig
from kvbaton.kv.store.base import LoadPlan, PrefixStore
from kvbaton.sched.burst import burst_steps
from kvbaton.sched.kv_cache_manager import KVCacheManager
from kvbaton.sched.outputs import EngineCoreOutput, ModelOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from kvbaton.sched.request import Request, RequestStatus


def _order(req: Request) -> tuple[int, float]:
    return (req.priority, req.arrival_time)


@dataclass
class _Loading:
    """A request whose prefix the store is loading in the background (it takes no step until it lands)."""

    req: Request
    num_local_blocks: int  # its local prefix-cache hit, before the loaded blocks
    aborted: bool = False  # finished from outside meanwhile: its blocks are freed once the load ends


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int,
                 store: PrefixStore | None = None, background_loads: bool = True) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.store = store  # KV tiers beyond the pool: asked at admission for blocks past the local hit
        self.background_loads = background_loads
        self.num_store_hit_tokens = 0
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []  # sorted by (priority, arrival)
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        # Disaggregation: requests that hold blocks but take no steps. The scheduler owns them (their blocks and
        # their way back into the queues are its); the engine's hand-off (engine/transfers.py) and the simulator
        # move them along through the methods below, never through these dicts.
        self._held: dict[str, Request] = {}  # prefill role: KV being sent, freed by release_held()
        self._receiving: dict[str, Request] = {}  # decode role: KV being received into reserved blocks
        # The store loading prefixes in the background, by load ticket (and the ticket of each request).
        self.loading: dict[int, _Loading] = {}
        self._load_tickets: dict[str, int] = {}

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        insort(self.waiting, req, key=_order)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string); frees blocks at once."""
        for request_id in request_ids:
            if request_id in self._receiving:
                self.cancel_receive(request_id)
            if request_id in self._load_tickets:
                self._abort_load(request_id, status)
                continue
            req = self.requests.get(request_id)
            if req is None or req.is_finished:
                continue
            queue = self.running if req.status == RequestStatus.RUNNING else self.waiting
            queue.remove(req)
            self._finish(req, status)

    # ---- disaggregation: the prefill side holds, the decode side receives -----------------

    def is_held(self, request_id: str) -> bool:
        """Prefill side: the request finished as a transfer and its KV is still being sent."""
        return request_id in self._held

    def is_receiving(self, request_id: str) -> bool:
        """Decode side: blocks are reserved for the request's KV, which has not been admitted yet."""
        return request_id in self._receiving

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_receiving(self) -> int:
        return len(self._receiving)

    def release_held(self, request_id: str) -> None:
        """The KV of a transferred request has been sent (or the transfer failed): free it."""
        req = self._held.pop(request_id, None)
        if req is not None:
            self.kv_cache.free(req)

    def reserve_for_transfer(self, req: Request) -> tuple[int, list[int]] | None:
        """Reserve blocks for `req`'s whole prompt, reusing this pool's cached prefix.

        Returns (tokens already cached here, the blocks the rest must be written into), or
        None when the pool has no room now. The reserved blocks stay out of the prefix-cache
        index and out of every step until `admit_transferred` or `cancel_receive`."""
        if req.request_id in self.requests or req.request_id in self._receiving:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        hits, num_hit = self.kv_cache.get_computed_blocks(req)
        if not self.kv_cache.allocate_slots(req, req.num_tokens - num_hit, hits, index_blocks=False):
            return None
        num_hit += self._load_from_store(req, len(hits), self._plan_store(req, len(hits)).num_blocks)
        self.kv_cache.record_lookup(req.num_tokens, num_hit)
        req.num_cached_tokens = num_hit
        req.status = RequestStatus.WAITING_FOR_KV
        self._receiving[req.request_id] = req
        block_ids = self.kv_cache.block_ids(req.request_id)
        return num_hit, block_ids[num_hit // self.kv_cache.block_size:]

    def admit_transferred(self, request_id: str, first_token: int) -> None:
        """The prompt's KV has arrived and the prefill worker sampled `first_token`: decode on."""
        req = self._receiving.pop(request_id)
        req.num_computed_tokens = len(req.prompt_token_ids)
        self.kv_cache.index_computed_blocks(req, req.num_computed_tokens)
        req.output_token_ids.append(first_token)
        req.first_scheduled_time = time.monotonic()
        req.status = RequestStatus.RUNNING
        self.requests[request_id] = req
        insort(self.running, req, key=_order)

    def cancel_receive(self, request_id: str) -> None:
        req = self._receiving.pop(request_id, None)
        if req is not None:
            self.kv_cache.free(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # ---- the step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._finish_loads()
        budget = self.config.max_num_batched_tokens
        chosen: dict[str, int] = {}  # request id -> tokens scheduled this step
        preempted: list[Request] = []
        decoding = [r for r in self.running if r.num_computed_tokens >= len(r.prompt_token_ids)]
        prefilling = [r for r in self.running if r.num_computed_tokens < len(r.prompt_token_ids)]
        for req in decoding + prefilling:
            if budget <= 0 or req.status != RequestStatus.RUNNING:
                continue
            num_new = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
            if self._allocate_or_preempt(req, num_new, chosen, preempted):
                chosen[req.request_id] = num_new
            # NOTE: recomputed, since preemption may have unscheduled a request chosen earlier.
            budget = self.config.max_num_batched_tokens - sum(chosen.values())
        if not preempted:
            budget = self._admit_waiting(budget, chosen)
        steps = 1 if preempted or self.waiting or self.loading else self._burst(chosen)
        return self._build_output(chosen, preempted, steps)

    def update_from_output(self, sched: SchedulerOutput, output: ModelOutput) -> list[EngineCoreOutput]:
        results = []
        for item in sched.scheduled:
            req = self.requests.get(item.request_id)
            if req is None or req.is_finished:
                continue
            req.num_computed_tokens += item.num_tokens
            if item.request_id in output.prompt_logprobs:
                self._keep_prompt_logprobs(req, *output.prompt_logprobs[item.request_id])
            tokens = output.sampled_token_ids.get(item.request_id)
            if not tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            new_tokens, status, stop_reason = self._take_tokens(req, tokens)
            logprobs = [output.logprobs[item.request_id]] if item.request_id in output.logprobs else []
            if status is not None:
                req.stop_reason = stop_reason
                self.running.remove(req)
                self._finish(req, status)
            first = req.num_output_tokens == len(new_tokens) and req.sampling_params.prompt_logprobs is not None
            results.append(EngineCoreOutput(
                request_id=req.request_id, new_token_ids=new_tokens, finish_reason=req.finish_reason,
                stop_reason=req.stop_reason, logprobs=logprobs, num_cached_tokens=max(req.num_cached_tokens, 0),
                first_scheduled_time=req.first_scheduled_time, prompt_logprobs=req.prompt_logprobs if first else None))
        for failure in output.failed_transfers:  # finished as `transfer` above: nothing will read the blocks
            self.release_held(failure.request_id)
        return results

    # ---- internals -------------------------------------------------------------------------

    def _take_tokens(self, req: Request, tokens: list[int]) -> tuple[list[int], RequestStatus | None, int | None]:
        """Append a step's sampled tokens to `req` one at a time, as that many steps would have (a burst's later
        tokens each follow one more computed token); the first that stops it is its last. Returns (the tokens
        taken, the finishing status or None, the stop reason)."""
        for i, token in enumerate(tokens):
            if i:
                req.num_computed_tokens += 1
            req.output_token_ids.append(token)
            status, stop_reason = self._check_stop(req, token)
            if status is not None:
                return list(tokens[: i + 1]), status, stop_reason
        return list(tokens), None, None

    def _burst(self, chosen: dict[str, int]) -> int:
        """Decode steps this batch runs back to back (sched/burst.py), with slots taken for all of them; 1 when
        it cannot burst, or the pool has no room for the burst's blocks (no one is preempted for them)."""
        if self.config.decode_burst <= 1 or not chosen:
            return 1
        reqs = [self.requests[request_id] for request_id in chosen]
        steps = burst_steps(self.config.decode_burst, reqs, list(chosen.values()),
                            min(self.max_model_len, self.kv_cache.capacity_tokens))
        if steps > 1 and all(self.kv_cache.allocate_slots(req, steps) for req in reqs):
            return steps
        return 1

    @staticmethod
    def _keep_prompt_logprobs(req: Request, start: int, entries: list[TokenLogprobs]) -> None:
        """Add the logprobs of prompt tokens start + 1, ... that `req` does not have yet (a preempted
        request computes its prompt again)."""
        have = len(req.prompt_logprobs)
        if start <= have:
            req.prompt_logprobs.extend(entries[have - start:])

    def _chunk(self, num_remaining: int, budget: int) -> int:
        num_new = min(num_remaining, budget)
        if self.config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return num_new

    def _allocate_or_preempt(self, req: Request, num_new: int, chosen: dict[str, int],
                             preempted: list[Request]) -> bool:
        """Allocate for `req`, preempting from the back of `running` until it fits.
        Returns False if `req` itself had to be preempted."""
        while not self.kv_cache.allocate_slots(req, num_new):
            victim = self.running[-1]
            chosen.pop(victim.request_id, None)  # it may have been scheduled earlier this step
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _admit_waiting(self, budget: int, chosen: dict[str, int]) -> int:
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits, num_hit = self.kv_cache.get_computed_blocks(req)
            plan = self._plan_store(req, len(hits))
            num_stored = plan.num_blocks * self.kv_cache.block_size
            # NOTE: a load that waits on disk or the network goes to the background while others run, so their
            # streams do not stall for it (a 4k-token prefix from redis: ~0.3 s). A copy from memory (shm), or a
            # load with no one else to run, happens in the step: on a CPU the loader thread competes with the
            # step's own threads, which costs the loaded request ~1.5x TTFT (benchmarks/results/kv-store.md).
            if num_stored and plan.waits_on_io and self.running and self.background_loads:
                if not self.kv_cache.allocate_slots(req, num_stored, hits, index_blocks=False):
                    break
                self.waiting.pop(0)
                self._start_load(req, len(hits), num_stored // self.kv_cache.block_size)
                continue
            num_new = req.num_tokens - num_hit - num_stored
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = self._chunk(num_new, budget)
            if not self.kv_cache.allocate_slots(req, num_stored + num_new, hits, index_blocks=not num_stored):
                break
            self.waiting.pop(0)
            if num_stored:
                num_hit, num_new = self._admit_from_store(req, len(hits), num_stored, num_new, budget)
            self._start_running(req, num_hit)
            chosen[req.request_id] = num_new
            budget -= num_new
        return budget

    # ---- the KV store: blocks past the local prefix hit ------------------------------------------

    def _plan_store(self, req: Request, num_local_blocks: int) -> LoadPlan:
        """Blocks after the local hit worth loading from the store (hashes were extended by the lookup)."""
        if self.store is None or req.sampling_params.prompt_logprobs is not None:
            return LoadPlan(0)
        max_blocks = (req.num_tokens - 1) // self.kv_cache.block_size  # as the local lookup: one token computed
        return self.store.plan(req.block_hashes[num_local_blocks:max_blocks])

    def _load_from_store(self, req: Request, num_local_blocks: int, num_blocks: int) -> int:
        """Load `num_blocks` blocks into the request's blocks after its local hit; tokens loaded."""
        if not num_blocks or self.store is None:
            return 0
        block_ids = self.kv_cache.block_ids(req.request_id)[num_local_blocks:num_local_blocks + num_blocks]
        loaded = self.store.load(req.block_hashes[num_local_blocks:num_local_blocks + num_blocks], block_ids)
        self.num_store_hit_tokens += loaded * self.kv_cache.block_size
        return loaded * self.kv_cache.block_size

    def _admit_from_store(self, req: Request, num_local_blocks: int, num_stored: int, num_new: int,
                          budget: int) -> tuple[int, int]:
        """Load the planned blocks; what did not load is computed instead, in this step's chunk. Returns
        (tokens now cached, tokens to compute). The chunk never ends later than the one allocated for."""
        bs = self.kv_cache.block_size
        num_cached = num_local_blocks * bs + self._load_from_store(req, num_local_blocks, num_stored // bs)
        if num_cached < num_local_blocks * bs + num_stored:  # a tier failed: recompute from there
            num_new = self._chunk(req.num_tokens - num_cached, budget)
        self.kv_cache.index_computed_blocks(req, num_cached + num_new)
        return num_cached, num_new

    def _start_running(self, req: Request, num_cached: int) -> None:
        """`req` joins the running requests with its first `num_cached` tokens' KV in its blocks."""
        self.kv_cache.record_lookup(req.num_tokens, num_cached)
        req.num_computed_tokens = num_cached
        if req.num_cached_tokens < 0:  # first admission (a preempted request keeps its first figures)
            req.num_cached_tokens = num_cached
            req.first_scheduled_time = time.monotonic()
        req.status = RequestStatus.RUNNING
        insort(self.running, req, key=_order)

    def _start_load(self, req: Request, num_local_blocks: int, num_blocks: int) -> None:
        assert self.store is not None
        first = num_local_blocks
        block_ids = self.kv_cache.block_ids(req.request_id)[first:first + num_blocks]
        ticket = self.store.start_load(req.block_hashes[first:first + num_blocks], block_ids)
        req.status = RequestStatus.WAITING_FOR_KV
        self.loading[ticket] = _Loading(req, num_local_blocks)
        self._load_tickets[req.request_id] = ticket

    def _finish_loads(self) -> None:
        """Requests whose background load ended run on: what loaded is cached, the rest is computed."""
        if not self.loading or self.store is None:
            return
        bs = self.kv_cache.block_size
        for ticket, num_loaded in self.store.finished_loads():
            st = self.loading.pop(ticket, None)
            if st is None:
                continue
            req = st.req
            del self._load_tickets[req.request_id]
            if st.aborted:
                self.kv_cache.free(req)
                continue
            num_cached = (st.num_local_blocks + num_loaded) * bs
            self.num_store_hit_tokens += num_loaded * bs
            self.kv_cache.index_computed_blocks(req, num_cached)
            self._start_running(req, num_cached)

    def _abort_load(self, request_id: str, status: RequestStatus) -> None:
        """Finished from outside while its prefix loads: gone for the caller now, its blocks once the load ends
        (the loader thread is still writing them)."""
        st = self.loading[self._load_tickets[request_id]]
        if st.aborted:
            return
        st.aborted = True
        st.req.status = status
        self._finished_ids.add(request_id)
        del self.requests[request_id]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv_cache.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        insort(self.waiting, req, key=_order)

    def _build_output(self, chosen: dict[str, int], preempted: list[Request], decode_steps: int) -> SchedulerOutput:
        scheduled = []
        for request_id, num_new in chosen.items():
            req = self.requests[request_id]
            start = req.num_computed_tokens
            scheduled.append(ScheduledRequest(
                request_id=request_id,
                token_ids=req.token_slice(start, start + num_new),
                start_position=start,
                block_ids=self.kv_cache.block_ids(request_id),
                sample=start + num_new == req.num_tokens,
                sampling_params=req.sampling_params,
                num_output_tokens=req.num_output_tokens,
                remote_decode=req.remote_decode if start + num_new == req.num_tokens else None,
                prompt_token_ids=req.prompt_token_ids, output_token_ids=req.output_token_ids,
                prompt_logprobs=req.sampling_params.prompt_logprobs,
            ))
        finished, self._finished_ids = frozenset(self._finished_ids), set()
        return SchedulerOutput(scheduled, finished, sum(chosen.values()),
                               frozenset(r.request_id for r in preempted), decode_steps)

    def _check_stop(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        # NOTE: a request alone in a full pool cannot grow (it would preempt itself forever).
        if req.num_tokens >= min(self.max_model_len, self.kv_cache.capacity_tokens):
            return RequestStatus.FINISHED_LENGTH, None
        if req.remote_decode is not None:
            return RequestStatus.FINISHED_TRANSFERRED, None
        return None, None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if status == RequestStatus.FINISHED_TRANSFERRED:
            self._held[req.request_id] = req  # its KV is still being read by the transfer
        else:
            self.kv_cache.free(req)
        self._finished_ids.add(req.request_id)
        del self.requests[req.request_id]

    # ---- observability ---------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(not st.aborted for st in self.loading.values())

    def check_integrity(self) -> None:
        self.kv_cache.check_integrity()
        live = {r.request_id for r in self.running} | set(self._held) | set(self._receiving)
        live |= {st.req.request_id for st in self.loading.values()}
        assert set(self.kv_cache.req_blocks) <= live, "blocks held by a request that is not running"
