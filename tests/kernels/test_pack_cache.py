"""Packed weight layouts kept on disk (`kvbaton.kernels.pack_cache`): a later start maps the bytes an earlier one
packed, and a file that is stale, corrupt, truncated or not safely ours is rebuilt, never used."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest
import torch

from kvbaton.config import CacheConfig, EngineConfig, ModelConfig
from kvbaton.engine.core import EngineCore
from kvbaton.kernels.linear import AMXLinear, PackedLinear
from kvbaton.kernels.pack_cache import PackCache, prune
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.text.tokenizer import eos_token_ids

KEY = {"model": "m", "plan": "p"}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVBATON_CACHE", str(tmp_path))
    return tmp_path / "packed"


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.packed": torch.randn(40, 64, generator=g).bfloat16(), "b.tiles": torch.randn(32, 64, generator=g)}


def _fill(cache: PackCache) -> dict[str, torch.Tensor]:
    w = _weights()
    return {"a.packed": cache.get("a.packed", lambda: PackedLinear.pack(w["a.packed"], torch.bfloat16, False)),
            "b.tiles": cache.get("b.tiles", lambda: AMXLinear.pack(w["b.tiles"].bfloat16()))}


def _never() -> torch.Tensor:
    raise AssertionError("packed again although the kept bytes are good")


def test_a_later_start_maps_what_the_first_packed(cache_dir):
    first = PackCache.for_model(Path("m"), KEY)
    packed = _fill(first)
    first.save()
    again = PackCache.for_model(Path("m"), KEY)
    assert again.hits == 2
    for name, tensor in packed.items():
        kept = again.get(name, _never)
        assert kept.dtype == tensor.dtype and torch.equal(kept, tensor)
        assert kept.data_ptr() % 64 == 0  # the kernels' loads want aligned weights


@pytest.mark.parametrize("spoil", ["key", "corrupt", "truncated", "group-writable"])
def test_a_file_that_is_not_right_is_rebuilt_never_used(cache_dir, spoil):
    first = PackCache.for_model(Path("m"), KEY)
    packed = _fill(first)
    first.save()
    key = KEY
    if spoil == "key":  # another plan: another file name; the same name under another key must not be read
        key = {**KEY, "plan": "q"}
        os.rename(first.path, PackCache.for_model(Path("m"), key).path)
    elif spoil == "corrupt":
        with open(first.path, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            f.write(b"\xff\x00\xff\x00\xff")
    elif spoil == "truncated":
        os.truncate(first.path, first.path.stat().st_size - 64)
    else:
        os.chmod(first.path, 0o660)
    again = PackCache.for_model(Path("m"), key)
    assert again.hits == 0
    assert torch.equal(_fill(again)["a.packed"], packed["a.packed"])  # packed anew, correctly
    again.save()
    assert PackCache.for_model(Path("m"), key).hits == 2  # and kept right this time


def test_old_files_are_pruned_beyond_the_budget(tmp_path):
    for i, size in enumerate((300, 300, 300)):
        f = tmp_path / f"m{i}.kvpack"
        f.write_bytes(b"x" * size)
        os.utime(f, (i, i))
    prune(tmp_path, keep=tmp_path / "m0.kvpack", max_bytes=700)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["m0.kvpack", "m2.kvpack"]  # the oldest other goes


def test_an_engine_packs_once_and_decodes_the_same_from_the_kept_bytes(cache_dir, tiny_models, monkeypatch):
    """The AVX2 row packs its many-row weights; a second engine maps them (packs nothing) and computes the same
    tokens."""
    model = tiny_models["llama"]
    eos = eos_token_ids(ModelConfig.from_dir(model), model)
    config = EngineConfig(model=str(model), dtype="bfloat16", compute_path="avx2", max_model_len=256,
                          cache=CacheConfig(num_blocks=64))
    outputs = []
    for start in range(2):
        if start == 1:
            monkeypatch.setattr(PackedLinear, "pack", staticmethod(lambda *args: _never()))
        core = EngineCore(config, model, eos)
        req = core.new_request("r", list(range(3, 40)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        core.add_request(req)
        while core.has_unfinished_requests():
            core.step()
        outputs.append(list(req.output_token_ids))
        core.close()
    assert len(list(cache_dir.glob("*.kvpack"))) == 1
    assert outputs[0] == outputs[1]


def test_saving_writes_the_tensors_where_they_lie(cache_dir):
    """The file is written tensor by tensor, never assembled in memory: a whole-file buffer (and a bytes copy of
    each tensor) raised a first start's peak RSS by ~0.65 GB for the default model's AVX2 panels."""
    cache = PackCache.for_model(Path("m"), KEY)
    big = {f"w{i}.packed": torch.full((1024, 1024), float(i)) for i in range(8)}  # 32 MiB of fp32
    for name, tensor in big.items():
        cache.get(name, lambda tensor=tensor: tensor)
    tracemalloc.start()
    try:
        cache.save()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"saving allocated {peak / 2**20:.1f} MiB of Python objects for 32 MiB of tensors"
    again = PackCache.for_model(Path("m"), KEY)
    assert again.hits == len(big)
    for name, tensor in big.items():
        assert torch.equal(again.get(name, _never), tensor)
