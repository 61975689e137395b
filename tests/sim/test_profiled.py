"""The profiled step-latency model: its fit recovers known costs, it keeps the latency contract, and
its JSON round-trips (or fails with one clear line). No torch here."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path

import numpy as np
import pytest

from kvbaton.sim.latency import StepShape
from kvbaton.sim.profiled import ProfiledLatency, ProfileError, ProfileFit, ProfileSample, nnls

# A CPU-like engine: ~25 ms a step for the weights, ~0.1 ms a token, 0.7 ms a token more past 512.
TRUE = ProfiledLatency(intercept=0.025, per_token=1e-4, knots=(512,), per_token_past_knot=(7e-4,),
                       per_prefill_seq=2e-4, per_prefill_attended=2e-9, per_decode_seq=3e-4, per_decode_context=4e-7)


def shape(prefill: int = 0, cached: int = 0, decodes: int = 0, context: int = 0) -> StepShape:
    attended = prefill * cached + prefill * (prefill + 1) // 2
    return StepShape(prefill_tokens=prefill, prefill_seqs=int(prefill > 0), prefill_attended=attended,
                     decode_seqs=decodes, decode_context=decodes * context)


def grid_shapes() -> list[StepShape]:
    """The shapes of `kvbaton sim profile`'s default grid."""
    decode = [shape(decodes=d, context=c) for c, d in itertools.product((128, 512, 1024, 2048), (1, 2, 4, 8, 16, 32))]
    prefill = [shape(prefill=p, cached=c) for c, p in itertools.product((0, 512, 1024), (16, 64, 256, 512, 1024, 2048))]
    mixed = [shape(prefill=p, decodes=d, context=1024) for d, p in itertools.product((4, 16, 32), (16, 64, 256, 1024))]
    return decode + prefill + mixed


def samples_of(model: ProfiledLatency, noise: float = 0.0, seed: int = 0) -> list[ProfileSample]:
    rng = random.Random(seed)
    return [ProfileSample(s, model.step_seconds(s) * (1 + rng.uniform(-noise, noise))) for s in grid_shapes()]


def coefficients(m: ProfiledLatency) -> list[float]:
    return [m.intercept, m.per_token, *m.per_token_past_knot, m.per_prefill_seq, m.per_prefill_attended,
            m.per_decode_seq, m.per_decode_context]


def test_fit_recovers_known_coefficients_and_knot() -> None:
    fitted = ProfiledLatency.fit(samples_of(TRUE))
    assert fitted.knots == TRUE.knots
    assert coefficients(fitted) == pytest.approx(coefficients(TRUE), rel=1e-6, abs=1e-12)
    assert fitted.fit_error is not None and fitted.fit_error.median_ape < 1e-6
    assert {e.form for e in fitted.forms_tried} >= {"linear", "hinge@512"}


def test_fit_under_noise_predicts_held_out_shapes_within_the_noise() -> None:
    fitted = ProfiledLatency.fit(samples_of(TRUE, noise=0.03))
    assert fitted.fit_error is not None and fitted.fit_error.median_ape < 0.03
    for s in grid_shapes():
        assert fitted.step_seconds(s) == pytest.approx(TRUE.step_seconds(s), rel=0.08)


def test_a_linear_engine_gets_the_linear_form() -> None:
    linear = dataclasses.replace(TRUE, knots=(), per_token_past_knot=())
    assert ProfiledLatency.fit(samples_of(linear)).form == "linear"


def test_nnls_matches_unconstrained_where_positive_and_clamps_otherwise() -> None:
    rng = np.random.default_rng(0)
    a = rng.normal(size=(40, 5))
    x = np.array([1.0, 2.0, 0.5, 3.0, 0.25])
    assert nnls(a, a @ x) == pytest.approx(x)
    b = a @ np.array([1.0, -2.0, 0.5, 3.0, -1.0])
    got = nnls(a, b)
    assert (got >= 0).all()
    # KKT: free coefficients have zero gradient, clamped ones a gradient pointing out of the feasible set
    gradient = a.T @ (b - a @ got)
    assert gradient[got > 0] == pytest.approx(0, abs=1e-9)
    assert (gradient[got == 0] <= 1e-9).all()


