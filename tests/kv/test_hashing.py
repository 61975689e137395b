"""The content address of a KV block is the same in every process on every host: fixed bytes
(little-endian int64 token ids), no per-process seed; these values must never change silently
(the prefix cache, the router's prefix index and later the shared KV tiers all key on them)."""

from __future__ import annotations

import struct
import subprocess
import sys

from kvbaton.kv.hashing import chained_block_hashes, hash_block_tokens, token_bytes

ROOT_1234 = "05ca62eedbcbca52c72437aa6f79308e"  # hash_block_tokens(None, [1, 2, 3, 4])


def test_token_bytes_are_little_endian_int64_on_any_host():
    ids = [0, 1, -2, 49151, 2**40]
    assert token_bytes(ids) == struct.pack(f"<{len(ids)}q", *ids)


def test_block_hash_is_a_fixed_value():
    assert hash_block_tokens(None, [1, 2, 3, 4]).hex() == ROOT_1234
    assert hash_block_tokens(bytes.fromhex(ROOT_1234), [5, 6, 7, 2**40]).hex() == "3236e64ccb1e1bec25a5fbc8d93515c8"


def test_block_hash_is_the_same_in_another_process():
    code = "from kvbaton.kv.hashing import hash_block_tokens; print(hash_block_tokens(None, [1, 2, 3, 4]).hex())"
    env_seeds = [{"PYTHONHASHSEED": seed} for seed in ("0", "12345")]  # a per-process hash seed must not matter
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env}, check=True,
                           timeout=60).stdout.strip() for env in env_seeds}
    assert outs == {ROOT_1234}


def test_chained_hashes_cover_full_blocks_only_and_resume_from_a_parent():
    tokens = list(range(10, 31))  # 5 full blocks of 4 and one token
    hashes = chained_block_hashes(tokens, 4)
    assert len(hashes) == 5 and hashes[0] == hash_block_tokens(None, tokens[:4])
    assert chained_block_hashes(tokens, 4, parent=hashes[1], start_block=2) == hashes[2:]
    assert chained_block_hashes(tokens, 4, num_blocks=2) == hashes[:2]
