"""The frontend's costs in the simulator (kvbaton.sim.host) and their calibration (kvbaton.sim.calibrate):
the dispatch delay and the per-token price change simulated time exactly as stated, a calibration recovers
the figures a run was made with, and `kvbaton sim calibrate` writes what `kvbaton sim run` reads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvbaton.bench.arrivals import ArrivalConfig
from kvbaton.bench.datasets import DatasetConfig
from kvbaton.bench.metrics import SLO, Summary, summarize
from kvbaton.cli import main
from kvbaton.config import ConfigError
from kvbaton.sim.calibrate import calibrate
from kvbaton.sim.host import HostOverhead
from kvbaton.sim.latency import LinearLatency
from kvbaton.sim.simulator import simulate
from kvbaton.sim.spec import ClusterSpec, InstanceSpec, SimRequest
from kvbaton.sim.workload import synthetic_requests

PRICES = LinearLatency(base_s=0.012, per_token_s=0.00025, per_decode_seq_s=0.0003, per_context_s=1e-7)
CLUSTER = ClusterSpec(decode=InstanceSpec(latency=PRICES, num_blocks=2000))


def load(rate: float = 3.0, n: int = 60) -> list[SimRequest]:
    dataset = DatasetConfig(name="random", num_prompts=n, input_len=256, output_len=32, range_ratio=0.5)
    return synthetic_requests(dataset, ArrivalConfig(request_rate=rate), seed=3)


def test_one_request_alone_pays_the_dispatch_once_and_the_price_per_token_on_every_step() -> None:
    req = [SimRequest(0, 0.0, tuple(range(100, 300)), 8)]
    bare = simulate(CLUSTER, req).result.records[0]
    host = HostOverhead(dispatch_s=0.05, per_token_s=0.002)
    served = simulate(replace(CLUSTER, host=host), req).result.records[0]
    assert served.ttft_s == pytest.approx(bare.ttft_s + 0.05 + 0.002)  # the prefill step streams one token
    assert served.itl_s == pytest.approx([gap + 0.002 for gap in bare.itl_s])  # one sequence: one token a step


def test_a_step_pays_the_price_only_while_busy_workers_fill_the_cores() -> None:
    worker = InstanceSpec(latency=PRICES, num_blocks=2000, kv_bytes_per_token=1000, cpu_threads=1)
    pd = ClusterSpec(decode=worker, num_prefill=1)  # two 1-thread workers
    req = [SimRequest(0, 0.0, tuple(range(100, 400)), 8)]

    def gaps(host: HostOverhead) -> tuple[float, ...]:
        return simulate(replace(pd, host=host), req).result.records[0].itl_s

    bare = gaps(HostOverhead())
    assert gaps(HostOverhead(per_token_s=0.002, host_cores=2)) == pytest.approx(bare)  # prefill idle: a free core
    assert gaps(HostOverhead(per_token_s=0.002, host_cores=1)) == pytest.approx([g + 0.002 for g in bare])
    assert gaps(HostOverhead(per_token_s=0.002)) == pytest.approx([g + 0.002 for g in bare])  # 0: always paid


def test_the_price_scales_with_the_batch_so_tpot_grows_with_load() -> None:
    host = HostOverhead(per_token_s=0.002)
    light, heavy = load(rate=0.5), load(rate=6.0)

    def tpot_gain(requests: list[SimRequest]) -> float:
        with_host = summarize(simulate(replace(CLUSTER, host=host), requests).result, SLO()).tpot_ms.p50
        bare = summarize(simulate(CLUSTER, requests).result, SLO()).tpot_ms.p50
        assert with_host is not None and bare is not None
        return with_host - bare

    assert 2.0 <= tpot_gain(light) < tpot_gain(heavy)  # at least one token's price per step; more with a batch


def test_calibration_recovers_the_costs_a_run_was_made_with() -> None:
    requests, truth = load(), HostOverhead(dispatch_s=0.04, per_token_s=0.0015)

    def simulate_with(host: HostOverhead) -> Summary:
        return summarize(simulate(replace(CLUSTER, host=host), requests).result, SLO())

    measured = simulate_with(truth)
    assert measured.ttft_ms.p50 is not None and measured.tpot_ms.p50 is not None
    fit = calibrate(simulate_with, measured_ttft_p50_ms=measured.ttft_ms.p50,
                    measured_tpot_p50_ms=measured.tpot_ms.p50)
    assert fit.host.per_token_s == pytest.approx(truth.per_token_s, rel=0.05)
    assert fit.host.dispatch_s == pytest.approx(truth.dispatch_s, abs=0.005)
    assert fit.simulated_tpot_p50_ms == pytest.approx(measured.tpot_ms.p50, rel=0.02)
    assert fit.uncalibrated_tpot_p50_ms < fit.simulated_tpot_p50_ms


def test_an_engine_slower_than_the_measured_run_needs_no_host_cost() -> None:
    requests = load()

    def simulate_with(host: HostOverhead) -> Summary:
        return summarize(simulate(replace(CLUSTER, host=host), requests).result, SLO())

    fit = calibrate(simulate_with, measured_ttft_p50_ms=1.0, measured_tpot_p50_ms=1.0)
    assert fit.host.is_zero


@pytest.mark.parametrize("figures", [{"dispatch_s": -1.0}, {"per_token_s": 2.0}, {"dispatch_s": float("nan")},
                                     {"host_cores": -1}])
def test_impossible_figures_are_refused(figures: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="host overhead"):
        HostOverhead(**figures)  # type: ignore[arg-type]


def test_sim_calibrate_writes_what_sim_run_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--hardware", "h100-sxm", "--model-preset", "llama-3-8b", "--num-blocks", "20000"]
    trace = tmp_path / "measured.json"
    assert main(["sim", "run", *flags, "--dataset", "random", "--input-len", "256", "--output-len", "32",
                 "--num-prompts", "40", "--request-rate", "4", "--seed", "2", "--result-json", str(trace)]) == 0
    doc = json.loads(trace.read_text())  # a "measured" run whose frontend was slower than the engines alone
    summary = doc["runs"][0]["summary"]
    summary["ttft_ms"]["p50"] += 30.0
    summary["tpot_ms"]["p50"] *= 1.5
    trace.write_text(json.dumps(doc))
    host = tmp_path / "host.json"
    assert main(["sim", "calibrate", *flags, "--trace", str(trace), "--out", str(host)]) == 0
    assert "calibrated" in capsys.readouterr().out
    fitted = HostOverhead.load(host)
    assert fitted.dispatch_s > 0.02 and fitted.per_token_s > 0 and "measured.json" in fitted.calibrated_on
    replayed = tmp_path / "replayed.json"
    assert main(["sim", "run", *flags, "--trace", str(trace), "--host-overhead", str(host),
                 "--result-json", str(replayed)]) == 0
    tpot = json.loads(replayed.read_text())["runs"][0]["summary"]["tpot_ms"]["p50"]
    assert tpot == pytest.approx(summary["tpot_ms"]["p50"], rel=0.03)
    assert "dispatch" in json.loads(replayed.read_text())["config"]["host_overhead"]


@pytest.mark.parametrize(("content", "argv"), [
    ("not json", ["--host-overhead", "{path}"]),
    ('{"dispatch_s": "soon"}', ["--host-overhead", "{path}"]),
])
def test_a_bad_host_overhead_file_is_one_line_and_status_2(content: str, argv: list[str], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "host.json"
    path.write_text(content)
    argv = [a.format(path=path) for a in argv]
    assert main(["sim", "run", "--hardware", "h100-sxm", "--model-preset", "llama-3-8b", "--num-blocks", "100",
                 "--num-prompts", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert "not a host-overhead file" in err and len(err.strip().splitlines()) == 1


def test_a_price_on_shared_cores_without_the_workers_threads_is_refused(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    host = tmp_path / "host.json"
    HostOverhead(per_token_s=0.001, host_cores=2).save(host)
    assert main(["sim", "run", "--hardware", "h100-sxm", "--model-preset", "llama-3-8b", "--num-blocks", "100",
                 "--num-prompts", "4", "--host-overhead", str(host)]) == 2
    err = capsys.readouterr().err
    assert "--cpu-threads" in err and len(err.strip().splitlines()) == 1


def test_calibrating_on_a_file_that_is_no_measured_run_is_one_line(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"runs": [{"request_rate": 1.0, "records": []}]}))
    assert main(["sim", "calibrate", "--hardware", "h100-sxm", "--model-preset", "llama-3-8b", "--num-blocks",
                 "100", "--trace", str(trace), "--out", str(tmp_path / "h.json")]) == 2
    err = capsys.readouterr().err
    assert "no measured TTFT and TPOT medians" in err and len(err.strip().splitlines()) == 1