def test_positive_and_monotonic_in_every_field() -> None:
    fitted = ProfiledLatency.fit(samples_of(TRUE, noise=0.05, seed=3))
    fields = [f.name for f in dataclasses.fields(StepShape)]
    rng = random.Random(1)
    for _ in range(300):
        s = StepShape(*(rng.randrange(0, 3000) for _ in fields))
        if s.is_empty:
            continue
        t = fitted.step_seconds(s)
        assert t > 0 and fitted.step_seconds(s) == t  # positive, deterministic
        for name in fields:
            assert fitted.step_seconds(dataclasses.replace(s, **{name: getattr(s, name) + rng.randrange(1, 500)})) >= t
    assert fitted.step_seconds(StepShape(decode_seqs=1, decode_context=1)) > 0
    assert fitted.step_seconds(StepShape()) == 0.0


def test_refuses_negative_coefficients_and_empty_samples() -> None:
    with pytest.raises(ProfileError):
        dataclasses.replace(TRUE, per_decode_context=-1e-9)
    with pytest.raises(ProfileError):
        ProfiledLatency.fit([ProfileSample(StepShape(), 0.01)])


def write_profile(path: Path, model: ProfiledLatency) -> Path:
    path.write_text(json.dumps({"model": "m", "dtype": "bfloat16", "threads": 2, "latency_model": model.to_dict()}))
    return path


def test_json_round_trip(tmp_path: Path) -> None:
    fitted = ProfiledLatency.fit(samples_of(TRUE, noise=0.02))
    loaded = ProfiledLatency.load(write_profile(tmp_path / "p.json", fitted))
    assert loaded == dataclasses.replace(fitted, label="m, bfloat16, 2 threads")
    assert loaded.name == "profiled(m, bfloat16, 2 threads)"
    assert [loaded.step_seconds(s) for s in grid_shapes()] == [fitted.step_seconds(s) for s in grid_shapes()]


def test_profile_fit_is_what_the_engine_profiler_calls() -> None:
    samples = [(dataclasses.asdict(s.shape), s.seconds) for s in samples_of(TRUE)]
    section = ProfileFit.fit(samples, "m")
    assert ProfiledLatency.from_dict(section).knots == (512,)
    assert section["fit_error"]["median_ape"] < 1e-6


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read step profile"),
    ("{not json", "not JSON"),
    ('{"model": "m", "dtype": "bfloat16", "threads": 2}', "missing 'latency_model'"),
    ('["a list"]', "is not a step profile"),
])
def test_missing_or_corrupt_profile_is_one_clear_error(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ProfileError, match=message) as info:
        ProfiledLatency.load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_negative_coefficient_in_a_file_names_the_file(tmp_path: Path) -> None:
    section = TRUE.to_dict()
    section["coefficients"]["per_token_s"] = -1.0
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"model": "m", "dtype": "bfloat16", "threads": 2, "latency_model": section}))
    with pytest.raises(ProfileError, match=f"{path}: .*non-negative"):
        ProfiledLatency.load(path)


# An AVX512-BF16 EPYC: the few-rows dot kernel serves up to 4 rows, then oneDNN; a step of 5+ tokens costs more.
KERNEL_SWITCH = dataclasses.replace(TRUE, jumps=(4,), per_step_past_jump=(0.015,))


def test_a_kernel_switch_is_fitted_as_a_jump() -> None:
    fitted = ProfiledLatency.fit(samples_of(KERNEL_SWITCH))
    assert fitted.form == "hinge@512+jump@4"
    assert fitted.per_step_past_jump == pytest.approx((0.015,), rel=1e-6)
    assert fitted.step_seconds(shape(decodes=5, context=100)) - fitted.step_seconds(shape(decodes=4, context=100)) \
        == pytest.approx(0.015 + 1e-4 + 3e-4 + 4e-5, rel=1e-6)
    assert ProfiledLatency.fit(samples_of(TRUE)).jumps == ()  # no switch, no jump


