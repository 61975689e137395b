"""`kvbaton sim profile --quick` on a tiny random checkpoint: the JSON's samples are the grid's shapes,
and its fitted model predicts them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbaton.cli import main
from kvbaton.engine.step_profile import PROFILE_FORMAT, QUICK_GRID
from kvbaton.sim.latency import StepShape
from kvbaton.sim.profiled import ProfiledLatency
from tests.support.helpers import build_tiny_checkpoint


def expected_shape(point: dict[str, int]) -> dict[str, int]:
    p, c, d, ctx = (point[k] for k in ("prefill_tokens", "prefill_cached", "decode_seqs", "decode_context"))
    return {"prefill_tokens": p, "prefill_seqs": int(p > 0), "prefill_attended": p * c + p * (p + 1) // 2,
            "decode_seqs": d, "decode_context": d * ctx}


@pytest.fixture(scope="module")
def quick_profile(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("profile")
    model = build_tiny_checkpoint("llama", root / "tiny")
    out = root / "profile.json"
    assert main(["sim", "profile", "--model", str(model), "--threads", "1", "--kv-cache-memory-gb", "0.05",
                 "--quick", "--out", str(out)]) == 0
    return json.loads(out.read_text()), out


def test_samples_are_the_grid_as_scheduled(quick_profile: tuple[dict, Path]) -> None:
    profile, _ = quick_profile
    assert profile["format"] == PROFILE_FORMAT and profile["threads"] == 1 and profile["dtype"] == "bfloat16"
    assert profile["cpu"]["model_name"] is not None and profile["compute_path"]
    points = [dict(s["point"]) for s in profile["samples"]]
    assert points == [vars(p) for p in QUICK_GRID.points()]
    for s in profile["samples"]:
        assert s["shape"] == expected_shape(s["point"]), s["point"]
        assert s["seconds"] > 0 and len(s["repeats"]) == QUICK_GRID.repeats


def test_its_fit_predicts_its_own_samples(quick_profile: tuple[dict, Path]) -> None:
    profile, path = quick_profile
    model = ProfiledLatency.load(path)
    assert model.name.startswith("profiled(tiny")
    assert model.fit_error is not None and model.fit_error.num_samples == len(profile["samples"])
    for s in profile["samples"]:
        # loose: a tiny model's steps are ~1 ms, where the scheduler's and Python's noise is large
        assert model.step_seconds(StepShape(**s["shape"])) == pytest.approx(s["seconds"], rel=1.0)


def test_a_bad_out_dir_is_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "profile", "--quick", "--out", str(tmp_path / "missing" / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no directory" in err
