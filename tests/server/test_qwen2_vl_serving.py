"""Qwen2-VL served E/P/D (`kvbaton serve --encode 1 --prefill 1 --decode 1`, the KV over tcp): chats with images of
different sizes (runs of placeholders as long as each size asks) answer transformers' fp32 greedy tokens. The
prefill worker places the images' multimodal RoPE positions from the sizes the encoder worker sent with their
embeddings, and the decode worker goes on from where the prompt's positions ended (behind the token index), for
tokens well past the prompt; `usage` and `/tokenize` count each image's placeholders as the processor lays them out.

Qwen2-VL encoded where the prompt is computed, its positions through chunked prefill and the prefix cache:
`tests/mm/test_sized_image_parity.py`."""

from __future__ import annotations

import httpx
import pytest

from tests.support.server import stats, wait_idle
from tests.support.vision import FAMILIES, api_messages, check_served_chats, encoded, picture, served_family
from tests.support.wait import wait_until

MAX_NEW = 10


@pytest.fixture(scope="module")
def qwen2_vl_server(tmp_path_factory, default_model_dir):
    # NOTE: every chat here is longer than 8 tokens: all go through the prefill worker
    with served_family("qwen2_vl", tmp_path_factory.mktemp("qwen2vl"), default_model_dir, "--encode", "1",
                       "--prefill", "1", "--decode", "1", "--kv-transport", "tcp",
                       "--local-prefill-threshold", "8") as s:
        yield s


def test_image_chats_answer_transformers_tokens_through_the_encoder_and_prefill_workers(qwen2_vl_server):
    model, server = qwen2_vl_server
    check_served_chats(server.base, FAMILIES["qwen2_vl"], model, [
        ["Look at this:", picture(1, (90, 50)), "What is it?"],  # 2 x 3 merged patches
        [picture(2, (40, 120)), "Describe it."],  # an image first: 4 x 1
        ["Two of them:", picture(3, (120, 120)), "and", picture(4, (60, 30)), "compare."]], MAX_NEW)  # 4x4, 1x2
    # an image the processor refuses (its sides 300x apart): a 400 naming why, before any worker
    refused = httpx.post(f"{server.base}/v1/chat/completions", json={
        "messages": api_messages([picture(5, (600, 2))]), "max_tokens": 2})
    assert refused.status_code == 400 and "differ by 200x" in refused.json()["error"]["message"], refused.text
    wait_until(lambda: encoded(server.base) == 4, 30,  # the encoder's counters come with its next load report
               message=lambda: f"the encoder worker encoded {encoded(server.base)} images, 4 expected")
    assert stats(server.base)["router"]["disaggregated"] >= 3  # the chats' KV came from the prefill worker
    wait_idle(server.base)
