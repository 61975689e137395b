"""The engine's side of prefill/decode disaggregation: its KV connector halves, and the requests whose
KV is on the move. No torch here (the connector halves are used through their contract only).

    prefill role (a sender):   the runner begins a request's hand-off in the step that ends its prompt
                               and sends it layer by layer; the request then finishes as `transfer` and
                               its blocks stay held (`Scheduler.is_held`) until `poll()` sees the send end.
    decode role (a receiver):  `reserve()` allocates blocks for a prompt's KV outside the prefix cache and
                               tells the receiver to expect it; the request starts decoding once both its
                               KV (seen by `poll()`) and its first token (`start_decode()`) are in, in
                               either order.

Every way a hand-off ends (completed, failed, cancelled, aborted) frees its blocks here, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbaton.sched.outputs import TransferFailure
from kvbaton.sched.request import Request
from kvbaton.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from kvbaton.kv.connectors.base import KVReceiver, KVSender


@dataclass(frozen=True)
class Reservation:
    """Decode side: the prompt tokens already in this pool, and the blocks the rest must be written into."""

    num_cached_tokens: int
    dst_block_ids: list[int]


class KVHandoff:
    def __init__(self, scheduler: Scheduler, sender: KVSender | None, receiver: KVReceiver | None) -> None:
        self.scheduler, self.sender, self.receiver = scheduler, sender, receiver
        self._first_tokens: dict[str, int] = {}  # StartDecode seen, KV maybe not yet
        self._arrived: set[str] = set()  # KV in, first token maybe not yet

    @property
    def receiver_address(self) -> str | None:
        return self.receiver.address if self.receiver is not None else None

    # ---- decode side -------------------------------------------------------------------------

    def reserve(self, req: Request, deadline_s: float) -> Reservation | None:
        """Reserve blocks for `req`'s prompt and expect its KV; None when the pool has no room now.
        Raises RuntimeError on a worker that receives no KV, ValueError on a duplicate id."""
        if self.receiver is None:
            raise RuntimeError("this engine receives no KV (not started in the decode role)")
        reserved = self.scheduler.reserve_for_transfer(req)
        if reserved is None:
            return None
        num_cached, dst_block_ids = reserved
        self.receiver.expect(req.request_id, dst_block_ids, deadline_s)
        return Reservation(num_cached, dst_block_ids)

    def start_decode(self, request_id: str, first_token_id: int) -> None:
        """The prefill worker sampled the request's first token: decode on once the KV is in."""
        if self.scheduler.is_receiving(request_id):
            self._first_tokens[request_id] = first_token_id
            self._admit_ready()

    def cancel_receive(self, request_id: str) -> None:
        if self.receiver is not None:
            self.receiver.cancel(request_id)
        self.scheduler.cancel_receive(request_id)
        self._first_tokens.pop(request_id, None)
        self._arrived.discard(request_id)

    # ---- both sides --------------------------------------------------------------------------

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests' hand-offs, on whichever side they are, and free their blocks."""
        for request_id in request_ids:
            self.cancel_receive(request_id)
            if self.sender is not None and self.scheduler.is_held(request_id):
                self.sender.abort(request_id)
                self.scheduler.release_held(request_id)

    def poll(self) -> list[TransferFailure]:
        """Move hand-offs along: free the blocks of sends that ended, take in KV that arrived, admit
        what is ready. Returns the hand-offs that failed since the last poll."""
        failures: list[TransferFailure] = []
        if self.sender is not None:
            result = self.sender.poll()
            for request_id in result.completed:
                self.scheduler.release_held(request_id)
            for request_id, reason in result.failed:
                self.scheduler.release_held(request_id)
                failures.append(TransferFailure(request_id, reason))
        if self.receiver is not None:
            result = self.receiver.poll()
            self._arrived.update(r for r in result.completed if self.scheduler.is_receiving(r))
            for request_id, reason in result.failed:
                self.cancel_receive(request_id)
                failures.append(TransferFailure(request_id, reason))
            self._admit_ready()
        return failures

    @property
    def num_receiving(self) -> int:
        return self.scheduler.num_receiving

    @property
    def num_sending(self) -> int:
        return self.scheduler.num_held

    @property
    def in_flight(self) -> bool:
        return bool(self.scheduler.num_held or self.scheduler.num_receiving)

    def close(self) -> None:
        for half in (self.sender, self.receiver):
            if half is not None:
                half.close()

    def _admit_ready(self) -> None:
        for request_id in [r for r in self._arrived if r in self._first_tokens]:
            self._arrived.discard(request_id)
            self.scheduler.admit_transferred(request_id, self._first_tokens.pop(request_id))
