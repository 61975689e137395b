"""KV transfer with the Mooncake Transfer Engine: the receiver reads block rows straight out of
the sender's pool into its own, layer by layer, with batched one-sided reads.

    prefill (Sender)                               decode (Receiver)
    begin()      ── Offer(session, pool addrs, blocks) ──▶   checks layout and blocks
    save_layer(l)── LayerReady(l) ─────────────────────▶   poll(): batch_transfer_sync_read
                                                              sender pool rows -> own pool rows
    poll()       ◀── Done / Failed ─────────────────────   after the last layer (or on failure)

Both pools are registered with a Mooncake engine (`P2PHANDSHAKE` metadata: no etcd); control
messages are SignedCodec frames over ZeroMQ (DEALER -> ROUTER), on one `kvbaton.wire.IOThread`
per side.

NOTE: the receiver pulls, inside poll(), because that is the one way to honour both halves of
the contract with one-sided I/O: its pool is written only on the engine thread, and it never
receives data after it reported a request failed or cancelled (a pushing sender could still be
writing). The price is that poll() waits for the read — microseconds to milliseconds over RDMA,
~2 GB/s over loopback TCP, and at most Mooncake's transfer timeout for a hung peer. The sender
sends from its pool in place (zero copy): the contract keeps its source blocks allocated until
its poll() reports the transfer; a read must finish before the receiver's deadline, which is
set before the sender's (expect() precedes begin()), so a sender that gave up is never read.

Protocol: `KVBATON_MOONCAKE_PROTOCOL` = "tcp" (default) or "rdma" on a real cluster, with
`KVBATON_MOONCAKE_DEVICE` naming the RDMA NICs ("mlx5_0,mlx5_1"; empty: all). Mooncake's data
plane is unauthenticated (any peer that can reach its port may read or write registered
memory) and listens on every interface, whatever host it is given: use it only on a private cluster
network. A worker refuses to start it, on loopback too, unless the config says `allow_insecure_transport`
(`kvbaton serve --allow-insecure-kv-transport`).
"""

from __future__ import annotations

import msgspec

from kvbaton.kv.layout import KVLayout

MAX_FRAME_BYTES = 16 * 2**20  # an Offer lists every block id twice


class Offer(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    session: str  # the sender's Mooncake engine, host:rpc_port
    layout: KVLayout
    num_blocks: int  # blocks in each of the sender's pools
    layer_addrs: list[int]  # base address of the sender's pool of each layer
    src_block_ids: list[int]
    dst_block_ids: list[int]


class LayerReady(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]
    layer: int


class Cancel(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    reason: str


class Done(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class Failed(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    reason: str


ToReceiver = Offer | LayerReady | Cancel
ToSender = Done | Failed
