"""--step-trace: every engine step's shape and seconds, and `kvbaton sim fit-steps` on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbaton.cli import main
from kvbaton.engine.llm import LLM
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.sched.step_trace import TRACE_FORMAT, StepTrace
from kvbaton.sim.latency import StepShape
from kvbaton.sim.profiled import ProfiledLatency

PROMPTS = [list(range(start, start + n)) for start, n in ((3, 9), (20, 17), (40, 30))]  # no shared prefix
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def traced(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trace")
    llm = LLM(str(tiny_models["llama"]), dtype="float32", num_threads=1, block_size=4, step_trace_dir=str(out))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    llm.engine.core.close()
    return out


def steps_of(directory: Path) -> tuple[dict, list[dict]]:
    (path,) = directory.glob("steps-*.jsonl")
    header, *lines = (json.loads(line) for line in path.read_text().splitlines())
    return header, lines


def test_every_step_is_traced_with_the_shape_it_ran(traced: Path) -> None:
    header, steps = steps_of(traced)
    assert header["format"] == TRACE_FORMAT and header["threads"] == 1 and header["dtype"] == "float32"
    assert header["role"] == "both"  # an engine of its own: it prefills and decodes
    assert header["block_size"] == 4 and header["num_blocks"] > 0 and header["compute_path"]
    shapes = [StepShape(**s["shape"]) for s in steps]
    assert all(s["seconds"] > 0 for s in steps) and not any(shape.is_empty for shape in shapes)
    # every prompt token prefilled once, every output token past the first decoded once
    assert sum(s.prefill_tokens for s in shapes) == sum(map(len, PROMPTS))
    assert sum(s.decode_seqs for s in shapes) == len(PROMPTS) * (MAX_TOKENS - 1)
    assert sum(s.prefill_attended for s in shapes) == sum(n * (n + 1) // 2 for n in map(len, PROMPTS))


def test_fit_steps_writes_a_profile_the_simulator_loads(traced: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "served.json"
    assert main(["sim", "fit-steps", str(traced), "--out", str(out), "--compare", str(out.with_name("x"))]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # the profile to compare with is missing: one line
    assert main(["sim", "fit-steps", str(traced), "--out", str(out)]) == 0
    profile = json.loads(out.read_text())
    _, steps = steps_of(traced)
    assert profile["source"]["steps"] == len(steps) and sum(s["steps"] for s in profile["samples"]) == len(steps)
    model = ProfiledLatency.load(out)
    assert model.name == "profiled(llama, float32, 1 threads)"
    assert main(["sim", "fit-steps", str(traced), "--compare", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "decode" in printed and "prefill" in printed
    assert main(["sim", "run", "--profile", str(out), "--num-prompts", "5", "--input-len", "20", "--output-len",
                 "4"]) == 0


def test_a_file_that_is_not_a_trace_is_one_line_and_status_2(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "steps-1.jsonl"
    bad.write_text('{"format": "something else"}\n')
    assert main(["sim", "fit-steps", str(bad), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a step trace" in err
    assert main(["sim", "fit-steps", str(tmp_path / "empty-dir-missing"), "--out", str(tmp_path / "p.json")]) == 2


def test_a_truncated_line_is_skipped_and_the_cap_stops_the_file(tmp_path: Path) -> None:
    trace = StepTrace(tmp_path / "steps-7.jsonl", {"model": "m"}, max_steps=3)
    for n in range(1, 6):
        trace.record(StepShape(decode_seqs=n, decode_context=10 * n), 0.01 * n)
    trace.close()
    lines = (tmp_path / "steps-7.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 3  # the header, then the cap
    with (tmp_path / "steps-7.jsonl").open("a") as f:
        f.write('{"t": 1, "seconds": 0.0')  # a worker killed mid-line
    from kvbaton.sim.served_steps import read_traces

    traced = read_traces([tmp_path])
    assert len(traced.steps) == 3 and traced.lines_skipped == 1


def test_an_unwritable_trace_directory_is_the_command_lines_error(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["generate", "--step-trace", str(blocker / "sub"), "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--step-trace" in err


def test_the_engine_times_decode_only_and_mixed_steps_as_its_trace_does(tiny_models: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """stats().decode_steps (what the autoscaler weighs local prefills by) counts the traced steps that decoded:
    with no prompt tokens, and with some (a prompt arriving while another request decodes)."""
    llm = LLM(str(tiny_models["llama"]), dtype="float32", num_threads=1, block_size=4, step_trace_dir=str(tmp_path))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    engine = llm.engine
    engine.add_request("first", {"prompt_token_ids": PROMPTS[0]}, params)
    engine.step()  # its prompt
    engine.add_request("second", {"prompt_token_ids": PROMPTS[1]}, params)
    while engine.has_unfinished_requests():
        engine.step()
    times = engine.stats().decode_steps
    engine.core.close()
    _, steps = steps_of(tmp_path)
    by_kind = {kind: [s["seconds"] for s in steps if StepShape(**s["shape"]).kind == kind]
               for kind in ("decode", "mixed")}
    assert times.mixed_steps == len(by_kind["mixed"]) >= 1 and times.decode_only_steps == len(by_kind["decode"]) >= 1
    assert times.mixed_s == pytest.approx(sum(by_kind["mixed"])) and times.decode_only_s == pytest.approx(
        sum(by_kind["decode"]))
    assert 0.0 <= times.prefill_share < 1.0
