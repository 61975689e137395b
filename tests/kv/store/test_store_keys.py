"""Store keys name the same block alike in every process, and differently under anything that changes its KV."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from kvbaton.kv.hashing import chained_block_hashes, salted_root
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.store.keys import KEY_BYTES, StoreKeys, model_fingerprint
from tests.support.procs import repo_python_env

LAYOUT = KVLayout.standard(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
TOKENS = list(range(100, 140))


def keys_here(model_dir: Path, salt: str | None = None, layout: KVLayout = LAYOUT) -> list[str]:
    keys = StoreKeys.of(model_fingerprint(model_dir), layout)
    return [k.hex() for k in keys.keys(chained_block_hashes(TOKENS, layout.block_size, salted_root(salt)))]


def fake_checkpoint(path: Path, weights: bytes) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_keys_are_identical_in_other_processes_whatever_their_hash_seed(tmp_path):
    model = fake_checkpoint(tmp_path / "m", os.urandom(300_000))
    code = textwrap.dedent(f"""
        import json
        from pathlib import Path
        from tests.kv.store.test_store_keys import keys_here
        print(json.dumps(keys_here(Path({str(model)!r}), "s")))
    """)
    theirs = [json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                        env=repo_python_env({"PYTHONHASHSEED": seed}), timeout=60).stdout)
              for seed in ("1", "2")]
    ours = keys_here(model, "s")
    assert theirs[0] == theirs[1] == ours
    assert len(ours) == len(TOKENS) // LAYOUT.block_size and all(len(bytes.fromhex(k)) == KEY_BYTES for k in ours)


def test_keys_differ_by_model_weights_layout_dtype_and_salt(tmp_path):
    weights = os.urandom(300_000)
    base = keys_here(fake_checkpoint(tmp_path / "a", weights))
    assert keys_here(fake_checkpoint(tmp_path / "b", weights)) == base  # same checkpoint elsewhere: same keys
    tuned = bytearray(weights)
    tuned[70_000::997] = os.urandom(len(tuned[70_000::997]))  # a fine-tune: same size and header, other bytes
    assert set(keys_here(fake_checkpoint(tmp_path / "c", bytes(tuned)))).isdisjoint(base)
    model = tmp_path / "a"
    others = [keys_here(model, salt="tenant-1"),
              keys_here(model, layout=KVLayout.standard(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                                                        dtype="float32")),
              keys_here(model, layout=KVLayout.standard(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8,
                                                        dtype="bfloat16"))]
    for other in others:
        assert set(other).isdisjoint(base)
