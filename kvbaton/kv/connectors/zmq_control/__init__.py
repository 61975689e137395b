"""What the ZeroMQ-based transports (`shm`, `tcp`) share: the control messages (here) and the
bookkeeping of both roles (`sender`, `receiver`: deadlines, acks, cancel/abort, refusals). A
transport adds how one layer travels (its layer message, in its own package).

    prefill worker                                          decode worker
    ZmqSender ── layer messages (PUSH) ────────────────▶  ZmqReceiver socket (PULL, bound: .address)
      ack socket (PULL, bound) ◀── Ack (PUSH, ack_to) ──

Threads: see `kvbaton.wire.io_thread`. Data lands in the receiver's pool only inside poll().
"""

from __future__ import annotations

import msgspec

NOT_EXPECTING = "the decode worker is not expecting this request (cancelled, timed out or never expected)"


class Ack(msgspec.Struct, tag="ack", frozen=True):
    """Decode -> prefill: the transfer ended on the receiver; ok means every layer is in its pool."""

    request_id: str
    ok: bool
    reason: str = ""


class SenderFailed(msgspec.Struct, tag="sender_failed", frozen=True):
    """Prefill -> decode: the sender gave up (aborted, deadline, layout mismatch); stop waiting."""

    request_id: str
    reason: str
