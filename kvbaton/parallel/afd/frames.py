"""The frames between an attention worker and an expert worker: typed msgspec structs, signed with the cluster
secret (one HMAC per frame, over the whole exchange batch: hashlib's C, not per row), bounded in size, never
pickled. Row payloads are raw little-endian bytes of the model's dtype; slot ids are int32.

    attention ──PoolHello──▶ expert           expert ──PoolWelcome──▶ attention   (once per connection)
    attention ──DispatchRows──▶ expert        expert ──CombinedRows | ExchangeFailed──▶ attention
    attention ──DispatchShared──▶ expert      expert ──CombinedShared | ExchangeFailed──▶ attention  (same host)

A ticket numbers an attention worker's exchanges (one per layer and micro-batch); the reply carries it back,
so the attention side takes each micro-batch's outputs in whatever order they arrive. The `Shared` pair carries
no rows: they are in an owner-only shared-memory slot the frame names (`shared_rows.py`), used where the expert
worker's welcome proved the two share /dev/shm."""

from __future__ import annotations

import msgspec

WIRE_DTYPES = {"float32": 4, "bfloat16": 2}  # row dtypes the wire carries, and their bytes per element


class PoolHello(msgspec.Struct, tag="hello", frozen=True):
    attention: str  # the attention worker's name (for the expert worker's log)
    hidden: int
    dtype: str
    num_experts: int


class PoolWelcome(msgspec.Struct, tag="welcome", frozen=True):
    rank: int  # this expert worker's place in the pool
    size: int  # expert workers in the pool
    slots: list[int]  # the logical expert each of its slots holds (every MoE layer alike)
    layers: list[int]  # the decoder layers whose experts it holds
    hidden: int
    dtype: str
    num_experts: int
    probe: str = ""  # its shared-memory probe segment ("": none), holding `probe_token`
    probe_token: bytes = b""
    local: str = ""  # its same-host socket (`local_channel.py`; "": none): where DispatchShared frames go


class DispatchRows(msgspec.Struct, tag="dispatch", frozen=True):
    ticket: int
    layer: int
    rows: bytes  # [n, hidden] in the pool's dtype
    slots: bytes  # [n] int32: each row's slot among the worker's own


class DispatchShared(msgspec.Struct, tag="dispatch_shm", frozen=True):
    ticket: int
    layer: int
    segment: str  # the sender's slot (`shared_rows.SlotLayout`): rows at 0, slot ids, then room for the outputs
    capacity: int  # rows the slot is laid out for
    rows: int  # rows of this dispatch (<= capacity)


class CombinedShared(msgspec.Struct, tag="combined_shm", frozen=True):
    ticket: int  # the outputs are in the dispatch's slot


class CombinedRows(msgspec.Struct, tag="combined", frozen=True):
    ticket: int
    rows: bytes  # [n, hidden]: each dispatched row through its slot's expert (weight 1: the sender combines)


class ExchangeFailed(msgspec.Struct, tag="failed", frozen=True):
    ticket: int
    message: str


ToExpert = PoolHello | DispatchRows | DispatchShared
FromExpert = PoolWelcome | CombinedRows | CombinedShared | ExchangeFailed


def max_frame_bytes(max_rows: int, hidden: int, dtype: str) -> int:
    """The largest frame either side accepts: `max_rows` rows of `hidden` (and their slot ids), with room for
    the struct's framing and the MAC."""
    return max_rows * (hidden * WIRE_DTYPES[dtype] + 4) + 4096
