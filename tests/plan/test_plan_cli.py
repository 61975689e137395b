"""`kvbaton plan` end to end through `kvbaton.cli.main`: the article's example, a search, bad input.

Simulated windows are a few seconds and searches two steps long, so each run takes seconds, not minutes.
"""

from __future__ import annotations

import json
import re

import pytest

from kvbaton.cli import main

FAST = ["--window-s", "3", "--search-steps", "2", "--max-requests", "60", "--quiet"]


def test_article_example_prints_the_formula_and_three_ranked_actions(capsys, tmp_path) -> None:
    out_json = tmp_path / "article.json"
    assert main(["plan", "--example", "article", *FAST, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "2 (K and V) x 80 layers x 8 KV heads x 128 head_dim x 2 B = 327,680 B = 320.0 KiB per token" in flat
    assert "x 1,800 tokens (1500 + 300) = 562.5 MiB" in flat
    assert "141.1 GB / 8 GPUs = 17.6 GB per GPU" in flat
    assert "Little's law: 25.0 QPS per instance" in flat
    assert re.search(r"KV pool: .* GB per GPU, \d+ GB per instance = [\d,]+ tokens = \d+ sequences", flat)
    ranks = re.findall(r"│\s+([123]) │ (TP/PP re-configuration|KV quantization|scheduling parameters)", out)
    assert [r for r, _ in ranks] == ["1", "2", "3"]
    assert {kind for _, kind in ranks} == {"TP/PP re-configuration", "KV quantization", "scheduling parameters"}
    doc = json.loads(out_json.read_text())
    assert doc["diagnosis"]["current"]["memory"]["kv_bytes_per_token"] == 327_680
    assert len(doc["actions"]) == 3 and len(doc["findings"]) >= 5


def test_search_from_a_config_json_with_plots(capsys, tmp_path) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
              "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
              "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["plan", "--model", str(tmp_path / "config.json"), "--hardware", "xeon-amx-2vcpu", "--qps", "2",
            "--input-len", "64", "--output-len", "16", "--tp", "1", "--pp", "1", "--gpus", "1",
            "--plot-dir", str(tmp_path / "plots"), "--json", str(tmp_path / "plan.json"), *FAST]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "recommended" in out or "no configuration met" in out
    assert "disaggregation" in out
    assert (tmp_path / "plots" / "goodput_per_gpu.png").stat().st_size > 0
    assert (tmp_path / "plots" / "memory_per_gpu.png").stat().st_size > 0
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["candidates"][0]["memory"]["kv_bytes_per_token"] == 23_040


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "llama-9", "--qps", "1"], "unknown model preset"),
    (["--qps", "-3"], "--qps must be a positive number"),
    (["--hardware", "tpu-v9", "--qps", "1"], "unknown hardware"),
    (["--model", "llama-3-70b", "--hardware", "a100-80gb", "--weight-dtype", "fp32", "--tp", "1,2", "--pp", "1",
      "--qps", "1"], "fits in no configuration"),
    (["--tp", "a,b", "--qps", "1"], "comma-separated sizes"),
    (["--current-tp", "2", "--qps", "1"], "needs its size"),
    ([], "--qps"),
])
def test_bad_input_is_one_line_and_status_2(capsys, args: list[str], message: str) -> None:
    assert main(["plan", *args, *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvbaton: error:") and message in err and "\n" not in err


AFD_PROFILE = {"attention": {"fixed_s": 1e-3, "per_token_s": 1e-5}, "post": {"fixed_s": 2e-4, "per_token_s": 0.0},
               "experts": {"fixed_s": 5e-4, "per_token_s": 4e-5}, "latency_s": 5e-5, "layers": 8, "moe_layers": 8}


def test_afd_plan_picks_the_split_and_m_from_a_profile(capsys, tmp_path) -> None:
    from kvbaton.sim.afd import AfdCosts, plan_afd

    profile, out_json = tmp_path / "run.json", tmp_path / "afd.json"
    profile.write_text(json.dumps({"jobs": [], "afd_profile": AFD_PROFILE}))  # a bench_afd result holds one
    assert main(["plan", "--afd-profile", str(profile), "--afd-workers", "4", "--afd-batch", "32",
                 "--json", str(out_json)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    doc = json.loads(out_json.read_text())
    expected = plan_afd(AfdCosts.from_dict(AFD_PROFILE), 32, 4)
    best = doc["plans"][0]
    assert (best["attention_workers"], best["expert_workers"], best["micro_batches"]) == (
        expected[0].attention_workers, expected[0].expert_workers, expected[0].micro_batches)
    assert [p["tokens_per_s"] for p in doc["plans"]] == sorted((p["tokens_per_s"] for p in doc["plans"]), reverse=True)
    assert len(doc["plans"]) == 3 and set(doc["per_micro_batches"]) == {"1", "2", "3", "4"}
    assert f"best {best['attention_workers']}:{best['expert_workers']} (attention:expert) at m = " in out


@pytest.mark.parametrize(("profile", "message"), [
    (None, "No such file"), ("{", "not JSON"), ({"afd_profile": None}, "no profile"),
    ({**AFD_PROFILE, "layers": "many"}, "an AFD profile needs"), ({**AFD_PROFILE, "latency_s": -1}, ">= 0"),
    ({k: v for k, v in AFD_PROFILE.items() if k != "experts"}, "an AFD profile needs"),
])
def test_a_bad_afd_profile_is_one_line_and_status_2(capsys, tmp_path, profile, message) -> None:
    path = tmp_path / "profile.json"
    if profile is not None:
        path.write_text(profile if isinstance(profile, str) else json.dumps(profile))
    assert main(["plan", "--afd-profile", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvbaton: error:") and message in err and "\n" not in err
