"""`kvbaton doctor` against a live 1P+1D `kvbaton serve` on the real default model: all four steps report real
measured figures, a bad admin key is one line and exit 2, probe parameters out of range are 400s, and the
deployment serves the same greedy output after the run, with no worker killed or restarted."""

from __future__ import annotations

import json
import os
import random

import httpx
import pytest

from kvbaton.cli import main as cli_main
from tests.support.server import served

pytestmark = pytest.mark.slow

ADMIN_KEY = "doctor-test-admin-key"


@pytest.fixture(scope="module")
def deployment(default_model_dir):
    """`kvbaton serve --prefill 1 --decode 1` on a free loopback port, with an admin key; stopped by PID."""
    # NOTE: `served` drains the server's output: the probes log, and an unread pipe could fill and block it
    with served("--prefill", "1", "--decode", "1", "--threads", "1", "--kv-cache-memory-gb", "0.25",
                "--max-model-len", "1024", "--admin-api-key", ADMIN_KEY) as srv:
        yield srv.base


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


def _complete(base: str, prompt: list[int], max_tokens: int = 8) -> dict:
    resp = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                                      "ignore_eos": True}, timeout=120, trust_env=False)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_doctor_reports_all_four_steps(deployment, tmp_path, capsys):
    base = deployment
    rng = random.Random(5)
    short = [[rng.randrange(100, 2000) for _ in range(8)] for _ in range(3)]
    long = [[rng.randrange(100, 2000) for _ in range(300)] for _ in range(3)]  # >= 64: through the prefill pool
    for prompt in short + long:
        _complete(base, prompt)
    reference = _complete(base, long[0], 12)["choices"][0]["text"]
    before = {w["name"]: w["pid"] for w in httpx.get(f"{base}/workers", headers=_admin(), trust_env=False)
              .json()["workers"]}

    out = tmp_path / "doctor.json"
    assert cli_main(["doctor", "--url", base, "--api-key", ADMIN_KEY, "--json", str(out), "--timeout", "30"]) == 0
    printed = capsys.readouterr().out
    for title in ("1. Interconnect", "2. KV watermark", "3. Compute", "4. Routing", "Findings"):
        assert title in printed
    report = json.loads(out.read_text())
    steps = report["steps"]

    ic = steps["interconnect"]
    assert ic["transport"] == "shm" and not ic["errors"], ic
    pair = ic["pairs"][0]
    assert (pair["prefill"], pair["decode"]) == ("kvbaton-prefill-0", "kvbaton-decode-0") and pair["error"] is None
    assert pair["large"]["gbps"] > 0 and pair["large"]["num_bytes"] >= 16 * 2**20 and pair["small"]["median_ms"] > 0
    ar = ic["all_reduce"]
    assert ar["error"] is None and ar["world_size"] == 2
    assert all(size["median_us"] > 0 and size["busbw_gbps"] > 0 for size in ar["sizes"]) and len(ar["sizes"]) == 2

    kv = steps["kv"]
    assert 0.0 <= kv["kv_cache_usage"] <= 1.0 and kv["finished_requests"] >= 7 and "preemptions_per_min" in kv

    compute = steps["compute"]
    assert not compute["errors"] and not compute["traffic"]["errors"], compute
    assert {w["name"] for w in compute["workers"]} == set(before)
    for w in compute["workers"]:
        assert w["compute_path"] and w["error"] is None, w
        assert w["num_steps"] >= 1 and w["top_ops"] and w["step_ms"] > 0 and 0 <= w["outside_compute_share"] <= 1

    routing = steps["routing"]
    assert routing["local_prefill_threshold"] == 64 and routing["num_prefill"] == 1 and routing["requests"] == 7
    assert abs(routing["share_at_least_threshold"] - 4 / 7) < 1e-9  # 4 prompts of 300 tokens, 3 of 8
    assert routing["disaggregated_share"] is not None and routing["counters"]["disaggregated"] >= 3

    assert all({"step", "severity", "message", "flag"} <= set(f) for f in report["findings"])

    # the deployment is intact: same workers (none killed or restarted), the same greedy output, no probe leftovers
    after = httpx.get(f"{base}/workers", headers=_admin(), trust_env=False).json()["workers"]
    assert {w["name"]: w["pid"] for w in after} == before and all(w["healthy"] and not w["restarts"] for w in after)
    assert _complete(base, long[0], 12)["choices"][0]["text"] == reference
    assert not [p for p in os.listdir("/dev/shm") if "-probe-" in p and int(p.split("-probe-")[1].split("-")[0])
                in before.values()]


def test_bad_key_is_one_line_and_exit_2(deployment, capsys):
    assert cli_main(["doctor", "--url", deployment, "--api-key", "wrong"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "401" in err
    assert cli_main(["doctor", "--url", "http://127.0.0.1:1"]) == 2
    assert "cannot reach" in capsys.readouterr().err


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/admin/diagnostics/kv-transfer", {"large_mb": 1000}, "large_mb"),
    ("/admin/diagnostics/kv-transfer", {"repeats": 0}, "repeats"),
    ("/admin/diagnostics/all-reduce", {"iters": 10_000}, "iters"),
    ("/admin/diagnostics/all-reduce", {"timeout_s": -1}, "timeout_s"),
    ("/admin/diagnostics/profile", {"num_steps": 65}, "num_steps"),
    ("/admin/diagnostics/profile", {"max_duration_s": 3600}, "max_duration_s"),
    ("/admin/diagnostics/profile", {"unknown": 1}, "unknown"),
])
def test_probe_bounds_are_400s(deployment, path, body, param):
    resp = httpx.post(f"{deployment}{path}", json=body, headers=_admin(), timeout=30, trust_env=False)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and resp.json()["error"]["type"] == "BadRequestError"


def test_probes_need_the_admin_key_and_name_real_workers(deployment):
    for path in ("/admin/diagnostics/kv-transfer", "/admin/diagnostics/all-reduce", "/admin/diagnostics/profile"):
        resp = httpx.post(f"{deployment}{path}", json={}, timeout=30, trust_env=False)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(f"{deployment}/admin/diagnostics/routing", timeout=30, trust_env=False).status_code == 401
    resp = httpx.post(f"{deployment}/admin/diagnostics/profile", json={"workers": ["kvbaton-nope-0"]},
                      headers=_admin(), timeout=30, trust_env=False)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "workers"
