"""Expert parallelism across processes (gloo): EP2 and EP4 ranks (tiny Qwen3-MoE and DeepSeek-V3), each with
its own requests and a share of every MoE layer's experts, give exactly the single-process (EP1) greedy
output; a rank with fewer requests keeps stepping (empty batches) until every rank is done; a fault in one
rank's forward fails only its batch; EPLB balances a skewed load; int8 dispatch is measured against exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbaton import LLM
from kvbaton.kv.processes import free_port
from tests.support.helpers import TINY_VOCAB, build_deepseek_checkpoint, greedy

RANK_SCRIPT = str(Path(__file__).with_name("ep_rank.py"))
MAX_NEW = 10


def _prompts(count: int, seed: int = 5) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


def _run_group(model: Path, shares: list[list[list[int]]] | list[list[list[list[int]]]], **job) -> list[dict]:
    """Start one process per share (rank r gets shares[r]: one prompt list, or several run one after another);
    wait for all (bounded); their JSON results, one set of outputs per prompt list."""
    port = free_port("127.0.0.1")
    sets = [share if share and isinstance(share[0][0], list) else [share] for share in shares]
    procs = [subprocess.Popen([sys.executable, RANK_SCRIPT, json.dumps(
        {"model": str(model), "size": len(shares), "rank": rank, "port": port, "prompt_sets": prompt_sets,
         "max_tokens": MAX_NEW, **job})], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank, prompt_sets in enumerate(sets)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _outputs(results: list[dict], index: int = 0) -> list[list[int]]:
    return [tokens for result in results for tokens in result["sets"][index]["outputs"]]


@pytest.fixture(scope="module")
def ep_models(tiny_moe_models, tmp_path_factory):
    return {"qwen3_moe": tiny_moe_models["qwen3_moe"],
            "deepseek_v3": build_deepseek_checkpoint(tmp_path_factory.mktemp("ep-deepseek") / "deepseek_v3")}


@pytest.fixture(scope="module")
def ep1_references(ep_models):
    prompts = _prompts(9)
    refs = {}
    for arch, model in ep_models.items():
        refs[arch] = greedy(LLM(str(model), dtype="float32", num_threads=1, block_size=4), MAX_NEW, prompts)
    return prompts, refs


@pytest.fixture(scope="module")
def ep1_reference(ep1_references):
    prompts, refs = ep1_references
    return prompts, refs["qwen3_moe"]


def _uneven_shares(prompts: list[list[int]], size: int) -> list[list[list[int]]]:
    """Rank 0 gets most, so the other ranks run out early and join the others' steps with empty batches."""
    return [prompts[: len(prompts) - size + 1]] + [[p] for p in prompts[len(prompts) - size + 1:]]


@pytest.fixture(scope="module")
def exact_runs() -> dict:
    """Group results by (arch, size), kept for the int8 comparison (one fewer group to start)."""
    return {}


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("size", [2, 4])
def test_expert_parallel_equals_one_process(ep_models, ep1_references, exact_runs, arch, size):
    prompts, references = ep1_references
    results = exact_runs[arch, size] = _run_group(ep_models[arch], _uneven_shares(prompts, size))
    assert _outputs(results) == references[arch]
    assert all(r["bytes_sent"] > 0 for r in results)  # every rank's experts served other ranks' tokens


def test_int8_dispatch_quality(ep_models, ep1_reference, exact_runs):
    """int8 activations on the dispatch wire: the share of greedy tokens equal to exact (reported), and the
    dispatch bytes it saves."""
    prompts, reference = ep1_reference
    shares = _uneven_shares(prompts, 2)
    exact = exact_runs.get(("qwen3_moe", 2)) or _run_group(ep_models["qwen3_moe"], shares)
    int8 = _run_group(ep_models["qwen3_moe"], shares, int8=True)
    got = _outputs(int8)
    same = sum(a == b for seq_a, seq_b in zip(got, reference) for a, b in zip(seq_a, seq_b))
    total = sum(len(s) for s in reference)
    first = sum(seq_a[0] == seq_b[0] for seq_a, seq_b in zip(got, reference))
    exact_bytes, int8_bytes = sum(r["bytes_sent"] for r in exact), sum(r["bytes_sent"] for r in int8)
    print(f"int8 dispatch: {same}/{total} tokens equal to exact, first tokens {first}/{len(reference)}; "
          f"bytes sent {int8_bytes} vs {exact_bytes} ({int8_bytes / exact_bytes:.2f}x)")
    assert first >= len(reference) - 1  # the first token (before any divergence compounds) nearly always agrees
    assert int8_bytes < exact_bytes


