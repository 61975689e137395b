"""A vision-language model served E/P/D (`kvbaton serve --encode 1 --prefill 1 --decode 1`, the KV over tcp): chat
requests with `image_url` parts (base64 data: URLs) have their images encoded by the encoder worker and their
prompts prefilled by the prefill worker from its embeddings, and answer transformers' fp32 greedy tokens, their
image tokens counted in `usage` and by `/tokenize`; the same picture sent again in another lossless encoding is an
encoder-cache hit (`/metrics`); text-only turns of the same model are unharmed; each bad image or image request
gets a 4xx naming why while the server goes on serving; a burst beyond the encoder pool's queue is served or
refused with a 503; and an encoder worker SIGKILLed with requests in flight loses none of them (the language
workers encode their images, `--encode 0`'s path, until it is back).

The images are encoded where the prompt is computed (`--encode 0`) in `tests/mm/test_llava_parity.py`."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import random
import signal
import struct
import zlib

import httpx
import pytest
from PIL import Image

from tests.support.helpers import LLAVA_IMAGE_TOKEN, LLAVA_TOKENS_PER_IMAGE, build_tiny_llava, hf_llava_greedy
from tests.support.server import served, stats, wait_idle
from tests.support.wait import async_wait_until, wait_until

MAX_NEW = 6


def picture(seed: int) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", (40, 36), bytes(rng.randrange(256) for _ in range(40 * 36 * 3)))


def data_url(image: Image.Image, fmt: str = "PNG", **kwargs) -> str:
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(out.getvalue()).decode()}"


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def raw_data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(base: str, content: list[dict] | str) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": content}], "max_tokens": MAX_NEW, "temperature": 0,
        "ignore_eos": True})


def token_ids(text: str) -> list[int]:
    """The tiny tokenizer's ids of `text` (words t0..t319), each image token expanded to its placeholders."""
    ids = [int(word[1:]) for word in text.split()]
    return [i for t in ids for i in ([t] * LLAVA_TOKENS_PER_IMAGE if t == LLAVA_IMAGE_TOKEN else [t])]


def bomb(side: int) -> bytes:
    """A grayscale PNG of side x side zeros (a decompression bomb: ~side² / 1000 bytes on the wire)."""
    compress = zlib.compressobj(9)
    idat = b"".join(compress.compress(b"\x00" * (side + 1)) for _ in range(side)) + compress.flush()

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


ENCODE_QUEUE = 8


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    model = build_tiny_llava(tmp_path_factory.mktemp("llava"))
    # NOTE: a prompt of 8 tokens or more goes through the prefill worker: every image chat here does
    with served("--model", str(model), "--dtype", "float32", "--max-request-bytes", str(16 * 2**20),
                "--max-images-per-request", "2", "--max-image-pixels", str(2**20), "--encode", "1",
                "--encode-queue", str(ENCODE_QUEUE), "--prefill", "1", "--decode", "1", "--kv-transport", "tcp",
                "--local-prefill-threshold", "8") as server:
        yield model, server


def workers(base: str) -> dict[str, dict]:
    return {w["name"]: w for w in httpx.get(f"{base}/workers").json()["workers"]}


def test_chats_with_images_answer_transformers_tokens_and_a_repeated_image_hits_the_cache(vision_server):
    model, server = vision_server
    cases = [
        ("t5 t6 t319 t7", [{"type": "text", "text": "t5 t6"}, image_part(data_url(picture(1))),
                           {"type": "text", "text": "t7"}]),
        ("t319 t9 t319 t3", [image_part(data_url(picture(2))), {"type": "text", "text": "t9"},
                             image_part(data_url(picture(3))), {"type": "text", "text": "t3"}]),
        ("t11 t12 t13", "t11 t12 t13"),  # a text-only turn of the same model
        # picture 1 again, as lossless WebP: the same pixels, so the same image (an encoder-cache hit)
        ("t8 t319", [{"type": "text", "text": "t8"}, image_part(data_url(picture(1), "WEBP", lossless=True))]),
    ]
    images = {0: [picture(1)], 1: [picture(2), picture(3)], 2: [], 3: [picture(1)]}
    refs = hf_llava_greedy(model, [(token_ids(text), images[i]) for i, (text, _) in enumerate(cases)], MAX_NEW)
    for (text, content), ref in zip(cases, refs):
        resp = chat(server.base, content)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["choices"][0]["message"]["content"].split() == [f"t{t}" for t in ref], text
        assert body["usage"]["prompt_tokens"] == len(token_ids(text))  # the image tokens counted
        tokenized = httpx.post(f"{server.base}/tokenize", json={"messages": [{"role": "user", "content": content}]})
        assert tokenized.json()["tokens"] == token_ids(text), tokenized.text  # /tokenize counts them alike
    # the encoder worker's counters reach /metrics with its next load report; the language workers, which took
    # its embeddings, encoded nothing and missed nothing
    wait_until(lambda: (metric(server.base, "hits"), metric(server.base, "misses")) == (1, 3), 30,
               message=lambda: httpx.get(f"{server.base}/metrics").text[-3000:])
    encoder = workers(server.base)["kvbaton-encode-0"]["encode"]
    assert (encoder["encoded"], encoder["cache_hits"]) == (3, 1), encoder
    assert stats(server.base)["router"]["disaggregated"] >= 3  # the image chats' KV came from the prefill worker
    wait_idle(server.base)


