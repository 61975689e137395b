"""The `shm` transport: prefill and decode workers on one host, KV moved through shared memory.

Zero extra copies when the prefill worker's pools live in shared memory (`segments.allocate_shared_pools`,
which `kvbaton.kv.connectors.pool_allocator` picks for shm senders): a layer message only names the
rows, and the receiver copies them straight from the sender's pool into its own, inside poll(). With
plain pools the sender first copies each layer's rows into a staging segment (one more copy, on its
I/O thread; segments are reused from one transfer to the next, and stay mapped on both sides while
in use).

    prefill: save_layer(i) ── ShmLayer(segment, offset, rows) over ZeroMQ (127.0.0.1, signed) ──▶ decode
    decode:  poll(): memmove rows from the mapped segment into dst blocks; after the last layer ──▶ Ack

Shared memory is private to the host, so the bulk data is not MACed; the control messages are
(SignedCodec), and a receiver maps only segments named in signed messages, read-only.

Cleanup: the creator unlinks its segments (shared pools at `KVPools.close()`; staging segments at
`Sender.close()`, or when a transfer ends without the receiver's word) and registers them with
multiprocessing's resource tracker, which unlinks them if the process dies first (when the
tracker's last user exits: right away for a worker started with subprocess, at the launcher's exit
for one started by multiprocessing). An unlinked segment stays readable by whoever has it mapped,
so a receiver never faults on a dead sender: it fails that sender's transfers (its pid is gone, or
by the deadline) and unmaps its segments.
"""

from __future__ import annotations

import msgspec

from kvbaton.kv.layout import KVLayout


class ShmLayer(msgspec.Struct, tag="shm_layer", frozen=True):
    """Prefill -> decode: layer `layer` of the request is in `segment`, block-rows `rows` from `offset`."""

    request_id: str
    layer: int
    layout: KVLayout
    ack_to: str
    sender_pid: int
    segment: str
    offset: int  # bytes from the segment's start to row 0
    rows: list[int]  # in dst_block_ids order
    staging: bool  # a staging segment (mapped while in use), not the sender's pool (mapped for good)

    @property
    def num_blocks(self) -> int:
        return len(self.rows)
