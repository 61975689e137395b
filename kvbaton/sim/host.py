"""What the serving stack around the engines costs: the frontend's path to a worker, and its CPU per token.

A step profile times the engine alone. A served request also crosses the HTTP frontend and the
router (tokenize, admit, route, IPC to the worker, the first chunk streamed back), and every token
it generates is detokenized, framed and streamed. On a GPU cluster that work runs on host cores the
GPUs do not need, so it shows only as a fixed delay before the first token. On a CPU host it runs
on the very cores the workers compute on, so each streamed token's frontend CPU also lengthens the
step that produced it; the more tokens per second, the larger the share (the simulator's TPOT read
26% low at 1.5 req/s on a 2-core machine without it). Only while the busy workers' threads fill every
core, though: a 1P+1D pair of 1-thread workers on 2 cores leaves the frontend a core whenever the
prefill worker is idle, and its decode steps then pay nothing (`host_cores`).

Neither figure comes from first principles: `kvbaton sim calibrate` fits both to one measured run
(`kvbaton.sim.calibrate`), and validation then uses other loads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kvbaton.config import ConfigError


@dataclass(frozen=True, kw_only=True)
class HostOverhead:
    dispatch_s: float = 0.0  # from a request's arrival to its worker's queue (and the first chunk back)
    per_token_s: float = 0.0  # frontend CPU per streamed token, taken from the step that sampled it
    # The cores the workers share with the frontend (0: the price is always paid). With N, a step pays it only
    # while the busy instances' `InstanceSpec.cpu_threads` add up to N or more: no core is left idle.
    host_cores: int = 0
    calibrated_on: str = ""  # what run the figures were fitted to, for the reader of a report

    def __post_init__(self) -> None:
        if not (0.0 <= self.dispatch_s < 60.0 and 0.0 <= self.per_token_s < 1.0 and 0 <= self.host_cores <= 4096):
            raise ConfigError("host overhead: dispatch must be in [0, 60) s, per-token cost in [0, 1) s and host "
                              "cores in [0, 4096]")

    @property
    def is_zero(self) -> bool:
        return self.dispatch_s == 0.0 and self.per_token_s == 0.0

    def step_extra_s(self, num_sampled: int, busy_threads: int) -> float:
        """What the frontend's work on this step's streamed tokens adds to the step, `busy_threads` being the
        threads of every instance computing now (this one included): nothing while a core is idle."""
        if self.host_cores and busy_threads < self.host_cores:
            return 0.0
        return self.per_token_s * num_sampled

    def describe(self) -> str:
        shared = f" while {self.host_cores} cores are busy" if self.host_cores else ""
        return f"dispatch {self.dispatch_s * 1e3:.1f} ms, {self.per_token_s * 1e3:.2f} ms per streamed token{shared}"

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HostOverhead:
        """A `kvbaton sim calibrate --out` file; a clear ConfigError for anything else."""
        try:
            doc = json.loads(Path(path).read_text())
            return cls(dispatch_s=float(doc["dispatch_s"]), per_token_s=float(doc["per_token_s"]),
                       host_cores=int(doc.get("host_cores", 0)), calibrated_on=str(doc.get("calibrated_on", "")))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: not a host-overhead file from `kvbaton sim calibrate` ({exc})") from exc
