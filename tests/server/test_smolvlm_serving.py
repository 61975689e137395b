"""SmolVLM / Idefics3 served E/P/D (`kvbaton serve --encode 1 --prefill 1 --decode 1`, the KV over shm): chats with
images of different tile grids, several in a chat, an image first, answer transformers' fp32 greedy tokens; their
prompts are the processor's token for token (`usage` and `/tokenize` count each image's tiles, tags and global
image); the encoder worker encodes every image and the language workers none.

LLaVA's deployment (the KV over tcp) and the image faults are in `test_vision_serving.py`; SmolVLM encoded where
the prompt is computed, in `tests/mm/test_sized_image_parity.py`."""

from __future__ import annotations

import httpx
import pytest

from tests.support.server import stats, wait_idle
from tests.support.vision import FAMILIES, check_served_chats, encoded, picture, served_family
from tests.support.wait import wait_until

MAX_NEW = 6


@pytest.fixture(scope="module")
def smolvlm_server(tmp_path_factory, default_model_dir):
    # NOTE: every chat here is longer than 8 tokens: all go through the prefill worker
    with served_family("idefics3", tmp_path_factory.mktemp("smolvlm"), default_model_dir, "--encode", "1",
                       "--prefill", "1", "--decode", "1", "--kv-transport", "shm",
                       "--local-prefill-threshold", "8") as s:
        yield s


def test_tiled_image_chats_answer_transformers_tokens_through_the_encoder_worker(smolvlm_server):
    model, server = smolvlm_server
    check_served_chats(server.base, FAMILIES["idefics3"], model, [
        ["Look at this:", picture(1, (70, 50)), "What is it?"],  # 3 x 3 tiles and the global image
        [picture(2, (30, 90)), "Describe it."],  # an image first: 3 x 1
        ["Two of them:", picture(3, (96, 20)), "and", picture(4, (50, 70)), "compare."]], MAX_NEW)  # 1 x 3, 3 x 3
    # a tile grid depends on the image's size: /tokenize decodes the images, in the generation requests' bounds
    broken = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]}]
    refused = httpx.post(f"{server.base}/tokenize", json={"messages": broken})
    assert refused.status_code == 400 and "image 0" in refused.json()["error"]["message"], refused.text
    wait_until(lambda: encoded(server.base) == 4, 30,  # the encoder's counters come with its next load report
               message=lambda: f"the encoder worker encoded {encoded(server.base)} images, 4 expected")
    assert stats(server.base)["router"]["disaggregated"] >= 3  # the chats' KV came from the prefill worker
    wait_idle(server.base)
