"""Expert parallelism: the experts of a MoE layer spread over the ranks of a process group, tokens sent to
the rank of their expert and back (all-to-all dispatch and combine, every MoE layer of every step).

    rank r: tokens of its own requests ──route──▶ (token, slot) ──sort by slot──▶ | to r0 | to r1 | ...
            all_to_all(rows)  ─▶ each rank runs the rows it received through its local experts
            all_to_all(outputs) back ─▶ the routing-weighted sum per token, in the order one process sums it

A slot is a physical expert copy; `ExpertMap` says which logical expert each slot holds (EPLB may give a hot
expert several), slot s lives on rank `s // slots_per_rank`, and token i of rank r's batch takes copy
`(i * ranks + r) % copies` of its expert: a hot expert's tokens spread over its copies, and even a rank with a
single token (decode) uses another copy than its neighbours; no communication is needed to agree.

Every rank must make the same calls in the same order: a rank without tokens this step still runs
`idle_exchange` for each MoE layer (the engine's lockstep does that).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from kvbaton.layers.moe.experts import ExpertGroups, GroupedExperts

SCALE_BYTES = 4  # an int8 row's fp32 scale rides after its codes
SLOT_BYTES = 8  # a row's slot id (int64) rides after the row


@dataclass(frozen=True)
class ExpertMap:
    """Which logical expert each physical slot holds, over `num_ranks` ranks with equal slot counts."""

    physical_to_logical: tuple[int, ...]
    num_ranks: int

    def __post_init__(self) -> None:
        if len(self.physical_to_logical) % self.num_ranks:
            raise ValueError(f"{len(self.physical_to_logical)} expert slots do not split over {self.num_ranks} ranks")

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int) -> ExpertMap:
        """No replicas: rank r holds experts [r * E/N, (r + 1) * E/N)."""
        if num_experts % num_ranks:
            raise ValueError(f"{num_experts} experts do not split evenly over {num_ranks} expert-parallel ranks")
        return cls(tuple(range(num_experts)), num_ranks)

    @classmethod
    def mirrored(cls, num_experts: int, num_ranks: int, redundant: int) -> ExpertMap:
        """Rank r holds its contiguous share of the experts, then `redundant / num_ranks` copies of the next
        ranks' shares (rank r+1's first, then r+2's, ...): with redundant = num_experts every expert is on two
        ranks, and any one rank can go with all its experts still served by the others."""
        base = cls.contiguous(num_experts, num_ranks)
        if redundant % num_ranks or not 0 <= redundant <= num_experts * (num_ranks - 1):
            raise ValueError(f"{redundant} redundant expert slots: need a multiple of the {num_ranks} ranks, at most "
                             f"{num_experts * (num_ranks - 1)} (every expert on every rank)")
        extra = redundant // num_ranks
        slots: list[int] = []
        for rank in range(num_ranks):
            others = [e for k in range(1, num_ranks) for e in base.local_experts((rank + k) % num_ranks)]
            slots += base.local_experts(rank) + others[:extra]
        return cls(tuple(slots), num_ranks)

    @property
    def slots_per_rank(self) -> int:
        return len(self.physical_to_logical) // self.num_ranks

    def local_experts(self, rank: int) -> list[int]:
        per = self.slots_per_rank
        return list(self.physical_to_logical[rank * per:(rank + 1) * per])

    def lookup(self, num_experts: int, without: frozenset[int] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
        """(replica slots [E, max copies] padded by repeating, copies per expert [E]), leaving out the slots of
        the ranks in `without` (ValueError if an expert then has none)."""
        slots: list[list[int]] = [[] for _ in range(num_experts)]
        per = self.slots_per_rank
        for slot, expert in enumerate(self.physical_to_logical):
            if slot // per not in without:
                slots[expert].append(slot)
        if any(not s for s in slots):
            raise ValueError("every logical expert needs at least one slot")
        width = max(len(s) for s in slots)
        table = [(s * width)[:width] for s in slots]
        return torch.tensor(table, dtype=torch.int64), torch.tensor([len(s) for s in slots], dtype=torch.int64)


class ExpertDispatcher(Protocol):
    """Where a MoE block's routed experts run when they are not all in this process: expert parallelism's
    all-to-all (`AllToAllDispatch`) or attention/FFN disaggregation's expert pool (kvbaton.parallel.afd).
    `post` sends a layer's rows and returns what `wait` needs to take their combined outputs back, so a
    micro-batched step computes something else in between (`models/ping_pong.py`); `x(...)` is the two at once."""

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...

    def post(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Any: ...

    def wait(self, pending: Any) -> torch.Tensor: ...

    def idle_exchange(self, hidden_size: int, dtype: torch.dtype) -> None: ...


class AllToAllDispatch:
    """Replaces a MoE block's local expert computation when its experts are spread over `group`."""

    def __init__(self, experts: GroupedExperts, expert_map: ExpertMap, num_experts: int,
                 group: dist.ProcessGroup, int8_wire: bool = False) -> None:
        self.experts = experts  # this rank's slots, in slot order
        self.map = expert_map
        self.num_experts = num_experts
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.world != expert_map.num_ranks:
            raise ValueError(f"an expert map of {expert_map.num_ranks} ranks for a group of {self.world}")
        self.slot_table, self.copies = expert_map.lookup(num_experts)
        self.int8_wire = int8_wire
        self.bytes_sent = 0  # dispatch + combine payload this rank sent to other ranks (statistics)
        self.rows_computed = 0  # token-expert pairs this rank's experts computed (its share of the layer's work)
        # exchanges begun and finished: equal unless one broke half-way (then the group is out of step)
        self.exchanges_started = self.exchanges_finished = 0

    def swap(self, experts: GroupedExperts, expert_map: ExpertMap) -> None:
        """Take a new placement (EPLB) with this rank's new slots' weights; between steps, on every rank at once."""
        if expert_map.num_ranks != self.world:
            raise ValueError(f"an expert map of {expert_map.num_ranks} ranks for a group of {self.world}")
        self.experts, self.map = experts, expert_map
        self.slot_table, self.copies = expert_map.lookup(self.num_experts)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H], ids/weights: [T, k] -> [T, H]: the weighted sum of each token's experts."""
        tokens, slots = choose_slots(ids, self.slot_table, self.copies, self.world, self.rank)
        order = torch.argsort(slots, stable=True)  # grouped by destination rank, then by slot
        per = self.map.slots_per_rank
        send_counts = torch.bincount(slots // per, minlength=self.world)
        outputs = self._exchange(x[tokens[order]], slots[order] % per, send_counts)
        rows = torch.empty_like(outputs)
        rows[order] = outputs  # back in assignment order
        return combine(x, rows, ids, weights)

    def post(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The split form a micro-batched step calls (`SparseMoeBlock.begin`): a collective exchange cannot wait
        in the background, so it runs here; `wait` hands its result back."""
        return self(x, ids, weights)

    def wait(self, pending: torch.Tensor) -> torch.Tensor:
        return pending

    def idle_exchange(self, hidden_size: int, dtype: torch.dtype) -> None:
        """This rank has no tokens this step: take part in the layer's exchanges with nothing to send."""
        empty = torch.empty(0, hidden_size, dtype=dtype)
        self._exchange(empty, torch.empty(0, dtype=torch.int64), torch.zeros(self.world, dtype=torch.int64))

    def _exchange(self, rows: torch.Tensor, local_slots: torch.Tensor, send_counts: torch.Tensor) -> torch.Tensor:
        """Send each row to its slot's rank, run what arrives through the local experts, send the results back:
        three all-to-alls (the counts, then each row with its slot id in one payload, then the results)."""
        self.exchanges_started += 1
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        payload = self._pack(rows, local_slots)
        arrived, arrived_slots = self._unpack(self._all_to_all(payload, send, recv), rows.dtype, rows.shape[1])
        computed = self._local_experts(arrived, arrived_slots)
        self.bytes_sent += _remote_bytes(payload, send, self.rank) + _remote_bytes(computed, recv, self.rank)
        out = self._all_to_all(computed, recv, send)
        self.exchanges_finished += 1
        return out

    def _pack(self, rows: torch.Tensor, local_slots: torch.Tensor) -> torch.Tensor:
        """[N, H] rows (int8 codes + scale on an int8 wire) and their [N] slot ids as one [N, bytes] payload."""
        codes = (quantize_rows(rows) if self.int8_wire else rows).contiguous()
        as_bytes = codes.view(torch.uint8).reshape(rows.shape[0], codes.shape[1] * codes.element_size())
        slot_bytes = local_slots.to(torch.int64).contiguous().view(torch.uint8).reshape(rows.shape[0], SLOT_BYTES)
        return torch.cat((as_bytes, slot_bytes), dim=1)

    def _unpack(self, payload: torch.Tensor, dtype: torch.dtype, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: a flat copy: an empty slice keeps its storage offset and strides, which an int64 view refuses
        body, slot_bytes = payload[:, :-SLOT_BYTES].contiguous(), payload[:, -SLOT_BYTES:].reshape(-1).clone()
        slots = slot_bytes.view(torch.int64)
        if self.int8_wire:
            return dequantize_rows(body.view(torch.int8), dtype), slots
        return body.view(dtype).reshape(payload.shape[0], hidden), slots

    def _all_to_all(self, tensor: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                               group=self.group)
        return out

    def _local_experts(self, rows: torch.Tensor, local_slots: torch.Tensor) -> torch.Tensor:
        """Each arrived row through its slot's expert (one routing choice per row, weight 1)."""
        if rows.shape[0] == 0:
            return rows
        self.rows_computed += rows.shape[0]
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32)
        return self.experts(rows, ExpertGroups.of(local_slots.unsqueeze(1), ones, self.map.slots_per_rank))


def choose_slots(ids: torch.Tensor, slot_table: torch.Tensor, copies: torch.Tensor, spread: int,
                 offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [T*k], slot [T*k]) of each assignment of `ids` [T, k]: token i takes copy `(i * spread + offset) %
    copies` of its expert, so a hot expert's tokens spread over its copies and senders (`offset`: a sender's
    index among `spread`) use different copies, with no communication to agree."""
    tokens = torch.arange(ids.shape[0]).repeat_interleave(ids.shape[1])
    flat = ids.flatten()
    return tokens, slot_table[flat, (tokens * spread + offset) % copies[flat]]


def combine(x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's weighted sum of its assignments' expert outputs (`rows` [T*k, H], in assignment order).
    NOTE: weighted and summed as one process's PyTorch path does (by expert id, token order kept), so a
    dispatched layer equals the local one bit for bit when each expert's rows do (fp32; a bf16 engine's C
    kernel fuses its combine differently, so there the two agree to bf16 rounding only)."""
    by_expert = torch.argsort(ids.flatten(), stable=True)
    weighted = rows[by_expert].mul_(weights.flatten()[by_expert].to(rows.dtype).unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, by_expert // ids.shape[1], weighted)


def _remote_bytes(rows: torch.Tensor, counts: list[int], rank: int) -> int:
    """Bytes of the rows that go to other ranks (a rank's own rows never leave it)."""
    return (sum(counts) - counts[rank]) * rows.shape[1] * rows.element_size()


def quantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """[N, H] -> [N, H + 4] int8: per-row absmax codes, then the row's fp32 scale as 4 bytes."""
    x = rows.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)  # [N, 1]
    codes = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat((codes, scale.view(torch.int8)), dim=1)


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    codes, scale = packed[:, :-SCALE_BYTES], packed[:, -SCALE_BYTES:].contiguous().view(torch.float32)
    return (codes.float() * scale).to(dtype)


def shard_experts(block_experts: GroupedExperts, expert_map: ExpertMap, rank: int) -> GroupedExperts:
    """This rank's slots of a layer's experts (copies of their weights; the full stack can then be freed)."""
    local = torch.tensor(expert_map.local_experts(rank), dtype=torch.int64)
    return stacked_experts(block_experts.gate_up_proj.detach()[local], block_experts.down_proj.detach()[local])


def stacked_experts(gate_up: torch.Tensor, down: torch.Tensor) -> GroupedExperts:
    """Experts over given stacks: gate_up [n, 2I, H], down [n, H, I] (taken, not copied)."""
    with torch.device("meta"):
        experts = GroupedExperts(gate_up.shape[0], down.shape[1], down.shape[2])
    experts.gate_up_proj = torch.nn.Parameter(gate_up.contiguous(), requires_grad=False)
    experts.down_proj = torch.nn.Parameter(down.contiguous(), requires_grad=False)
    return experts


def restacked(current: GroupedExperts, held: Sequence[int], wanted: Sequence[int],
              read: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]) -> GroupedExperts:
    """Experts whose slot i holds logical expert `wanted[i]`, from `current` (whose slots hold `held`): an expert
    it holds is copied (already in its kernel's layout), the others read (`read`: logical experts -> gate_up,
    down stacks) and packed for the same kernel. What EPLB runs off the serving path to move experts."""
    gate_up = torch.empty((len(wanted), *current.gate_up_proj.shape[1:]), dtype=current.gate_up_proj.dtype)
    down = torch.empty((len(wanted), *current.down_proj.shape[1:]), dtype=current.down_proj.dtype)
    moved = [i for i, expert in enumerate(wanted) if expert not in held]
    for i, expert in enumerate(wanted):
        if i not in moved:
            source = held.index(expert)
            gate_up[i].copy_(current.gate_up_proj[source])
            down[i].copy_(current.down_proj[source])
    if moved:
        read_up, read_down = read([wanted[i] for i in moved])
        if current.kernel is not None:  # the kept slots are in the kernel's layout (packed per expert)
            current.kernel.pack_(read_up, read_down)
        for j, i in enumerate(moved):
            gate_up[i].copy_(read_up[j])
            down[i].copy_(read_down[j])
    experts = stacked_experts(gate_up, down)
    experts.kernel = current.kernel  # the new stacks are in its layout already
    return experts
