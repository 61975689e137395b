"""What serving adds in the simulator (kvbaton.sim.host) and its calibration (kvbaton.sim.calibrate,
kvbaton.sim.served_steps): the dispatch delay and each role's served steps change simulated time exactly as
stated, draws are seeded, a step trace yields the ratios it was written with, a calibration recovers the
dispatch a run was made with, and `kvbaton sim calibrate` writes what `kvbaton sim run` reads."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from kvbaton.cli import main
from kvbaton.config import ConfigError, SchedulerConfig
from kvbaton.sched.step_trace import TRACE_FORMAT
from kvbaton.sim.calibrate import calibrate
from kvbaton.sim.host import BySize, HostOverhead, ServedSteps, quantiles
from kvbaton.sim.latency import LinearLatency, StepShape
from kvbaton.sim.served_steps import read_workers, served_steps
from kvbaton.sim.simulator import simulate
from kvbaton.sim.spec import ClusterSpec, InstanceSpec, SimRequest
from kvbaton.sim.workload import synthetic_requests
from kvbaton.workload.arrivals import ArrivalConfig
from kvbaton.workload.datasets import DatasetConfig
from kvbaton.workload.metrics import SLO, summarize
from kvbaton.workload.records import RunResult

PRICES = LinearLatency(base_s=0.012, per_token_s=0.00025, per_decode_seq_s=0.0003, per_context_s=1e-7)
# one token a step (no decode bursts): each served step's overhead shows in each token's gap
CLUSTER = ClusterSpec(decode=InstanceSpec(latency=PRICES, num_blocks=2000, kv_bytes_per_token=1000,
                                          scheduler=SchedulerConfig(decode_burst=1)))
ENGINE = {"model": "m", "dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "threads": 2, "kernels": True,
          "compute_path": "amx"}


def served(prompt: tuple[float, ...] = (1.0,), decode: tuple[float, ...] = (1.0,), gap_s: float = 0.0) -> ServedSteps:
    """Served steps whose prompt steps of every size run `prompt` times their profiled seconds."""
    return ServedSteps(prompt_ratios=BySize.same(*prompt), decode_ratios=decode, gap_s=gap_s)


def load(rate: float = 3.0, n: int = 60) -> list[SimRequest]:
    dataset = DatasetConfig(name="random", num_prompts=n, input_len=256, output_len=32, range_ratio=0.5)
    return synthetic_requests(dataset, ArrivalConfig(request_rate=rate), seed=3)


def test_one_request_pays_the_dispatch_once_and_its_roles_ratios_on_every_step() -> None:
    req = [SimRequest(0, 0.0, tuple(range(100, 300)), 8)]
    bare = simulate(CLUSTER, req).result.records[0]
    steps = served((1.5,), (2.0,), gap_s=0.001)
    host = HostOverhead(dispatch_s=BySize.same(0.05), roles={"both": steps})
    record = simulate(replace(CLUSTER, host=host), req).result.records[0]
    assert record.ttft_s == pytest.approx(0.05 + bare.ttft_s * 1.5 + 0.001)  # alone: TTFT is its prefill step
    assert record.itl_s == pytest.approx([gap * 2.0 + 0.001 for gap in bare.itl_s])  # one sequence: a step a token


def test_each_role_runs_its_own_steps_and_a_role_not_calibrated_takes_the_colocated_ones() -> None:
    pd = replace(CLUSTER, num_prefill=1, local_prefill_threshold=64)
    req = [SimRequest(0, 0.0, tuple(range(100, 400)), 8)]
    bare = simulate(pd, req).result.records[0]
    slow_prefill = {"prefill": served(prompt=(2.0,)), "decode": served(decode=(1.5,))}
    record = simulate(replace(pd, host=HostOverhead(roles=slow_prefill)), req).result.records[0]
    assert record.ttft_s == pytest.approx(bare.ttft_s * 2.0)  # prefilled on the prefill instance
    assert record.itl_s[1:] == pytest.approx([g * 1.5 for g in bare.itl_s[1:]])  # decoded on the decode instance
    colocated_only = HostOverhead(roles={"both": served((2.0,), (1.5,))})
    assert simulate(replace(pd, host=colocated_only), req).result.records[0] == record


def test_draws_are_seeded_and_average_to_the_ratios_mean() -> None:
    host = HostOverhead(roles={"both": served((1.0, 3.0), (1.0, 3.0))})
    requests = load(rate=1.0, n=40)
    runs = [simulate(replace(CLUSTER, host=host), requests, seed=s).instances[0] for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    busy_at_mean_ratio = simulate(replace(CLUSTER, host=HostOverhead(roles={"both": served((2.0,), (2.0,))})),
                                  requests).instances[0].busy_s
    assert runs[0].busy_s == pytest.approx(busy_at_mean_ratio, rel=0.1)


def test_a_prompt_step_takes_its_sizes_ratios_or_the_nearest_measured_ones() -> None:
    steps = ServedSteps(prompt_ratios=BySize(((0.9,), (), (1.3,), ())))  # measured: <= 64 and <= 1024 tokens
    ratios = [steps.ratios_for(StepShape(prefill_tokens=n, prefill_seqs=1)) for n in (10, 64, 65, 256, 700, 5000)]
    assert ratios == [(0.9,), (0.9,), (1.3,), (1.3,), (1.3,), (1.3,)]  # 65..256: a tie, the larger prompts' wins
    assert steps.ratios_for(StepShape(decode_seqs=4, decode_context=100)) == (1.0,)


def test_quantiles_keep_the_distributions_shape() -> None:
    assert quantiles([3.0, 1.0, 2.0]) == (1.0, 2.0, 3.0)
    q = quantiles([i / 1000 for i in range(1000)], n=10)
    assert len(q) == 10 and q[0] == pytest.approx(0.05, abs=0.001) and q[-1] == pytest.approx(0.95, abs=0.001)


def test_calibration_recovers_the_dispatch_a_run_was_made_with() -> None:
    roles = {"both": served((1.1, 1.3), (0.95, 1.05), gap_s=0.0005)}
    requests, truth = load(), HostOverhead(dispatch_s=BySize.same(0.04), roles=roles)

    def replay(host: HostOverhead) -> RunResult:
        return simulate(replace(CLUSTER, host=host), requests).result

    measured = replay(truth)
    ttfts = {r.request_id: r.ttft_s for r in measured.records if r.ttft_s is not None}
    fit = calibrate(replay, roles=roles, measured_ttft_s=ttfts, measured_tpot_p50_ms=20.0)
    # every request's delay, measured (a shift that moves no schedule), to the bisection's resolution
    assert fit.host.dispatch_s.values() == pytest.approx([0.04] * len(fit.host.dispatch_s.values()), abs=1e-4)
    assert fit.simulated_tpot_p50_ms == pytest.approx(summarize(measured, SLO()).tpot_ms.p50)
    assert fit.engines_tpot_p50_ms < fit.simulated_tpot_p50_ms


def test_engines_slower_than_the_measured_run_need_no_dispatch() -> None:
    requests = load()

    def replay(host: HostOverhead) -> RunResult:
        return simulate(replace(CLUSTER, host=host), requests).result

    fit = calibrate(replay, roles={}, measured_ttft_s={r.request_id: 1e-6 for r in requests},
                    measured_tpot_p50_ms=1.0)
    assert fit.host.is_zero


@pytest.mark.parametrize("figures", [{"dispatch_s": BySize.same(-1.0)}, {"dispatch_s": BySize.same(float("nan"))},
                                     {"roles": {"attention": ServedSteps()}}])
def test_impossible_host_figures_are_refused(figures: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="host overhead"):
        HostOverhead(**figures)  # type: ignore[arg-type]


@pytest.mark.parametrize("figures", [{"decode_ratios": (float("nan"),)}, {"decode_ratios": ()},
                                     {"prompt_ratios": BySize.same(1000.0)}, {"gap_s": -0.1}])
def test_impossible_step_figures_are_refused(figures: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="host overhead"):
        ServedSteps(**figures)  # type: ignore[arg-type]


@pytest.mark.parametrize("buckets", [((),) * 4, ((1.0,),)])
def test_figures_for_no_prompt_size_or_the_wrong_sizes_are_refused(buckets: tuple[tuple[float, ...], ...]) -> None:
    with pytest.raises(ConfigError, match="prompt sizes"):
        BySize(buckets)


# ---- step traces: what `kvbaton serve --step-trace` writes, with known seconds --------------------------------------

def write_trace(path: Path, role: str, steps: list[tuple[StepShape, float]], gap_s: float = 0.0005,
                **engine: object) -> None:
    """A worker's trace of `steps` (shape, seconds), back to back `gap_s` apart."""
    lines, t = [json.dumps({"format": TRACE_FORMAT, **ENGINE, **engine, "role": role})], 1.0e9
    for shape, seconds in steps:
        t += gap_s + seconds
        lines.append(json.dumps({"t": t, "seconds": seconds, "shape": asdict(shape)}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


PROMPT, DECODE = StepShape(prefill_tokens=200, prefill_seqs=1, prefill_attended=20100), \
    StepShape(decode_seqs=3, decode_context=600)


def test_a_step_trace_yields_each_roles_ratios_and_gap_without_one_off_outliers(tmp_path: Path) -> None:
    p, d = PRICES.step_seconds(PROMPT), PRICES.step_seconds(DECODE)
    write_trace(tmp_path / "steps-1.jsonl", "both", [(PROMPT, 1.2 * p), *[(DECODE, 0.9 * d)] * 20,
                                                     (PROMPT, 1.25 * p), (PROMPT, 12.0 * p)])  # the last: a stall
    write_trace(tmp_path / "steps-2.jsonl", "prefill", [(PROMPT, 1.4 * p)] * 3, gap_s=0.5)  # idle between prompts
    roles = served_steps(read_workers([tmp_path]), PRICES, ENGINE)
    assert roles["both"].prompt_ratios.buckets[1] == pytest.approx((1.2, 1.25))  # 200 prompt tokens: <= 256
    assert roles["both"].prompt_ratios.buckets[0] == roles["both"].prompt_ratios.buckets[2] == ()
    assert roles["both"].decode_ratios == pytest.approx((0.9,) * 20)
    assert roles["both"].gap_s == pytest.approx(0.0005, abs=1e-6) and roles["both"].num_steps == 23
    assert roles["prefill"].prompt_ratios.buckets[1] == pytest.approx((1.4,) * 3)
    assert roles["prefill"].decode_ratios == (1.0,)
    assert roles["prefill"].gap_s == 0.0  # half a second apart is waiting for work, not the loop's cost


def test_traces_of_another_engine_than_the_profile_are_refused(tmp_path: Path) -> None:
    write_trace(tmp_path / "steps-1.jsonl", "both", [(DECODE, 0.02)], threads=1)
    with pytest.raises(ConfigError, match="threads"):
        served_steps(read_workers([tmp_path]), PRICES, ENGINE)


def test_sim_calibrate_writes_what_sim_run_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a served deployment's steps, its profile (fitted to steps of the same prices: `sim fit-steps`), and a run
    shapes = [StepShape(prefill_tokens=n, prefill_seqs=1, prefill_attended=n * (n + 1) // 2) for n in (64, 128, 256)]
    shapes += [StepShape(decode_seqs=b, decode_context=300 * b) for b in (1, 2, 4, 8)]
    profile_steps = tmp_path / "profile-steps"
    write_trace(profile_steps / "steps-1.jsonl", "both", [(s, PRICES.step_seconds(s)) for s in shapes])
    profile = tmp_path / "profile.json"
    assert main(["sim", "fit-steps", str(profile_steps), "--out", str(profile)]) == 0
    served = tmp_path / "served"
    write_trace(served / "steps-2.jsonl", "both", [(s, PRICES.step_seconds(s) * (1.3 if s.prefill_tokens else 1.1))
                                                   for s in shapes * 5])
    flags = ["--profile", str(profile), "--num-blocks", "2000", "--max-model-len", "4096"]
    trace = tmp_path / "measured.json"
    assert main(["sim", "run", *flags, "--dataset", "random", "--input-len", "200", "--output-len", "16",
                 "--num-prompts", "30", "--request-rate", "2", "--seed", "2", "--result-json", str(trace)]) == 0
    doc = json.loads(trace.read_text())  # a "measured" run whose first tokens came later than the engines alone's
    summary = doc["runs"][0]["summary"]
    summary["ttft_ms"]["p50"] += 80.0
    for record in doc["runs"][0]["records"]:
        record["ttft_s"] += 0.08
    trace.write_text(json.dumps(doc))
    host = tmp_path / "host.json"
    capsys.readouterr()
    assert main(["sim", "calibrate", *flags, "--trace", str(trace), "--step-trace", str(served),
                 "--out", str(host)]) == 0
    assert "calibrated" in capsys.readouterr().out
    fitted = HostOverhead.load(host)
    assert [len(b) for b in fitted.roles["both"].prompt_ratios.buckets] == [5, 10, 0, 0]  # 64; 128 and 256 tokens
    assert all(r == pytest.approx(1.3, rel=0.05) for r in fitted.roles["both"].prompt_ratios.values())
    assert fitted.dispatch(200, random.Random(0)) > 0.03 and "measured.json" in fitted.calibrated_on
    replayed = tmp_path / "replayed.json"
    assert main(["sim", "run", *flags, "--trace", str(trace), "--host-overhead", str(host),
                 "--result-json", str(replayed)]) == 0
    again = json.loads(replayed.read_text())
    assert again["runs"][0]["summary"]["ttft_ms"]["p50"] > summary["ttft_ms"]["p50"] - 80.0
    assert "dispatch" in again["config"]["host_overhead"]


def test_a_hand_written_file_may_give_one_delay_for_every_prompt_size(tmp_path: Path) -> None:
    path = tmp_path / "host.json"
    path.write_text('{"dispatch_s": 0.02, "roles": {"both": {"prompt_ratios": 1.2, "decode_ratios": [1.0], '
                    '"gap_s": 0.001}}}')
    host = HostOverhead.load(path)
    assert host.dispatch(10, random.Random(0)) == host.dispatch(5000, random.Random(0)) == 0.02
    assert host.steps_for("decode").ratios_for(PROMPT) == (1.2,)


@pytest.mark.parametrize("content", ["not json", '{"dispatch_s": "soon", "roles": {}}',
                                     '{"dispatch_s": 0.1, "per_token_s": 0.002, "host_cores": 2}'])  # an older format
def test_a_bad_host_overhead_file_is_one_line_and_status_2(content: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "host.json"
    path.write_text(content)
    assert main(["sim", "run", "--hardware", "h100-sxm", "--model-preset", "llama-3-8b", "--num-blocks", "100",
                 "--num-prompts", "4", "--host-overhead", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not a host-overhead file" in err and len(err.strip().splitlines()) == 1


def test_calibrating_without_a_profile_or_on_no_measured_run_is_one_line(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"runs": [{"request_rate": 1.0, "records": []}]}))
    write_trace(tmp_path / "steps" / "steps-1.jsonl", "both", [(DECODE, 0.02)])
    common = ["--trace", str(trace), "--step-trace", str(tmp_path / "steps"), "--out", str(tmp_path / "h.json")]
    assert main(["sim", "calibrate", "--hardware", "h100-sxm", "--model-preset", "llama-3-8b", "--num-blocks",
                 "100", *common]) == 2
    assert "--profile" in capsys.readouterr().err
    profile = tmp_path / "profile.json"
    assert main(["sim", "fit-steps", str(tmp_path / "steps"), "--out", str(profile)]) == 0
    capsys.readouterr()
    assert main(["sim", "calibrate", "--profile", str(profile), "--num-blocks", "100", *common]) == 2
    err = capsys.readouterr().err
    assert "no measured TTFT and TPOT medians" in err and len(err.strip().splitlines()) == 1
