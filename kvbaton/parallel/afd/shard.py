"""An expert worker's experts: its slots of every MoE layer's routed experts, read from the checkpoint, and the
computation a dispatched row asks of them (the row through its slot's expert, weight 1: the attention worker
that sent it weights and sums, `layers.moe.dispatch.combine`).

The pool's first placement (epoch 0) is the expert-parallel one (`ExpertMap`: slot s on expert worker
s // slots_per_worker): contiguous, E / size experts a worker, and with `redundant` slots, copies of the next
workers' experts (`ExpertMap.mirrored`), which an attention worker routes to while their first owner is down.
EPLB places the experts anew, per layer (`place`): the worker loads the slots it did not hold from the checkpoint
on a thread of its own while it serves on, then holds the new epoch beside the old one until no attention
worker has sent at the old one for `RETAIN_S` (attention workers switch when every expert worker is ready, each
at its own step: for that while, both are served)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvbaton.config import ConfigError, ModelConfig
from kvbaton.layers.compute_paths import moe_kernel_of, plan_compute
from kvbaton.layers.moe.dispatch import ExpertMap, restacked, stacked_experts
from kvbaton.layers.moe.experts import ExpertGroups, GroupedExperts
from kvbaton.models.loader import read_experts

logger = logging.getLogger(__name__)

RETAIN_S = 10.0  # an older placement is kept while an attention worker sent at it this recently
LOADER_NICENESS = 10  # the placement loader's thread runs at this niceness (Linux: per thread)


class PlacementRefused(ValueError):
    """A placement this worker will not load (malformed, stale, or another one still loading)."""


@dataclass(frozen=True)
class ShardSpec:
    """Which expert worker of the pool this is, and over what model."""

    model_dir: Path
    rank: int
    size: int
    dtype: torch.dtype = torch.float32
    kernels: bool = True  # bf16: compute through the C experts kernel where the CPU has one
    compute_path: str = "auto"  # the engine's --compute-path (its experts' kernel follows it)
    deterministic: bool = False  # batch-invariant kernels, as the attention workers' engines
    redundant: int = 0  # the pool's redundant expert slots (a multiple of size): copies of other workers' experts
    retain_s: float = RETAIN_S  # an older placement is dropped once unused this long


@dataclass
class Placed:
    """One placement epoch as this worker holds it: per MoE layer, its slots' logical experts and their weights."""

    epoch: int
    pool: list[list[int]]  # the placement pool-wide: per MoE layer, every slot's logical expert (as PlaceExperts)
    slots: dict[int, list[int]]
    experts: dict[int, GroupedExperts]
    logical: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer: slot -> logical expert (int64)
    used_at: float = field(default_factory=time.monotonic)  # the last dispatch at it (or when it became ready)
    ready_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.logical = {layer: torch.tensor(s, dtype=torch.int64) for layer, s in self.slots.items()}


