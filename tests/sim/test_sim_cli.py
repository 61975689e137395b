"""`kvbaton sim run` end to end through the CLI: a profile or a roofline as the step cost, a synthetic load or a
recorded bench trace as the input, the bench's report and result file as the output; bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbaton.cli import main
from kvbaton.sim.latency import StepShape
from kvbaton.sim.profiled import ProfiledLatency, ProfileSample
from kvbaton.workload.records import RequestRecord

LOAD = ["--dataset", "mixed", "--num-prompts", "40", "--long-fraction", "0.2", "--long-input-len", "512",
        "--short-input-len", "64", "--output-len", "16", "--seed", "5"]


def write_profile(path: Path) -> Path:
    """A profile as `kvbaton sim profile` writes it, fitted to made-up steps (8 ms + 0.2 ms per token)."""
    shapes = [StepShape(prefill_tokens=p, prefill_seqs=1, prefill_attended=p * (p + 1) // 2) for p in (16, 64, 256)]
    shapes += [StepShape(decode_seqs=d, decode_context=d * 300) for d in (1, 4, 16, 32)]
    samples = [ProfileSample(s, 0.008 + 0.0002 * s.num_tokens + 1e-8 * s.decode_context) for s in shapes]
    model = ProfiledLatency.fit(samples)
    path.write_text(json.dumps({"model": "made-up", "dtype": "bfloat16", "threads": 2,
                                "latency_model": model.to_dict()}))
    return path


def test_sim_run_with_a_profile_writes_the_bench_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = write_profile(tmp_path / "profile.json")
    out = tmp_path / "sim.json"
    rc = main(["sim", "run", "--profile", str(profile), "--num-blocks", "2000", "--kv-bytes-per-token", "23040",
               "--prefill", "1", "--decode", "1", "--local-prefill-threshold", "256", *LOAD,
               "--request-rates", "1,4", "--slo-tpot-ms", "100", "--result-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "TPOT" in text and "prefill-0" in text and "disaggregated 8" in text
    doc = json.loads(out.read_text())
    assert doc["config"]["simulated"] and [r["request_rate"] for r in doc["runs"]] == [1.0, 4.0]
    records = [RequestRecord.from_dict(r) for r in doc["runs"][0]["records"]]
    assert len(records) == 40 and all(r.ok and r.output_tokens == 16 for r in records)


def test_sim_run_replays_a_bench_trace_with_a_roofline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = tmp_path / "first.json"
    assert main(["sim", "run", "--hardware", "h100-sxm", "--model-preset", "llama-3-8b", "--num-blocks", "20000",
                 *LOAD, "--request-rate", "2", "--result-json", str(first)]) == 0
    replayed = tmp_path / "replayed.json"
    assert main(["sim", "run", "--hardware", "h100-sxm", "--model-preset", "llama-3-8b", "--num-blocks", "20000",
                 "--trace", str(first), "--result-json", str(replayed)]) == 0
    a, b = (json.loads(p.read_text())["runs"][0]["records"] for p in (first, replayed))
    assert [(r["send_s"], r["prompt_len"], r["output_tokens"]) for r in a] == \
        [(r["send_s"], r["prompt_len"], r["output_tokens"]) for r in b]


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-blocks", "100"], "choose one step-latency model"),
    (["--profile", "/nonexistent.json", "--num-blocks", "100"], "cannot read step profile"),
    (["--hardware", "h100-sxm", "--num-blocks", "100"], "needs --model-preset"),
    (["--hardware", "tpu-v9", "--model-preset", "llama-3-8b", "--num-blocks", "100"], "tpu-v9"),
    (["--hardware", "h100-sxm", "--model-preset", "llama-3-8b", "--num-blocks", "100", "--link", "carrier-pigeon"],
     "unknown link"),
    (["--hardware", "h100-sxm", "--model-preset", "llama-3-8b", "--num-blocks", "100", "--trace", "/nonexistent"],
     "not a `kvbaton bench serve --result-json` file"),
    (["--hardware", "h100-sxm", "--model-preset", "llama-3-8b", "--num-blocks", "100", "--max-concurrency", "4"],
     "not simulated"),
])
def test_bad_input_is_one_line_and_status_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "run", *argv, "--num-prompts", "4"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