def test_refit_fits_a_files_samples_again_and_keeps_the_rest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) \
        -> None:
    from kvbaton.cli import main

    samples = samples_of(KERNEL_SWITCH)
    old = ProfiledLatency.fit_form(samples)  # the linear form, as a profile from before jumps holds
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"model": "m", "dtype": "bfloat16", "threads": 2, "num_blocks": 77,
                                "samples": [{"shape": dataclasses.asdict(s.shape), "seconds": s.seconds}
                                            for s in samples], "latency_model": old.to_dict()}))
    assert main(["sim", "refit", str(path)]) == 0
    assert "jump@4" in capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert doc["num_blocks"] == 77 and ProfiledLatency.load(path).jumps == (4,)
    path.write_text(json.dumps({"model": "m"}))
    assert main(["sim", "refit", str(path)]) == 2
    assert "not a step profile with samples" in capsys.readouterr().err


def test_a_profile_from_before_jumps_still_loads(tmp_path: Path) -> None:
    section = TRUE.to_dict()
    del section["jumps"], section["coefficients"]["per_step_past_jump_s"]
    assert ProfiledLatency.from_dict(section) == dataclasses.replace(TRUE, fit_error=None)


def test_a_price_per_token_that_is_not_convex_gets_the_segmented_form() -> None:
    from kvbaton.sim.profiled import SEGMENT_KNOTS

    # dearer per token from 128 to 512 than past 512: no convex hinge can follow it
    nonconvex = dataclasses.replace(TRUE, knots=SEGMENT_KNOTS, segmented=True,
                                    per_token_past_knot=(1e-4, 1e-4, 2e-4, 9e-4, 8e-4, 4e-4, 1e-3))
    fitted = ProfiledLatency.fit(samples_of(nonconvex))
    assert fitted.segmented and fitted.knots == SEGMENT_KNOTS
    for s in grid_shapes():
        assert fitted.step_seconds(s) == pytest.approx(nonconvex.step_seconds(s), rel=1e-6)
    costs = [fitted.step_seconds(shape(prefill=n)) for n in range(1, 2100, 7)]
    assert costs == sorted(costs)  # monotone all the same
    assert ProfiledLatency.from_dict(fitted.to_dict()) == dataclasses.replace(fitted, label="")


def test_steps_that_all_batch_three_sequences_still_give_a_one_token_step_a_cost() -> None:
    # a short served trace (a tiny model's, as traced): every step three sequences, so the per-sequence prices can
    # stand in for the fixed cost, and the first step slower than the later ones
    samples = [ProfileSample(StepShape(prefill_tokens=56, prefill_seqs=3, prefill_attended=663), 0.0206),
               *(ProfileSample(StepShape(decode_seqs=3, decode_context=c), t) for c, t in (
                   (59, 0.00137), (62, 0.00100), (65, 0.000887), (68, 0.000661), (71, 0.000683)))]
    model = ProfiledLatency.fit(samples)
    assert model.step_seconds(shape(decodes=1, context=10)) > 0
    assert model.step_seconds(StepShape(decode_seqs=3, decode_context=65)) == pytest.approx(0.00085, rel=0.5)


def test_steps_whose_cost_follows_attention_alone_still_give_a_one_token_step_a_cost() -> None:
    # the same trace, each decode step slower than the last: attention (decode_context, prefill_attended) can then
    # price every step exactly with no fixed cost at all (CI drew such a trace once)
    samples = [ProfileSample(StepShape(prefill_tokens=56, prefill_seqs=3, prefill_attended=1000), 0.02),
               *(ProfileSample(StepShape(decode_seqs=3, decode_context=c), 1e-5 * c) for c in range(171, 186, 3))]
    model = ProfiledLatency.fit(samples)
    assert model.intercept + model.per_token > 0
    assert model.step_seconds(StepShape(decode_seqs=3, decode_context=177)) == pytest.approx(0.00177, rel=0.5)