def _skewed_checkpoint(out: Path) -> Path:
    """A tiny Qwen3-MoE (16 experts, top-2) whose routing favours experts 0-2: every token's embedding carries
    a constant component that those experts' gate rows reward (the skew survives the norms)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from tests.support.helpers import build_tiny_tokenizer

    cfg = Qwen3MoeConfig(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                         num_experts=16, num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.2,
                         eos_token_id=None, bos_token_id=None, pad_token_id=0, norm_topk_prob=True)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 2.0
        for layer in model.model.layers:
            layer.mlp.gate.weight[:3, 0] += torch.tensor([3.0, 2.5, 2.0])
    model.save_pretrained(str(out))
    build_tiny_tokenizer(out)
    return out


def _balancedness(results: list[dict], index: int) -> float:
    rows = [r["sets"][index]["rows_computed"] for r in results]
    return sum(rows) / len(rows) / max(rows)


def test_eplb_balances_a_skewed_load_and_keeps_outputs(tmp_path):
    """EP4 with 4 redundant slots: the first prompt set runs under the first placement (redundant slots spread
    evenly), then every rank re-places its experts from the measured load (EPLB, hot experts replicated), and
    a second set runs under the new one. Tokens per rank become balanced; outputs stay exactly EP1's."""
    model = _skewed_checkpoint(tmp_path / "skewed")
    first, second = _prompts(8, seed=21), _prompts(8, seed=22)
    llm = LLM(str(model), dtype="float32", num_threads=1, block_size=4)
    reference = [greedy(llm, MAX_NEW, first), greedy(llm, MAX_NEW, second)]
    shares = [[first[r::4], second[r::4]] for r in range(4)]
    results = _run_group(model, shares, redundant=4, rebalance=True)
    before, after = _balancedness(results, 0), _balancedness(results, 1)
    print(f"EPLB on a skewed load (EP4, 16 experts + 4 redundant): balancedness (mean/max token-expert pairs "
          f"per rank) {before:.3f} before, {after:.3f} after")
    assert all(r["rebalances"] >= 1 for r in results)
    assert after >= 0.85 and after > before
    for index, prompts in enumerate((first, second)):
        got = {tuple(p): out for r, share in zip(results, shares) for p, out in zip(share[index],
                                                                                      r["sets"][index]["outputs"])}
        assert [got[tuple(p)] for p in prompts] == reference[index]


def test_a_rank_whose_step_raises_fails_only_its_batch_and_the_group_goes_on(ep_models, ep1_references):
    """A fault mid-forward on rank 1 (after the first MoE layer's exchange): rank 1 does its remaining exchanges
    empty, fails its batch (that request ends aborted), and both ranks go on; every other request equals EP1."""
    prompts, references = ep1_references
    reference = dict(zip(map(tuple, prompts), references["qwen3_moe"]))
    marker = 999 % TINY_VOCAB
    assert all(marker not in p + out for p, out in reference.items() for p in [list(p)]), "pick another marker"
    fault = [marker] + prompts[0][1:]
    shares = [[prompts[:2], prompts[2:4], prompts[4:6]], [prompts[6:8], [fault], prompts[8:]]]
    results = _run_group(ep_models["qwen3_moe"], shares, fault_token=marker)
    [faulty] = results[1]["sets"][1]["finish_reasons"]
    assert faulty == "abort"
    for rank, share in enumerate(shares):
        for index, prompt_set in enumerate(share):
            if (rank, index) == (1, 1):
                continue
            assert results[rank]["sets"][index]["outputs"] == [reference[tuple(p)] for p in prompt_set]


def test_eplb_in_bf16_keeps_the_moe_kernel_and_its_outputs(tmp_path):
    """bf16 engines run the C MoE kernel over expert weights packed in place: a rebalanced placement's stacks
    (kept slots copied packed, moved ones read from the checkpoint and packed) stay on the kernel, and the
    same prompts give the same greedy tokens before and after (up to bf16 rounding where a slot's row count
    changes the kernel's tile choice)."""
    model = _skewed_checkpoint(tmp_path / "skewed")
    prompts = _prompts(8, seed=23)
    shares = [[prompts[r::2], prompts[r::2]] for r in range(2)]
    results = _run_group(model, shares, redundant=2, rebalance=True, dtype="bfloat16")
    assert all(r["rebalances"] >= 1 and r["layers_on_kernel"] == 2 for r in results)
    before, after = ([t for seq in _outputs(results, i) for t in seq] for i in (0, 1))
    agree = sum(a == b for a, b in zip(before, after)) / len(before)
    print(f"bf16 EPLB: {agree:.3f} of the greedy tokens equal before and after rebalancing")
    assert agree >= 0.9


def test_bf16_ranks_decode_in_the_c_loop_with_the_python_loops_tokens(ep_models):
    """bf16 ranks run their decode steps in the C layer loop, each MoE layer's exchange called back from it through
    the same all-to-all dispatcher: the same greedy tokens as the Python loop's (KVBATON_LAYER_LOOP=0), uneven
    shares included (a rank out of requests joins the others' exchanges from Python)."""
    shares = _uneven_shares(_prompts(5, seed=31), 2)
    runs = {env: _run_group(ep_models["qwen3_moe"], shares, dtype="bfloat16", env={"KVBATON_LAYER_LOOP": env})
            for env in ("1", "0")}
    assert all(r["c_loop_steps"] > 0 for r in runs["1"]), "a rank's decode steps did not run the C loop"
    assert all(r["c_loop_steps"] == 0 for r in runs["0"])
    assert _outputs(runs["1"]) == _outputs(runs["0"])
