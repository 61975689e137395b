"""One simulated request from arrival to its last token, and the bench record it becomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbaton.sim.spec import SimRequest
from kvbaton.workload.records import RequestRecord

if TYPE_CHECKING:
    from kvbaton.sim.instance import Reservation, SimInstance


@dataclass
class SimFlight:
    req: SimRequest
    arrival_s: float
    status: str = "running"  # then one of kvbaton.workload.records.STATUSES
    error: str = ""
    token_s: list[float] = field(default_factory=list)  # when each output token reached the client
    end_s: float | None = None
    decode: SimInstance | None = None
    prefill: SimInstance | None = None
    reservation: Reservation | None = None  # on the decode instance, for a disaggregated flight

    @property
    def id(self) -> str:
        return str(self.req.request_id)

    @property
    def first_token_s(self) -> float | None:
        return self.token_s[0] if self.token_s else None

    def token(self, now: float) -> None:
        self.token_s.append(now)

    def fail(self, status: str, error: str, now: float) -> None:
        self.status, self.error, self.end_s = status, error, now

    def record(self, run_start_s: float) -> RequestRecord:
        """The record `kvbaton bench serve` would have written for this request."""
        sent = self.arrival_s - run_start_s
        base = RequestRecord(self.req.request_id, len(self.req.prompt_token_ids), self.req.output_len,
                             scheduled_s=sent, send_s=sent, status=self.status, error=self.error)
        if self.status != "ok":
            return base
        assert self.end_s is not None and self.token_s
        gaps = tuple(b - a for a, b in zip(self.token_s, self.token_s[1:]))
        return RequestRecord(base.request_id, base.prompt_len, base.output_len, scheduled_s=sent, send_s=sent,
                             status="ok", ttft_s=self.token_s[0] - self.arrival_s, e2e_s=self.end_s - self.arrival_s,
                             itl_s=gaps, output_tokens=len(self.token_s))