def metric(base: str, name: str) -> float | None:
    """The encoder cache's `name` gauge in /metrics (None: not there)."""
    prefix = f"kvbaton:encoder_cache_{name}{{"
    return next((float(line.split()[-1]) for line in httpx.get(f"{base}/metrics").text.splitlines()
                 if line.startswith(prefix)), None)


@pytest.mark.parametrize(("content", "status", "why"), [
    ([image_part(raw_data_url(png_bytes(picture(5))[:300]))], 400, "truncated or corrupt"),
    ([image_part(raw_data_url(b"%PDF-1.7 not a picture"))], 400, "not an image"),
    ([image_part(raw_data_url(bomb(10000)))], 400, "10000x10000 = 100.0 MP"),
    ([image_part("data:image/png;base64,@@@@")], 400, "not valid base64"),
    ([image_part("http://127.0.0.1:1/cat.png")], 400, "image URLs are off"),
    ([image_part(data_url(picture(1)))] * 3, 400, "3 images, over this server's 2"),
    ([{"type": "text", "text": "t1"}, {"type": "image_url", "image_url": {}}], 400, "needs a url"),
], ids=["truncated", "not-an-image", "100-megapixels", "bad-base64", "url-while-urls-are-off", "too-many",
        "no-url"])
def test_a_bad_image_is_a_4xx_naming_why_and_the_server_serves_on(vision_server, content, status, why):
    _, server = vision_server
    resp = chat(server.base, content)
    assert resp.status_code == status, resp.text
    assert why in resp.json()["error"]["message"], resp.text
    assert chat(server.base, [{"type": "text", "text": "t1"}, image_part(data_url(picture(4)))]).status_code == 200


def test_a_burst_of_image_requests_is_served_or_refused_clearly_and_none_is_lost(vision_server):
    """200 image chats at once: each is answered (its tokens) or refused with a clear 503 (the encoder pool's
    queue bound, or the frontend decoders': 64 images waiting or decoding), within a deadline; at least the
    encoder pool's queue bound's worth is served, and the server is idle after."""
    _, server = vision_server
    urls = [data_url(picture(100 + i)) for i in range(20)]  # repeated: the encoder cache serves some

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int | str]:
        resp = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": f"t{1 + i % 300}"},
                                                      image_part(urls[i % len(urls)])]}],
            "max_tokens": 2, "temperature": 0, "ignore_eos": True})
        body = resp.json()
        return resp.status_code, (body["usage"]["completion_tokens"] if resp.status_code == 200
                                  else body["error"]["message"])

    async def burst() -> list[tuple[int, int | str]]:
        async with httpx.AsyncClient(base_url=server.base, timeout=180) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(200))), 240)

    results = list(asyncio.run(burst()))
    served = [tokens for status, tokens in results if status == 200]
    refused = [str(text) for status, text in results if status != 200]
    assert all(status in (200, 503) for status, _ in results), results
    assert all(tokens == 2 for tokens in served), served
    assert all("retry" in text for text in refused), refused[:3]
    assert len(served) >= ENCODE_QUEUE, (len(served), refused[:3])
    print(f"burst: {len(served)} served, {len(refused)} refused "
          f"({sum('encoder pool' in text for text in refused)} by the encoder pool's queue)")
    wait_idle(server.base)


def test_an_encoder_worker_killed_with_requests_in_flight_loses_none_of_them(vision_server):
    """SIGKILL the encoder worker while image chats wait for it (stopped first, so that all of them do; their
    images fill its queue, so one more, streamed, gets a 503 before its stream starts): each completes with
    transformers' tokens (its images encoded by the decode worker while no encoder worker is up).
    Last in this module: its encoder worker is being replaced (supervision: `tests/router/test_supervision.py`)."""
    model, server = vision_server
    pictures = [picture(300 + i) for i in range(ENCODE_QUEUE)]  # new to every cache: each must be encoded
    texts = [f"t{20 + i} t319 t{40 + i}" for i in range(len(pictures))]
    refs = hf_llava_greedy(model, [(token_ids(t), [p]) for t, p in zip(texts, pictures)], MAX_NEW)
    pid = workers(server.base)["kvbaton-encode-0"]["pid"]

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        return await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": f"t{20 + i}"},
                                                      image_part(data_url(pictures[i])),
                                                      {"type": "text", "text": f"t{40 + i}"}]}],
            "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})

    async def kill_mid_flight() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base, timeout=120) as client:
            os.kill(pid, signal.SIGSTOP)  # frozen: every chat's images wait at it, then it dies with them
            try:
                chats = [asyncio.create_task(one(client, i)) for i in range(len(pictures))]

                async def all_sent() -> bool:  # the router has sent it every chat's images
                    view = (await client.get("/workers")).json()["workers"]
                    return any(w["name"] == "kvbaton-encode-0" and w["in_flight"] == len(pictures) for w in view)

                await async_wait_until(all_sent, 30, interval_s=0.01, message="the chats did not reach the encoder")
                # its queue is at its bound now: a streamed chat is refused before its stream starts
                refused = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": [image_part(data_url(picture(299)))]}],
                    "max_tokens": 2, "stream": True})
                assert refused.status_code == 503 and "Retry-After" in refused.headers, refused.text
                assert "encoder pool's queue is full" in refused.json()["error"]["message"]
            finally:
                os.kill(pid, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*chats), 120)

    for resp, ref, text in zip(asyncio.run(kill_mid_flight()), refs, texts):
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"].split() == [f"t{t}" for t in ref], text
    counters = stats(server.base)["router"]
    assert counters["workers_lost"] >= 1 and counters["fallbacks"] >= len(pictures), counters
    wait_idle(server.base)