class ExpertShard:
    def __init__(self, spec: ShardSpec) -> None:
        cfg = ModelConfig.from_dir(spec.model_dir)
        if cfg.moe is None:
            raise ConfigError(f"{spec.model_dir} has no sparse-expert (MoE) layers: nothing for an expert worker")
        self.spec = spec
        self.hidden, self.num_experts = cfg.hidden_size, cfg.moe.num_experts
        try:
            self.map = ExpertMap.mirrored(self.num_experts, spec.size, spec.redundant)
        except ValueError as exc:
            raise ConfigError(f"expert pool of {spec.size}: {exc}") from exc
        self.slots = self.map.local_experts(spec.rank)  # epoch 0's, every layer alike
        self.moe_layers = [layer for layer in range(cfg.num_hidden_layers) if cfg.moe.is_moe_layer(layer)]
        kernel = moe_kernel_of(plan_compute(spec.dtype, spec.compute_path, spec.deterministic, spec.kernels)) \
            if spec.kernels else None
        experts: dict[int, GroupedExperts] = {}
        for layer in self.moe_layers:
            stack = stacked_experts(*read_experts(spec.model_dir, layer, self.slots, spec.dtype))
            if kernel is not None and kernel.supports(stack.gate_up_proj, stack.down_proj):
                stack.use_kernel(kernel)
            experts[layer] = stack
        first = [list(self.map.physical_to_logical)] * len(self.moe_layers)
        self.held: dict[int, Placed] = {0: Placed(0, first, {layer: list(self.slots) for layer in self.moe_layers},
                                                  experts)}
        self.newest = 0
        self.counts = torch.zeros(len(self.moe_layers), self.num_experts, dtype=torch.int64)  # rows per expert
        self._row_of = {layer: i for i, layer in enumerate(self.moe_layers)}
        self._loading: tuple[int, threading.Thread] | None = None
        # a newer placement handed while another loads: it loads next (a replacement told the placement in use
        # while catching up on an older one must not refuse it: the dispatch after it would fail its step)
        self._next: tuple[int, list[list[int]]] | None = None
        self._load_began = 0.0
        self._loaded: Placed | BaseException | None = None  # the loader's result, installed by `settle`
        self.rows_computed = 0
        logger.info("expert worker %d/%d: experts %s of %d MoE layers (%s)", spec.rank, spec.size, self.slots,
                    len(self.moe_layers), "C kernel" if kernel is not None else "PyTorch")

    @property
    def dtype_name(self) -> str:
        return str(self.spec.dtype).removeprefix("torch.")

    @property
    def slots_per_worker(self) -> int:
        return self.map.slots_per_rank

    def holds(self, epoch: int) -> bool:
        return epoch in self.held

    @property
    def loading(self) -> int | None:
        """The placement epoch being loaded, if any."""
        return self._loading[0] if self._loading is not None else None

    def compute(self, layer: int, rows: torch.Tensor, local_slots: torch.Tensor, epoch: int = 0) -> torch.Tensor:
        """rows [n, hidden] through the experts of `local_slots` [n] (int64, each < slots_per_worker) of `layer`,
        under placement `epoch` (which this worker holds)."""
        placed = self.held[epoch]
        placed.used_at = time.monotonic()
        if rows.shape[0] == 0:
            return rows
        self.rows_computed += rows.shape[0]
        per_slot = torch.bincount(local_slots, minlength=self.slots_per_worker)
        self.counts[self._row_of[layer]].index_add_(0, placed.logical[layer], per_slot)
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32)
        return placed.experts[layer](rows, ExpertGroups.of(local_slots.unsqueeze(1), ones, self.slots_per_worker))

    # ---- placements (EPLB) ---------------------------------------------------------------------

    def place(self, epoch: int, placement: list[list[int]]) -> None:
        """Start loading placement `epoch` (a no-op if it is held, loading or next); while an older one loads, it
        loads next (a newer one handed meanwhile takes its place). PlacementRefused if it is malformed or older
        than the newest held, loading or next."""
        if epoch in self.held or epoch in (self.loading, self.next_epoch):
            return
        newest = max(self.newest, self.loading or 0, self.next_epoch or 0)
        if epoch < newest:
            raise PlacementRefused(f"placement epoch {epoch} is older than the newest here ({newest})")
        self._own_slots(placement)  # refused now, not when its turn comes
        if self._loading is not None:
            self._next = (epoch, [list(row) for row in placement])
            return
        self._start_load(epoch, placement)

    @property
    def next_epoch(self) -> int | None:
        """The placement epoch to load once the one loading is in, if any."""
        return self._next[0] if self._next is not None else None

    def _start_load(self, epoch: int, placement: list[list[int]]) -> None:
        mine = self._own_slots(placement)
        pool = [list(row) for row in placement]
        thread = threading.Thread(target=self._load, args=(epoch, pool, mine, self.held[self.newest]), daemon=True,
                                  name=f"kvbaton-expert-place-{epoch}")
        self._loading, self._load_began = (epoch, thread), time.monotonic()
        thread.start()

    def _own_slots(self, placement: list[list[int]]) -> dict[int, list[int]]:
        """This worker's slots of every layer in a pool-wide placement, once the placement checks out."""
        per, size = self.slots_per_worker, self.spec.size
        if len(placement) != len(self.moe_layers):
            raise PlacementRefused(f"a placement of {len(placement)} layers for {len(self.moe_layers)} MoE layers")
        mine = {}
        for layer, row in zip(self.moe_layers, placement):
            if len(row) != per * size or any(not 0 <= e < self.num_experts for e in row) \
                    or len(set(row)) != self.num_experts:
                raise PlacementRefused(f"layer {layer}'s placement is not {per * size} slots covering each of the "
                                       f"{self.num_experts} experts")
            mine[layer] = list(row[self.spec.rank * per:(self.spec.rank + 1) * per])
        return mine

    def _load(self, epoch: int, pool: list[list[int]], slots: dict[int, list[int]], current: Placed) -> None:
        with contextlib.suppress(OSError):  # this thread yields the cores to the exchanges it must not stall
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADER_NICENESS)
        try:
            read = functools.partial(read_experts, self.spec.model_dir, dtype=self.spec.dtype)
            # a layer whose slots here stay as they are keeps its weights (shared by both epochs: read-only)
            experts = {layer: current.experts[layer] if wanted == current.slots[layer] else
                       restacked(current.experts[layer], current.slots[layer], wanted, functools.partial(read, layer))
                       for layer, wanted in slots.items()}
            self._loaded = Placed(epoch, pool, slots, experts)
        except BaseException as exc:  # noqa: BLE001 - reported by `settle` on the serving thread
            self._loaded = exc

    def wait_loaded(self, epoch: int) -> None:
        """Block until placement `epoch` is loaded, where it is loading or next (a dispatch at it came first)."""
        while self._loading is not None and epoch in (self._loading[0], self.next_epoch):
            self._loading[1].join()
            self.settle()

    def settle(self) -> None:
        """On the serving thread: hold a finished load as the newest placement, and drop an older one once nobody
        sent at it for `retain_s` and the newest has been ready as long (the newest is always kept)."""
        if self._loading is not None and not self._loading[1].is_alive():
            epoch, loaded = self._loading[0], self._loaded
            self._loading, self._loaded = None, None
            if isinstance(loaded, Placed):
                self.held[epoch] = loaded
                self.newest = epoch
                logger.info("expert worker %d: placement epoch %d ready after %.0f ms (first MoE layer: %s)",
                            self.spec.rank, epoch, (time.monotonic() - self._load_began) * 1e3,
                            loaded.slots[self.moe_layers[0]])
            else:
                logger.error("expert worker %d: loading placement epoch %d failed: %s", self.spec.rank, epoch, loaded)
            if self._next is not None:  # the placement handed while that one loaded
                (following, placement), self._next = self._next, None
                if following > self.newest:
                    self._start_load(following, placement)
        newest = self.held[self.newest]
        now = time.monotonic()
        for epoch in [e for e in self.held if e != self.newest]:
            if now - max(self.held[epoch].used_at, newest.ready_at) > self.spec.retain_s:
                del self.held[epoch]
                logger.info("expert worker %d: placement epoch %d dropped", self.spec.rank, epoch)
