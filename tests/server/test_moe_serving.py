"""`kvbaton serve` of a MoE model as one expert-parallel group of 2 ranks with EPLB on (tiny Qwen3-MoE,
fp32): completions equal transformers' greedy output, `GET /experts` shows the routed tokens, the group's
placement and balance (EPLB has re-placed the experts), and `/metrics` exports them to whoever may read
`/experts` (the admin key's holder), the rest of `/metrics` to anyone."""

from __future__ import annotations

import httpx

from tests.support.helpers import hf_greedy
from tests.support.server import kvbaton_server

PROMPTS = [[5, 17, 42, 9], [100, 3, 77, 250, 31, 8, 64], [12] * 20]
MAX_NEW = 8
ADMIN_KEY = "moe-adm1n"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def test_served_moe_expert_parallel_group(tiny_moe_models):
    model = tiny_moe_models["qwen3_moe"]
    refs = hf_greedy(model, PROMPTS, MAX_NEW)
    with kvbaton_server("--model", str(model), "--served-model-name", "tiny-moe", "--dtype", "float32",
                        "--expert-parallel-size", "2",
                        "--num-redundant-experts", "2", "--eplb-interval", "4", "--block-size", "4",
                        "--kv-cache-memory-gb", "0.05", "--admin-api-key", ADMIN_KEY) as (base, _):
        got = []
        for prompt in PROMPTS:
            r = httpx.post(f"{base}/v1/completions", json={"model": "tiny-moe", "prompt": prompt,
                                                          "max_tokens": MAX_NEW, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"].split())  # the tiny tokenizer's words: t0 .. t319
        view = httpx.get(f"{base}/experts", timeout=30, headers=ADMIN).json()
        metrics = httpx.get(f"{base}/metrics", timeout=30, headers=ADMIN).text
        public_metrics = httpx.get(f"{base}/metrics", timeout=30).text
        workers = httpx.get(f"{base}/workers", timeout=30, headers=ADMIN).json()["workers"]
    assert [w["ep_group"] for w in workers] == ["kvbaton-both-ep0"] * 2
    routed = sum(map(sum, view["tokens"]))
    computed = sum(len(p) + MAX_NEW - 1 for p in PROMPTS)
    assert routed == computed * 2 * len(view["layers"])  # top-2 of every token in every MoE layer
    [group] = view["groups"]
    assert group["ep_size"] == 2 and group["rebalances"] >= 1 and len(group["placement"][0]) == 8 + 2
    assert all(0 < b <= 1 for b in group["balancedness"])
    assert 'kvbaton:expert_tokens{' in metrics and 'kvbaton:expert_balancedness{' in metrics
    assert "kvbaton:expert_" not in public_metrics and "kvbaton:generation_tokens_total{" in public_metrics
    assert got == [[f"t{t}" for t in ref if t != 0] for ref in refs]  # t0, the unknown/pad word, is not shown
