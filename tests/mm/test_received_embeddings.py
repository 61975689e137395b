"""Image embeddings computed elsewhere (an encoder worker's, E/P/D) taken by an engine in the pixels' place: after
the trip through bytes (`mm/embeddings.py`), the greedy fp32 tokens are transformers', the language engine encodes
nothing, and embeddings that are not what they claim, or do not fit the model, are refused with nothing left held;
an encoder worker refuses a request whose embeddings would not fit a control frame."""

from __future__ import annotations

import pytest
import torch

from kvbaton import LLM, SamplingParams
from kvbaton.engine.core import EngineCore
from kvbaton.messages.router_worker import ImageEmbedding
from kvbaton.mm.embedding_bound import MAX_EMBEDDING_BYTES
from kvbaton.mm.embeddings import EmbeddingBytes, from_bytes, to_bytes
from kvbaton.mm.images import DecodedImage
from kvbaton.mm.vision import load_image_encoder
from kvbaton.sched.sampling_params import InvalidRequestError
from kvbaton.wire import MAX_CONTROL_FRAME_BYTES
from kvbaton.worker.roles.encode import oversized
from tests.mm.test_llava_parity import MAX_NEW, PROMPTS
from tests.support.helpers import build_tiny_llava, hf_llava_greedy


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    model = build_tiny_llava(tmp_path_factory.mktemp("llava"))
    return model, hf_llava_greedy(model, PROMPTS[:3], MAX_NEW)


def run(core: EngineCore, requests: dict[str, tuple[list[int], list[tuple[str, torch.Tensor]]]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for request_id, (ids, embeddings) in requests.items():
        req = core.new_request(request_id, ids, params, image_digests=[d for d, _ in embeddings])
        core.add_request(req, embeddings=embeddings)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    return list(tokens.values())


def test_embeddings_from_another_encoder_give_transformers_tokens(llava):
    model, refs = llava
    encoder = load_image_encoder(model, torch.float32)  # as an encoder worker holds it
    assert encoder is not None
    requests = {}
    for i, (ids, pictures) in enumerate(PROMPTS[:3]):
        images = [DecodedImage.of_pil(p) for p in pictures]
        sent = [to_bytes(e) for e in encoder.encode(images)]
        requests[f"r{i}"] = (ids, [(im.digest, from_bytes(s)) for im, s in zip(images, sent)])
    core = LLM(str(model), dtype="float32").engine.core
    assert run(core, requests) == refs
    stats = core.stats().encoder_cache
    assert stats is not None and (stats.hits, stats.misses, stats.entries) == (0, 0, 4), stats  # it encoded none
    assert core.runner.image_embeddings == {}


def test_embeddings_that_are_not_what_they_claim_are_refused(llava):
    model, refs = llava
    core = LLM(str(model), dtype="float32").engine.core
    ids, pictures = PROMPTS[0]
    image = DecodedImage.of_pil(pictures[0])
    good = load_image_encoder(model, torch.float32).encode([image])[0]  # type: ignore[union-attr]
    sent = to_bytes(good)
    for claim, why in ((EmbeddingBytes("float32", sent.rows, sent.cols + 1, sent.data), "are not"),
                       (EmbeddingBytes("int64", sent.rows, sent.cols, sent.data), "unknown dtype"),
                       (EmbeddingBytes("float32", 0, sent.cols, b""), "are not")):
        with pytest.raises(ValueError, match=why):
            from_bytes(claim)
    params = SamplingParams(max_tokens=2)
    for embeddings, why in (([(image.digest, good.to(torch.bfloat16))], "do not fit this model"),
                            ([(image.digest, good[:, :-1])], "do not fit this model"),
                            ([(image.digest, good[:-1])], "do not fit its placeholders"),
                            ([(image.digest, good)] * 2, "1 image placeholder runs, 2 images")):
        req = core.new_request("bad", ids, params, image_digests=[image.digest])
        with pytest.raises(InvalidRequestError, match=why):
            core.add_request(req, embeddings=embeddings)
    assert core.runner.image_embeddings == {} and core.stats().encoder_cache.entries == 0  # type: ignore[union-attr]
    assert run(core, {"ok": (ids, [(image.digest, good)])}) == refs[:1]  # nothing of them stayed behind


def test_embeddings_too_big_for_a_control_frame_are_refused_by_the_encoder_worker():
    """A request's embeddings go in one control frame (router, then a language worker): past the bound the encoder
    worker refuses the request (a 400 naming why) rather than send a frame the receiving socket would drop."""
    one = ImageEmbedding(digest="ab" * 32, dtype="bfloat16", rows=576, cols=4096, data=bytes(576 * 4096 * 2))
    assert oversized([one] * 6) is None  # six images of a 7B LLaVA: 27 MiB
    assert MAX_EMBEDDING_BYTES < MAX_CONTROL_FRAME_BYTES
    why = oversized([one] * 14)  # 63 MiB
    assert why is not None and "63.0 MiB, over the 60.0 MiB" in why and "send fewer images" in why
