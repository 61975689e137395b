"""One engine as a rank of an expert-parallel (EP) group: the process group, the expert sharding of the
model, and the lockstep every step keeps.

Each rank schedules and attends over its own requests; every MoE layer exchanges tokens with all ranks,
so all ranks must run a forward together: at the start of each step they agree (one all-reduce) whether
anyone has tokens, and a rank with none joins with an empty batch (`idle_exchange` per MoE layer).
"""

from __future__ import annotations

import datetime
import functools
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from kvbaton.config import ConfigError, ExpertParallelConfig
from kvbaton.layers.moe.block import SparseMoeBlock
from kvbaton.layers.moe.dispatch import AllToAllDispatch
from kvbaton.models.loader import read_experts
from kvbaton.parallel.expert_balance import ExpertRebalancer
from kvbaton.parallel.expert_stats import ExpertStats
from kvbaton.parallel.rendezvous import address_of, meet

logger = logging.getLogger(__name__)


class ExpertParallelGroup:
    def __init__(self, config: ExpertParallelConfig) -> None:
        self.config = config
        if dist.is_initialized():
            raise ConfigError("this process already belongs to a torch.distributed group; one EP engine per process")
        timeout = datetime.timedelta(seconds=config.timeout_s)
        host, port = address_of(config.init_method)
        self._meeting = meet(host, port, config.size, config.rank == 0, timeout)
        dist.init_process_group("gloo", store=self._meeting.store, rank=config.rank, world_size=config.size,
                                timeout=timeout)
        group = dist.group.WORLD
        assert group is not None, "init_process_group made the default group"
        self.group = group
        # NOTE: True until the first step says otherwise, so a rank with nothing to do still joins the first
        # step (the others may need it there)
        self.group_busy = True
        self.busy_steps = 0
        self.last_busy = time.monotonic()  # when a step last ran on some rank of the group
        self._step_marks: list[int] = []  # each layer's exchanges begun before this step
        self._blocks: list[SparseMoeBlock] = []
        self._hidden_size = 0
        self._dtype = torch.float32

    def shard(self, stats: ExpertStats, model_dir: Path, hidden_size: int) -> None:
        """Keep this rank's expert slots of every MoE layer (EPLB's first placement: before any load is known,
        the redundant slots spread evenly) and exchange tokens with the other ranks in each."""
        layers = stats.layers
        dtype = layers[0].block.experts.down_proj.dtype
        self.rebalancer = ExpertRebalancer(layers, stats.window, layers[0].block.moe, self.config, self.group,
                                           functools.partial(read_experts, model_dir, dtype=dtype))
        for i, layer in enumerate(layers):
            layer.block.use_expert_parallel(self.group, self.rebalancer.expert_map(i), self.config.int8_dispatch)
        self._blocks = [layer.block for layer in layers]
        self._hidden_size, self._dtype = hidden_size, dtype
        logger.info("EP rank %d/%d: expert slots %s of the first MoE layer", self.config.rank, self.config.size,
                    self.rebalancer.expert_map(0).local_experts(self.config.rank))

    def join_step(self, has_tokens: bool) -> bool:
        """Agree with the other ranks whether this step runs (and whether a rebalanced placement is ready on
        every rank: then it is swapped in, before this step's forward); with tokens elsewhere but none here,
        run this rank's part of every MoE exchange now. Returns whether this rank runs its own forward."""
        rebalancer = self.rebalancer
        if self.group_busy:  # the last step ran (the core put its routed tokens into the load window)
            self.busy_steps += 1
            interval = self.config.rebalance_interval_steps
            if interval and self.busy_steps % interval == 0:
                rebalancer.begin()  # collective: every rank counts the same busy steps
        waiting = rebalancer.pending and not rebalancer.weights_ready()
        flags = torch.tensor([int(has_tokens), int(waiting)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        if rebalancer.pending and not flags[1]:
            rebalancer.apply()
        self.group_busy = bool(flags[0])
        if self.group_busy:
            self.last_busy = time.monotonic()
        self._step_marks = [d.exchanges_started for d in self._dispatchers()]
        if self.group_busy and not has_tokens:
            for block in self._blocks:
                block.idle_exchange(self._hidden_size, self._dtype)
        return has_tokens

    def finish_failed_step(self) -> None:
        """This rank's forward raised (a fault in its own batch): do the MoE exchanges it had not reached yet,
        with nothing to send, so the other ranks' step completes and the group stays in step; the caller then
        fails this rank's batch as a single engine would. RuntimeError if an exchange itself broke half-way:
        the group is out of step and only tearing it down recovers it."""
        for block, dispatcher, mark in zip(self._blocks, self._dispatchers(), self._step_marks):
            if dispatcher.exchanges_started != dispatcher.exchanges_finished:
                raise RuntimeError("an expert-parallel exchange broke half-way; the group is out of step")
            if dispatcher.exchanges_started == mark:
                block.idle_exchange(self._hidden_size, self._dtype)

    def _dispatchers(self) -> list[AllToAllDispatch]:
        return [b.dispatcher for b in self._blocks if isinstance(b.dispatcher, AllToAllDispatch)]

    def rebalance_now(self) -> None:
        """Plan a new placement from the load so far and copy its weights; it takes effect at the next step.
        Collective: every rank calls it between the same two steps."""
        self.rebalancer.begin()
        loader = self.rebalancer._loader
        if loader is not None:
            loader.join()

    def load_fields(self) -> dict[str, object]:
        """This rank's part of `ExpertLoad` (kvbaton.sched.info)."""
        return dict(ep_size=self.config.size, ep_rank=self.config.rank, rows_computed=self.rows_computed,
                    bytes_sent=self.bytes_sent, rebalances=self.rebalancer.rebalances,
                    placement=tuple(p.physical_to_logical for p in self.rebalancer.placements))

    @property
    def rows_computed(self) -> int:
        """Token-expert pairs this rank's experts computed so far (its share of the group's expert work)."""
        return sum(d.rows_computed for d in self._dispatchers())

    def expect_work(self) -> None:
        """Before a run loop that every rank enters: step at least once, so each sees the others' state."""
        self.group_busy = True

    @property
    def bytes_sent(self) -> int:
        """Dispatch + combine payload this rank sent to other ranks so far."""
        return sum(d.bytes_sent for d in self._dispatchers())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._meeting.close()
