"""The frames between an attention worker and an expert worker: typed msgspec structs, signed with the cluster
secret (one HMAC per frame, over the whole exchange batch: hashlib's C, not per row), bounded in size, never
pickled. Row payloads are raw little-endian bytes of the model's dtype; slot ids are int32.

    attention ──PoolHello──▶ expert           expert ──PoolWelcome──▶ attention   (once per connection)
    attention ──DispatchRows──▶ expert        expert ──CombinedRows | ExchangeFailed──▶ attention

A ticket numbers an attention worker's exchanges (one per layer and micro-batch); the reply carries it back,
so the attention side takes each micro-batch's outputs in whatever order they arrive."""

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


class DispatchRows(msgspec.Struct, tag="dispatch", frozen=True):
    ticket: int
    layer: int
    rows: bytes  # [n, hidden] in the pool's dtype
    slots: bytes  # [n] int32: each row's slot among the worker's own


class CombinedRows(msgspec.Struct, tag="combined", frozen=True):
    ticket: int
    rows: bytes  # [n, hidden]: each dispatched row through its slot's expert (weight 1: the sender combines)


class ExchangeFailed(msgspec.Struct, tag="failed", frozen=True):
    ticket: int
    message: str


ToExpert = PoolHello | DispatchRows
FromExpert = PoolWelcome | CombinedRows | ExchangeFailed


def max_frame_bytes(max_rows: int, hidden: int, dtype: str) -> int:
    """The largest frame either side accepts: `max_rows` rows of `hidden` (and their slot ids), with room for
    the struct's framing and the MAC."""
    return max_rows * (hidden * WIRE_DTYPES[dtype] + 4) + 4096
