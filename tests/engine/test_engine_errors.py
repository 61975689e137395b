"""Bad input gets a clear error, changes nothing, and never harms other requests."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from kvbaton import LLM, SamplingParams
from kvbaton.config import ConfigError
from kvbaton.sched.sampling_params import InvalidRequestError

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64, block_size=4)


@pytest.mark.parametrize("prompt, params, message", [
    ({"prompt_token_ids": []}, GREEDY, "prompt is empty"),
    ("", GREEDY, "prompt is empty"),
    ({"prompt_token_ids": list(range(1, 65))}, GREEDY, "context length is 64"),
    ({"prompt_token_ids": [1, 2, 10**6]}, GREEDY, "prompt_token_ids must be integers"),
    ({"prompt_token_ids": [1, -2]}, GREEDY, "prompt_token_ids must be integers"),
    ({"nothing": 1}, GREEDY, "prompt dict needs"),
    (3.5, GREEDY, "prompt must be a string"),
    ({"prompt_token_ids": [1, 2]}, SamplingParams(logprobs=21), "logprobs must be <= 20"),
    # the request that took the engine down: a stop id past the vocabulary, banned before min_tokens
    ({"prompt_token_ids": [1, 2]}, SamplingParams(min_tokens=1, stop_token_ids=[10**8]), "stop_token_ids must be"),
    ({"prompt_token_ids": [1, 2]}, SamplingParams(stop_token_ids=list(range(1025))), "at most 1024 stop_token_ids"),
    ({"prompt_token_ids": [1, True]}, GREEDY, "prompt_token_ids must be integers"),
])
def test_bad_prompt_is_refused_and_changes_nothing(llm, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.engine.add_request("bad", prompt, params)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature must be 0"),
    ({"temperature": 1e-39}, "temperature must be 0 \\(greedy\\) or >= 0.01"),
    ({"temperature": float("nan")}, "temperature must be"),
    ({"seed": 2**64}, "seed must fit"),
    ({"max_tokens": 2**40}, "max_tokens must be in"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens \\(9\\) must not exceed"),
    ({"top_k": 2**40}, "top_k"),
    ({"cache_salt": ""}, "cache_salt must be"),
    ({"top_p": 0.0}, "top_p must be in"),
    ({"top_p": 1.01}, "top_p must be in"),
    ({"max_tokens": 0}, "max_tokens must be in"),
    ({"top_k": -3}, "top_k"),
    ({"n": 0}, "n must be in"),
    ({"n": 129}, "n must be in"),
])
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_bad_request_in_a_running_batch_harms_no_one(llm):
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20] * 17]
    clean = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"ok-{i}", {"prompt_token_ids": p}, GREEDY)
    done = {}
    for step in range(100):
        if step == 2:
            with pytest.raises(InvalidRequestError):
                engine.add_request("too-long", {"prompt_token_ids": [1] * 200}, GREEDY)
            engine.add_request("aborted", {"prompt_token_ids": [3] * 30}, SamplingParams(max_tokens=50))
        if step == 4:
            engine.abort_request("aborted")
            engine.check_integrity()
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert [done[f"ok-{i}"] for i in range(3)] == clean
    assert "aborted" not in done
    engine.check_integrity()
    assert engine.kv_cache.pool.usage() == 0.0


def test_priority_beyond_int64_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="priority must fit") as info:
        llm.engine.add_request("p", {"prompt_token_ids": [1, 2]}, GREEDY, priority=-(2**63) - 1)
    assert info.value.param == "priority" and not llm.engine.has_unfinished_requests()


def test_a_step_that_raises_fails_its_batch_and_the_engine_goes_on(llm):
    """A fault inside the model (here raised by a forward hook on the final norm, as a kernel error
    would be) ends the requests of that batch, frees their blocks, and the next request runs as if
    nothing happened. Three failed steps in a row mean the engine is broken: the error propagates (a
    worker then exits and is replaced)."""
    engine = llm.engine
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    clean = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    fault = {"on": False}

    def raise_when_on(module, args):
        if fault["on"]:
            raise RuntimeError("injected kernel fault")

    hook = engine.core.runner.model.norm.register_forward_pre_hook(raise_when_on)
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"victim-{i}", {"prompt_token_ids": p}, GREEDY)
        engine.step()  # both prefilled
        fault["on"] = True
        failed = engine.step()
        assert sorted((o.request_id, o.outputs[0].finish_reason) for o in failed) == [
            ("victim-0", "abort"), ("victim-1", "abort")]
        assert not engine.has_unfinished_requests()
        engine.check_integrity()
        assert engine.kv_cache.pool.usage() == 0.0
        fault["on"] = False
        again = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
        assert again == clean

        fault["on"] = True
        for i in range(2):
            engine.add_request(f"doomed-{i}", {"prompt_token_ids": prompts[0]}, GREEDY)
            assert [o.request_id for o in engine.step()] == [f"doomed-{i}"]
        engine.add_request("doomed-2", {"prompt_token_ids": prompts[0]}, GREEDY)
        with pytest.raises(RuntimeError, match="injected kernel fault"):
            engine.step()
    finally:
        hook.remove()
        engine.abort_request("doomed-2")
    engine.check_integrity()
    assert engine.kv_cache.pool.usage() == 0.0


def test_a_step_that_raises_before_its_kv_is_written_leaves_nothing_in_the_prefix_cache(llm):
    """The prompt's full blocks are indexed when the step is scheduled; a fault in the first layer means their
    KV was never written. They must leave the index with the failed request: the same prompt afterwards
    computes them again (nothing cached) and gives the clean output."""
    engine = llm.engine
    prompt = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
    clean = LLM(llm.engine.config.model, dtype="float32", max_model_len=64, block_size=4).generate(
        [{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0].token_ids

    def raise_always(module, args):
        raise RuntimeError("injected fault in layer 0")

    llm.generate([{"prompt_token_ids": [3, 4, 5]}], GREEDY)  # a step that succeeds: no failures in a row before
    hook = engine.core.runner.model.layers[0].register_forward_pre_hook(raise_always)
    try:
        engine.add_request("early-victim", {"prompt_token_ids": prompt}, GREEDY)
        assert [o.outputs[0].finish_reason for o in engine.step()] == ["abort"]
    finally:
        hook.remove()
    engine.check_integrity()
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
    assert out.metrics.num_cached_tokens == 0 and out.outputs[0].token_ids == clean


def test_cache_salt_separates_prefix_caches(llm):
    """Requests with different `cache_salt`s never share a block; equal salts (and no salt) do."""
    engine = llm.engine
    prompt = {"prompt_token_ids": list(range(3, 23))}  # 5 full blocks of 4

    def cached_tokens(salt: str | None) -> tuple[int, list[int]]:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, cache_salt=salt))[0]
        return out.metrics.num_cached_tokens, out.outputs[0].token_ids

    first, tokens = cached_tokens("tenant-a")
    assert first == 0
    assert cached_tokens("tenant-a") == (16, tokens)  # the last prompt token is always computed
    assert cached_tokens("tenant-b") == (0, tokens)
    assert cached_tokens(None) == (0, tokens)
    assert cached_tokens(None) == (16, tokens)
    engine.check_integrity()


def test_generate_validates_all_prompts_before_running_any(llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_missing_model_and_files(tmp_path, tiny_models):
    with pytest.raises(ConfigError, match="model not found"):
        LLM(str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="no config.json"):
        LLM(str(tmp_path))
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_models["llama"], no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        LLM(str(no_weights))
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_models["llama"], no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer"):
        LLM(str(no_tokenizer))


def test_unsupported_architecture_config(tmp_path, tiny_models):
    other = tmp_path / "gpt2"
    shutil.copytree(tiny_models["llama"], other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(other))


def test_quantized_checkpoints_are_refused_not_loaded_as_they_are(tmp_path, tiny_models):
    """An FP8 checkpoint (DeepSeek-V3's kind) read as plain weights would run and answer nonsense: refused, by
    its quantization_config, and by float8 tensors even without one."""
    from safetensors.torch import load_file, save_file

    declared = tmp_path / "declared"
    shutil.copytree(tiny_models["llama"], declared)
    cfg = json.loads((declared / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (declared / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"quantized checkpoints \(fp8\) are not supported"):
        LLM(str(declared))
    undeclared = tmp_path / "undeclared"
    shutil.copytree(tiny_models["llama"], undeclared)
    weights = load_file(str(undeclared / "model.safetensors"))
    name = next(n for n in weights if n.endswith("q_proj.weight"))
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_file(weights, str(undeclared / "model.safetensors"))
    with pytest.raises(ConfigError, match="float8_e4m3fn weights"):
        LLM(str(undeclared), dtype="float32")


def test_gguf_of_unsupported_architecture(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("KVBATON_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="GGUF architecture 'falcon' is not supported"):
        LLM(str(path))


def test_corrupt_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBATON_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        LLM(str(path))
