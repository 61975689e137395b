"""The frames between an attention worker and an expert worker: typed msgspec structs, signed with the cluster
secret (one HMAC per frame, over the whole exchange batch: hashlib's C, not per row), bounded in size, never
pickled. Row payloads are raw little-endian bytes of the model's dtype; slot ids are int32.

    attention ──PoolHello──▶ expert           expert ──PoolWelcome──▶ attention   (once per connection)
    attention ──DispatchRows──▶ expert        expert ──CombinedRows | ExchangeFailed──▶ attention
    attention ──DispatchShared──▶ expert      expert ──CombinedShared | ExchangeFailed──▶ attention  (same host)
    attention ──PlaceExperts──▶ expert        expert ──Placing──▶ attention        (EPLB: a new placement)
    attention ──LoadQuery──▶ expert           expert ──PoolLoad──▶ attention       (EPLB: the load it served)

A ticket numbers an attention worker's exchanges (one per layer and micro-batch); the reply carries it back,
so the attention side takes each micro-batch's outputs in whatever order they arrive. A placement epoch numbers
the pool's placements (0: the first, `ExpertMap.mirrored`; EPLB's later ones, `pool_balance.py`): a dispatch
names the epoch its slot ids are of, and every answer says the newest epoch its worker holds (`ready`), which is
how an attention worker learns that the pool has moved on. The `Shared` pair carries
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
    epoch: int  # the newest placement it holds
    placement: list[list[int]]  # that placement, pool-wide: per MoE layer (`layers` order), every slot's expert
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
    epoch: int  # the placement the slot ids are of
    rows: bytes  # [n, hidden] in the pool's dtype
    slots: bytes  # [n] int32: each row's slot among the worker's own


class DispatchShared(msgspec.Struct, tag="dispatch_shm", frozen=True):
    ticket: int
    layer: int
    epoch: int
    segment: str  # the sender's slot (`shared_rows.SlotLayout`): rows at 0, slot ids, then room for the outputs
    capacity: int  # rows the slot is laid out for
    rows: int  # rows of this dispatch (<= capacity)


class CombinedShared(msgspec.Struct, tag="combined_shm", frozen=True):
    ticket: int  # the outputs are in the dispatch's slot
    ready: int  # the newest placement epoch the worker holds


class CombinedRows(msgspec.Struct, tag="combined", frozen=True):
    ticket: int
    rows: bytes  # [n, hidden]: each dispatched row through its slot's expert (weight 1: the sender combines)
    ready: int


class ExchangeFailed(msgspec.Struct, tag="failed", frozen=True):
    ticket: int
    message: str
    ready: int


class PlaceExperts(msgspec.Struct, tag="place", frozen=True):
    """Hold `placement` as epoch `epoch`: per MoE layer, the logical expert of every slot of the pool (slot s on
    worker s // slots per worker). The worker loads its new slots' weights in the background and keeps serving
    the epochs it holds; once loaded, its answers say `ready` = epoch."""

    epoch: int
    placement: list[list[int]]


class Placing(msgspec.Struct, tag="placing", frozen=True):
    epoch: int  # the placement asked for
    ready: int  # the newest placement held now
    refused: str = ""  # why it will not load this one ("": it is loading it, or holds it)


class LoadQuery(msgspec.Struct, tag="load_query", frozen=True):
    pass


class PoolLoad(msgspec.Struct, tag="load", frozen=True):
    counts: list[list[int]]  # per MoE layer (welcome order), per logical expert: rows computed since it started
    ready: int


ToExpert = PoolHello | DispatchRows | DispatchShared | PlaceExperts | LoadQuery
FromExpert = PoolWelcome | CombinedRows | CombinedShared | ExchangeFailed | Placing | PoolLoad


def max_frame_bytes(max_rows: int, hidden: int, dtype: str) -> int:
    """The largest frame either side accepts: `max_rows` rows of `hidden` (and their slot ids), with room for
    the struct's framing and the MAC."""
    return max_rows * (hidden * WIRE_DTYPES[dtype] + 4) + 4096
