"""What the load generator remembers about each request it sent."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# `rejected`: the server refused it (HTTP 429 / 503), i.e. admission control, not a crash.
# `cancelled`: still in flight when --max-duration-s ran out; left out of every latency metric.
STATUSES = ("ok", "error", "rejected", "cancelled")
REJECT_HTTP_STATUSES = (429, 503)


@dataclass(frozen=True)
class RequestRecord:
    """Timings of one request, in seconds; `*_s` times are relative to the start of its run."""

    request_id: int
    prompt_len: int  # the server's usage.prompt_tokens when reported, else the dataset's length
    output_len: int  # max_tokens asked for
    scheduled_s: float  # when the arrival process wanted it sent
    send_s: float  # when it was sent (later than scheduled_s if --max-concurrency held it back)
    status: str
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: tuple[float, ...] = ()  # gaps between consecutive content chunks
    output_tokens: int = 0  # usage.completion_tokens when reported, else the number of content chunks
    http_status: int | None = None
    error: str = ""
    attempts: int = 1

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for requests with fewer than two tokens."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "itl_s": list(self.itl_s), "tpot_s": self.tpot_s}

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**{**fields, "itl_s": tuple(fields.get("itl_s", ()))})


@dataclass(frozen=True)
class RunResult:
    """Everything one load level produced."""

    request_rate: float
    max_concurrency: int | None
    duration_s: float  # from the first send to the last completion (or the deadline)
    num_planned: int  # requests in the dataset; more than len(records) if the deadline hit first
    records: tuple[RequestRecord, ...]
