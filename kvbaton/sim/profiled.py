"""A step-latency model fitted to this machine's measured engine steps (`kvbaton sim profile`).

    seconds = c0 + c_tok·N + Σ_k c_k·max(0, N − k) + Σ_j d_j·[N > j] + c_pseq·prefill_seqs
              + c_att·prefill_attended + c_dseq·decode_seqs + c_ctx·decode_context,
    N = prefill_tokens + decode_seqs

Why this form, on a CPU engine: every step reads all the weights once, so a small batch costs about
the same as one sequence (c0); past a knee `k` the linears are compute-bound and each token costs more
(the hinge terms, convex like max(memory, compute)); where the linears switch kernels (a few-rows dot
kernel up to `j` rows, then oneDNN) the cost jumps (the step terms: on an AVX512-BF16 EPYC a decode
step of 8 sequences took twice one of 4); attention costs what it reads (decode_context) or computes
(prefill_attended). Where the price per token is not convex in N, the segmented form replaces the
hinges with a slope per segment between knots (Σ_i s_i·|[k_i, k_i+1) ∩ [0, N)|). Every coefficient is
fitted non-negative, which makes every form non-decreasing in every field of the shape, as
`StepLatencyModel` asks.

The form (knots, jump, segmented or not) is chosen by held-out error (k-fold over the profile's grid
points); the fit minimizes *relative* error, since steps span tens of milliseconds to seconds and the
error that matters to a simulation is a percentage.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbaton.config import ConfigError
from kvbaton.sched.outputs import ScheduledRequest
from kvbaton.sim.latency import StepShape

# Where the hinge may go: the knees a CPU engine shows are where its linears change kernels or leave
# the memory-bound regime (kvbaton.platform.compute: 1 row, 8 rows, 512 rows on the amx path).
KNOT_CANDIDATES = (8, 32, 64, 128, 256, 512, 1024)
# Where a jump may go: the few-rows kernels' row limits (kvbaton.platform.compute: 1 on amx, 4 with
# AVX512-BF16 alone, 8 on avx2); one jump at most, a cost step N > j.
JUMP_CANDIDATES = (1, 4, 8)
# The segmented form: a slope of its own between each pair of these (monotone, not convex). An EPYC without
# AMX prefills 128-256 tokens at a higher price per token than 512-1024 (oneDNN's blocking), which no
# convex hinge can follow.
SEGMENT_KNOTS = (4, 16, 64, 128, 256, 512, 1024)
MAX_FOLDS = 5
IRLS_ROUNDS = 8
IRLS_FLOOR = 0.01  # relative errors below 1% weigh as 1%: an exact fit keeps finite weights
# Held-out mean errors this close count as equal, and the form with fewer knots wins.
TIE_APE = 0.002


class ProfileError(ConfigError):
    """A step profile that cannot be read, or samples that cannot be fitted."""


@dataclass(frozen=True)
class ProfileSample:
    shape: StepShape
    seconds: float


@dataclass(frozen=True, kw_only=True)
class FitError:
    """Absolute percentage errors (0.05 = 5%) on held-out samples: each fold predicted by a fit to the others."""

    form: str
    median_ape: float
    p90_ape: float
    mean_ape: float  # what the form is chosen by: a median alone would not see a misfit minority of shapes
    num_samples: int
    num_folds: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class ProfiledLatency:
    """The fitted model; `fit_error` is the chosen form's held-out error, `forms_tried` every candidate's."""

    intercept: float
    per_token: float
    knots: tuple[int, ...] = ()
    per_token_past_knot: tuple[float, ...] = ()  # slope added past each knot
    jumps: tuple[int, ...] = ()
    per_step_past_jump: tuple[float, ...] = ()  # seconds added once N exceeds each jump
    # Segmented: `per_token` prices the tokens up to the first knot, `per_token_past_knot[i]` those between knot
    # i and the next (not added to the slopes before it, as the hinges are).
    segmented: bool = False
    per_prefill_seq: float = 0.0
    per_prefill_attended: float = 0.0
    per_decode_seq: float = 0.0
    per_decode_context: float = 0.0
    label: str = ""
    fit_error: FitError | None = None
    forms_tried: tuple[FitError, ...] = ()

    def __post_init__(self) -> None:
        values = (self.intercept, self.per_token, *self.per_token_past_knot, *self.per_step_past_jump,
                  self.per_prefill_seq, self.per_prefill_attended, self.per_decode_seq, self.per_decode_context)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ProfileError("step-latency coefficients must be finite and non-negative")
        if self.intercept + self.per_token <= 0:  # a one-token step must cost something
            raise ProfileError("step-latency model gives a one-token step no cost")
        if len(self.knots) != len(self.per_token_past_knot) or any(k < 1 for k in self.knots):
            raise ProfileError("step-latency knots must be positive, one slope each")
        if len(self.jumps) != len(self.per_step_past_jump) or any(j < 1 for j in self.jumps):
            raise ProfileError("step-latency jumps must be positive, one step each")
        if self.segmented and not self.knots:
            raise ProfileError("a segmented step-latency model needs its segments' knots")

    @property
    def name(self) -> str:
        return f"profiled({self.label})" if self.label else "profiled"

    @property
    def form(self) -> str:
        return _form_name(Form(self.knots, self.jumps, self.segmented))

    def step_seconds(self, shape: StepShape) -> float:
        if shape.is_empty:
            return 0.0
        n = shape.num_tokens
        # NOTE: plain floats, not numpy: the simulator calls this once per simulated step.
        return (self.intercept + _token_cost(n, self.knots, self.per_token, self.per_token_past_knot, self.segmented)
                + sum(c for j, c in zip(self.jumps, self.per_step_past_jump) if n > j)
                + self.per_prefill_seq * shape.prefill_seqs + self.per_prefill_attended * shape.prefill_attended
                + self.per_decode_seq * shape.decode_seqs + self.per_decode_context * shape.decode_context)

    # ---- fitting -------------------------------------------------------------------------------

    @classmethod
    def fit(cls, samples: Sequence[ProfileSample], label: str = "") -> ProfiledLatency:
        """The form (knots, jump, segmented or not) with the least held-out error, refitted on every sample."""
        samples = _checked(samples)
        candidates = _candidate_forms(samples)
        tried = [_held_out_error(samples, form) for form in candidates]
        best = _simplest_best(candidates, tried)
        return cls._of(_solve(samples, candidates[best]), candidates[best], label, tried[best], tuple(tried))

    @classmethod
    def fit_form(cls, samples: Sequence[ProfileSample], knots: tuple[int, ...] = (), jumps: tuple[int, ...] = (),
                 label: str = "") -> ProfiledLatency:
        """The model of the given knots and jumps, fitted on every sample."""
        samples = _checked(samples)
        form = Form(knots, jumps)
        return cls._of(_solve(samples, form), form, label, _held_out_error(samples, form))

    @classmethod
    def _of(cls, c: np.ndarray, form: Form, label: str, error: FitError | None,
            tried: tuple[FitError, ...] = ()) -> ProfiledLatency:
        k, j = len(form.knots), len(form.jumps)
        rest = c[2 + k + j:]
        return cls(intercept=float(c[0]), per_token=float(c[1]), knots=form.knots, segmented=form.segmented,
                   per_token_past_knot=tuple(float(v) for v in c[2:2 + k]), jumps=form.jumps,
                   per_step_past_jump=tuple(float(v) for v in c[2 + k:2 + k + j]), per_prefill_seq=float(rest[0]),
                   per_prefill_attended=float(rest[1]), per_decode_seq=float(rest[2]),
                   per_decode_context=float(rest[3]), label=label, fit_error=error, forms_tried=tried)

    # ---- the JSON profile ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "form": self.form, "knots": list(self.knots), "jumps": list(self.jumps), "segmented": self.segmented,
            "coefficients": {"intercept_s": self.intercept, "per_token_s": self.per_token,
                             "per_token_past_knot_s": list(self.per_token_past_knot),
                             "per_step_past_jump_s": list(self.per_step_past_jump),
                             "per_prefill_seq_s": self.per_prefill_seq,
                             "per_prefill_attended_s": self.per_prefill_attended,
                             "per_decode_seq_s": self.per_decode_seq,
                             "per_decode_context_s": self.per_decode_context},
            "fit_error": self.fit_error.to_dict() if self.fit_error else None,
            "forms_tried": [e.to_dict() for e in self.forms_tried],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], label: str = "") -> ProfiledLatency:
        c = d["coefficients"]
        error = d.get("fit_error")
        return cls(intercept=float(c["intercept_s"]), per_token=float(c["per_token_s"]),
                   knots=tuple(int(k) for k in d["knots"]),
                   per_token_past_knot=tuple(float(v) for v in c["per_token_past_knot_s"]),
                   jumps=tuple(int(j) for j in d.get("jumps", ())),  # profiles before jumps have none
                   segmented=bool(d.get("segmented", False)),
                   per_step_past_jump=tuple(float(v) for v in c.get("per_step_past_jump_s", ())),
                   per_prefill_seq=float(c["per_prefill_seq_s"]),
                   per_prefill_attended=float(c["per_prefill_attended_s"]),
                   per_decode_seq=float(c["per_decode_seq_s"]), per_decode_context=float(c["per_decode_context_s"]),
                   label=label, fit_error=FitError(**error) if error else None,
                   forms_tried=tuple(FitError(**e) for e in d.get("forms_tried", ())))

    @classmethod
    def load(cls, path: str | Path) -> ProfiledLatency:
        """The model of a profile written by `kvbaton sim profile`; ProfileError if it is not one."""
        try:
            profile = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(f"cannot read step profile {path}: {exc.strerror or exc}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProfileError(f"{path} is not a step profile (not JSON: {exc})") from exc
        try:
            label = f"{profile['model']}, {profile['dtype']}, {profile['threads']} threads"
            return cls.from_dict(profile["latency_model"], label)
        except ProfileError as exc:
            raise ProfileError(f"{path}: {exc}") from exc
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"{path} is not a step profile (bad or missing {exc})") from exc


def refit_profile(path: str | Path, out: str | Path | None = None) -> ProfiledLatency:
    """Fit a `kvbaton sim profile` file's measured samples again with today's model forms, without measuring
    again; the file (or `out`) keeps everything else it says. ProfileError if it holds no samples."""
    try:
        profile = json.loads(Path(path).read_text())
        samples = [ProfileSample(StepShape(**s["shape"]), float(s["seconds"])) for s in profile["samples"]]
        label = f"{profile['model']}, {profile['dtype']}, {profile['threads']} threads"
    except OSError as exc:
        raise ProfileError(f"cannot read step profile {path}: {exc.strerror or exc}") from exc
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProfileError(f"{path} is not a step profile with samples (bad or missing {exc})") from exc
    model = ProfiledLatency.fit(samples, label)
    profile["latency_model"] = model.to_dict()
    Path(out or path).write_text(json.dumps(profile, indent=1) + "\n")
    return model


class ProfileFit:
    """The simulator's side of `kvbaton sim profile`, handed to the engine's profiler (which may not import
    the simulator): what a cost model sees of a step, and the fit of the measured steps."""

    @staticmethod
    def shape(scheduled: Iterable[ScheduledRequest]) -> dict[str, int]:
        return dataclasses.asdict(StepShape.of(scheduled))

    @staticmethod
    def fit(samples: Sequence[tuple[Mapping[str, int], float]], label: str = "") -> dict[str, Any]:
        return ProfiledLatency.fit([ProfileSample(StepShape(**s), t) for s, t in samples], label).to_dict()


# ---- least squares --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Form:
    """Which hinge and jump terms a fit has."""

    knots: tuple[int, ...] = ()
    jumps: tuple[int, ...] = ()
    segmented: bool = False


def _token_cost(n: int, knots: Sequence[int], first: float, slopes: Sequence[float], segmented: bool) -> float:
    if not segmented:
        return first * n + sum(c * max(0, n - k) for k, c in zip(knots, slopes))
    ends = (*knots[1:], math.inf)
    return first * min(n, knots[0]) + sum(c * max(0.0, min(n, end) - k) for k, end, c in zip(knots, ends, slopes))


def _form_name(form: Form) -> str:
    if form.segmented:
        name = "segments@" + ",".join(map(str, form.knots))
    else:
        name = "linear" if not form.knots else "hinge@" + ",".join(map(str, form.knots))
    return name + "".join(f"+jump@{j}" for j in form.jumps)


def _checked(samples: Sequence[ProfileSample]) -> list[ProfileSample]:
    kept = [s for s in samples if not s.shape.is_empty]
    if not kept or any(not (math.isfinite(s.seconds) and s.seconds > 0) for s in kept):
        raise ProfileError("a step-latency fit needs samples of non-empty steps with positive seconds")
    return kept


def _candidate_forms(samples: Sequence[ProfileSample]) -> list[Form]:
    """No knot, one or two knots inside the sampled token range, or every such knot at once; each with no jump
    or one jump that samples lie on both sides of."""
    tokens = [s.shape.num_tokens for s in samples]
    inside = tuple(k for k in KNOT_CANDIDATES if min(tokens) <= k < max(tokens))
    pairs = list(itertools.combinations(inside, 2)) if len(inside) > 2 else []
    knot_sets = [(), *((k,) for k in inside), *pairs, *([inside] if len(inside) > 1 else [])]
    jumps = [(), *((j,) for j in JUMP_CANDIDATES if min(tokens) <= j < max(tokens))]
    segments = tuple(k for k in SEGMENT_KNOTS if min(tokens) <= k < max(tokens))
    segmented = [Form(segments, jump, segmented=True) for jump in jumps] if segments else []
    return [Form(knots, jump) for jump in jumps for knots in knot_sets] + segmented


def _simplest_best(candidates: list[Form], tried: list[FitError]) -> int:
    """The candidate of least held-out mean error, or one of fewer knots within TIE_APE of it (no
    held-out error, with too few samples: the linear form)."""
    if any(math.isnan(e.mean_ape) for e in tried):
        return 0
    least = min(e.mean_ape for e in tried)
    return min((i for i, e in enumerate(tried) if e.mean_ape <= least + TIE_APE),
               key=lambda i: (len(candidates[i].knots) + len(candidates[i].jumps), tried[i].mean_ape))


def _features(shape: StepShape, form: Form) -> list[float]:
    n = shape.num_tokens
    if form.segmented:
        ends = (*form.knots[1:], math.inf)
        tokens = [min(n, form.knots[0]), *(max(0.0, min(n, end) - k) for k, end in zip(form.knots, ends))]
    else:
        tokens = [n, *(max(0, n - k) for k in form.knots)]
    return [1.0, *tokens, *(float(n > j) for j in form.jumps), shape.prefill_seqs, shape.prefill_attended,
            shape.decode_seqs, shape.decode_context]


def _solve(samples: Sequence[ProfileSample], form: Form) -> np.ndarray:
    """Non-negative coefficients minimizing the sum of absolute relative errors over `samples`.

    NOTE: absolute, not squared (least squares reweighted by 1/sqrt|error|, IRLS): a burst of load from
    elsewhere on the machine makes a few samples far too slow, and squares would let them pull the
    fit off every other shape."""
    seconds = np.array([s.seconds for s in samples])
    a = np.array([_features(s.shape, form) for s in samples]) / seconds[:, None]  # rows: relative error
    c = _irls(a)
    # NOTE: a short served trace (steps that all batch the same sequences, attention growing with each) lets the
    # per-sequence and attention prices stand in for the fixed cost, and a one-token step would cost nothing. Fit
    # again with fewer stand-ins until one prices it: without the per-sequence terms, then with only the token
    # terms, then the intercept alone (which prices every step above zero as long as any step took time).
    for dropped in _stand_ins(form, len(a[0])):
        if c[0] + c[1] > 0:
            break
        a[:, dropped] = 0.0
        c = _irls(a)
    return c


def _stand_ins(form: Form, num_features: int) -> tuple[list[int], ...]:
    """Columns to drop, cumulatively, when a fit prices a one-token step at nothing (see `_solve`)."""
    per_seq = [num_features - 4, num_features - 2]  # prefill_seqs, decode_seqs
    past_token = list(range(2 + len(form.knots), num_features))  # jumps, attention, per-sequence
    return per_seq, past_token, list(range(1, num_features))


def _irls(a: np.ndarray) -> np.ndarray:
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0  # a feature no sample has: its coefficient stays 0
    a = a / scale
    weights = np.ones(len(a))
    for _ in range(IRLS_ROUNDS):
        c = nnls(a * weights[:, None], weights)
        weights = 1.0 / np.sqrt(np.maximum(np.abs(a @ c - 1.0), IRLS_FLOOR))
    return c / scale


def _held_out_error(samples: Sequence[ProfileSample], form: Form) -> FitError:
    """k-fold: fold i is every k-th sample from i (the grid's order, so each fold spans the grid)."""
    folds = min(MAX_FOLDS, len(samples))
    errors: list[float] = []
    for i in range(folds if folds > 1 else 0):
        train = [s for j, s in enumerate(samples) if j % folds != i]
        c = _solve(train, form)
        errors += [abs(float(np.dot(c, _features(s.shape, form))) / s.seconds - 1.0)
                   for j, s in enumerate(samples) if j % folds == i]
    if not errors:
        return FitError(form=_form_name(form), median_ape=math.nan, p90_ape=math.nan, mean_ape=math.nan,
                        num_samples=len(samples), num_folds=0)
    return FitError(form=_form_name(form), median_ape=float(np.median(errors)),
                    p90_ape=float(np.quantile(errors, 0.9)), mean_ape=float(np.mean(errors)),
                    num_samples=len(samples), num_folds=folds)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ‖a·x − b‖ subject to x ≥ 0: Lawson and Hanson's active-set method.

    Variables enter the passive (free) set by the largest gradient; an unconstrained solve over
    that set that goes negative is walked back to the boundary, where the blocking variable leaves."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(a.shape) * max(float(np.abs(a).sum(axis=0).max()), 1.0)
    for _ in range(3 * n + 10):  # NOTE: the method terminates in theory; the cap guards rounding cycles
        gradient = a.T @ (b - a @ x)
        entering = ~passive & (gradient > tol)
        if not entering.any():
            break
        passive[int(np.argmax(np.where(entering, gradient, -np.inf)))] = True
        x, passive = _walk_back(a, b, x, passive)
    return x


def _walk_back(a: np.ndarray, b: np.ndarray, x: np.ndarray, passive: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Solve over the passive set, stepping back towards `x` (and shrinking the set) until the solution is
    non-negative."""
    for _ in range(len(x) + 1):
        z = np.zeros_like(x)
        z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
        if (z[passive] > 0).all():
            return z, passive
        blocking = passive & (z <= 0)
        alpha = float(np.min(x[blocking] / (x[blocking] - z[blocking])))
        x = x + alpha * (z - x)
        passive = passive & (x > 0)
        x[~passive] = 0.0
    return x, passive
