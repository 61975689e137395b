"""The frontend's image intake (`kvbaton/mm/images.py`) on real images built here with Pillow: the same pixels in
another lossless encoding hash alike, different pixels never do, and each hostile image (truncated, not an image,
a decompression bomb, 100 megapixels, too many bytes, a URL while URLs are off, an unlisted host, a redirect) is
refused with the reason before the work it would cost; allowed URLs are fetched from a real HTTP server on
127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import struct
import threading
import zlib
from collections.abc import Iterator

import pytest
from PIL import Image

from kvbaton.mm.images import (
    DecodedImage,
    ImageDecoder,
    ImageHold,
    ImageLimits,
    ImageRefused,
    allowed_url,
    data_url_bytes,
    decode_image,
)

# kvbaton/mm/images.py silences Pillow's bomb warning (its own bound is the one that counts) with a process-wide
# filter, which pytest replaces by its own in every test
pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")

LIMITS = ImageLimits(max_bytes=2**20, max_pixels=2**20)


def picture(seed: int = 0, size: tuple[int, int] = (48, 32)) -> Image.Image:
    im = Image.new("RGB", size)
    im.putdata([((x * 7 + seed) % 256, (y * 5) % 256, (x * y + seed) % 256)
                for y in range(size[1]) for x in range(size[0])])
    return im


def encoded(im: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **kwargs)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb_png(side: int) -> bytes:
    """A grayscale PNG of side x side zeros: ~side² / 1000 bytes on the wire, side² bytes decoded."""
    compress = zlib.compressobj(9)
    row = b"\x00" * (side + 1)  # filter byte + pixels
    idat = b"".join(compress.compress(row) for _ in range(side)) + compress.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def test_the_same_pixels_in_any_lossless_encoding_are_one_image_and_other_pixels_another():
    im = picture()
    as_png = decode_image(encoded(im, "PNG"), LIMITS)
    assert (as_png.width, as_png.height) == (48, 32) and as_png.rgb == im.tobytes()
    for fmt, kwargs in (("WEBP", {"lossless": True}), ("BMP", {}), ("PNG", {"compress_level": 0})):
        assert decode_image(encoded(im, fmt, **kwargs), LIMITS).digest == as_png.digest, fmt
    # a palette image or one with alpha comes out as RGB too
    assert decode_image(encoded(im.convert("RGBA"), "PNG"), LIMITS).digest == as_png.digest
    assert decode_image(encoded(picture(seed=1), "PNG"), LIMITS).digest != as_png.digest
    assert decode_image(encoded(picture(size=(32, 48)), "PNG"), LIMITS).digest != as_png.digest
    jpeg = decode_image(encoded(im, "JPEG", quality=90), LIMITS)  # lossy: other pixels, so another image
    assert (jpeg.width, jpeg.height) == (48, 32) and jpeg.digest != as_png.digest


def test_an_animation_is_its_first_frame():
    frames = [picture(seed=s) for s in (0, 9)]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(gif, LIMITS).digest == decode_image(encoded(frames[0].quantize().convert("RGB"), "PNG"),
                                                             LIMITS).digest


def test_a_data_url_decodes_and_its_declared_type_is_not_trusted():
    png = encoded(picture(), "PNG")
    assert data_url_bytes(data_url(png), LIMITS) == png
    assert data_url_bytes(data_url(png, "image/jpeg"), LIMITS) == png  # the header decides the format


@pytest.mark.parametrize(("url", "status", "why"), [
    ("data:image/png,rawbytes", 400, "must be base64"),
    ("data:image/png;base64,not*base64!", 400, "not valid base64"),
    ("data:image/png;base64", 400, "not a data: URL"),
    ("file:///etc/passwd", 400, "not 'file'"),
    ("http://127.0.0.1:1/x.png", 400, "image URLs are off"),
], ids=["not-base64", "bad-base64", "no-payload", "file-url", "url-while-urls-are-off"])
def test_a_bad_url_is_refused_with_the_reason(url, status, why):
    with pytest.raises(ImageRefused, match=why) as refused:
        asyncio.run(ImageDecoder(LIMITS).decode_all([url]))
    assert refused.value.status == status


def test_an_unlisted_host_is_refused_and_a_listed_one_is_not():
    limits = ImageLimits(allowed_hosts=frozenset({"images.example"}))
    assert allowed_url("https://images.example/cat.png", limits)
    for url in ("https://evil.example/cat.png", "https://images.example.evil.example/x", "http://127.0.0.1/x"):
        with pytest.raises(ImageRefused, match="not allowed"):
            allowed_url(url, limits)


def test_bytes_over_the_bound_are_refused_before_base64_is_decoded():
    limits = ImageLimits(max_bytes=1000)
    # not base64 at all: decoding it first would have answered that, so the size was checked before
    huge = "data:image/png;base64," + "*" * 50_000_000
    with pytest.raises(ImageRefused, match="over this server's 1000 bytes") as refused:
        data_url_bytes(huge, limits)
    assert refused.value.status == 413
    just_over = data_url(b"\x00" * 1001)  # within base64's rounding of the bound: caught once decoded
    with pytest.raises(ImageRefused, match="over this server's 1000 bytes"):
        data_url_bytes(just_over, limits)
    assert data_url_bytes(data_url(b"\x00" * 1000), limits) == b"\x00" * 1000


def hostile(case: str) -> tuple[bytes, str]:
    png = encoded(picture(size=(256, 256)), "PNG")
    if case == "truncated":
        return png[: len(png) // 2], "truncated or corrupt"
    if case == "not-an-image":
        return b"%PDF-1.7 definitely not a picture" * 10, "not an image"
    if case == "empty":
        return b"", "not an image"
    if case == "svg":  # a format this server does not read (Pillow does not either)
        return b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>', "not an image"
    if case == "100-megapixels":  # 100 MB decoded from ~100 KB, refused from its header
        return bomb_png(10000), "10000x10000 = 100.0 MP"
    # 20000 x 20000: past twice Pillow's own bound (89.5 MP), which refuses it at open: the answer is still ours
    return bomb_png(20000), "stated size is over this server's 16.8 MP"


@pytest.mark.parametrize("case", ["truncated", "not-an-image", "empty", "svg", "100-megapixels", "bomb"])
def test_a_hostile_image_is_refused_with_the_reason(case):
    data, why = hostile(case)
    with pytest.raises(ImageRefused, match=why) as refused:
        decode_image(data, ImageLimits(max_bytes=2**20, max_pixels=16 * 2**20))
    assert refused.value.status == 400


class Images(http.server.BaseHTTPRequestHandler):
    """Serves /ok.png, /big.png (over the bound, no content length), /moved (a redirect), /gone (404)."""

    png = b""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/ok.png":
            self._answer(200, self.png)
        elif self.path == "/big.png":
            self.send_response(200)
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\x00" * 65536)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/elsewhere.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._answer(404, b"")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def image_host() -> Iterator[str]:
    Images.png = encoded(picture(), "PNG")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_an_allowed_host_s_image_is_fetched_within_its_bounds(image_host):
    decoder = ImageDecoder(ImageLimits(max_bytes=2**20, allowed_hosts=frozenset({"127.0.0.1"})))

    async def run(url: str) -> list[DecodedImage]:
        return await decoder.decode_all([url])

    fetched = asyncio.run(run(f"{image_host}/ok.png"))
    assert fetched[0].digest == decode_image(encoded(picture(), "PNG"), LIMITS).digest
    for path, status, why in (("/big.png", 413, "over this server's"), ("/moved", 400, "HTTP 302"),
                              ("/gone", 400, "HTTP 404")):
        with pytest.raises(ImageRefused, match=why) as refused:
            asyncio.run(run(image_host + path))
        assert refused.value.status == status, path
    asyncio.run(decoder.aclose())


def test_a_request_s_images_are_bounded_in_count_and_the_decoders_in_what_waits():
    png_url = data_url(encoded(picture(), "PNG"))
    decoder = ImageDecoder(ImageLimits(max_images=3), threads=1, max_pending=4)

    async def scenario() -> None:
        with pytest.raises(ImageRefused, match="4 images, over this server's 3 a request"):
            await decoder.decode_all([png_url] * 4)
        images = await decoder.decode_all([png_url, data_url(encoded(picture(seed=3), "PNG")), png_url])
        assert images[0].digest == images[2].digest != images[1].digest
        # two requests of 3 images at once: the second would take the decoders past 4 pending, and is refused
        # whole (nothing of it decoded) while the first completes
        first = asyncio.ensure_future(decoder.decode_all([png_url] * 3))
        await asyncio.sleep(0)  # noqa: TID251 - lets the first request take its place in the queue
        with pytest.raises(ImageRefused, match="retry") as busy:
            await decoder.decode_all([png_url] * 3)
        assert busy.value.status == 503
        assert len(await first) == 3
        assert len(await decoder.decode_all([png_url] * 3)) == 3  # the slots came back
        await decoder.aclose()

    asyncio.run(scenario())


def test_decoded_pixels_are_bounded_per_request_and_over_the_requests_in_flight():
    png_url = data_url(encoded(picture(size=(100, 100)), "PNG"))  # 10 000 pixels
    decoder = ImageDecoder(ImageLimits(max_request_pixels=25_000, max_held_pixels=40_000))

    async def scenario() -> None:
        with pytest.raises(ImageRefused, match="over this server's 0.0 MP in all") as over:
            await decoder.decode_all([png_url] * 3)  # 30 000 > 25 000 for one request
        assert over.value.status == 400 and decoder.held_pixels == 0  # what it had reserved went back
        first, second = ImageHold(decoder), ImageHold(decoder)
        await decoder.decode_all([png_url] * 2, first)
        await decoder.decode_all([png_url] * 2, second)
        assert decoder.held_pixels == 40_000
        with pytest.raises(ImageRefused, match="fill this server's") as full:
            await decoder.decode_all([png_url])  # 10 000 more than the 40 000 in flight allow
        assert full.value.status == 503 and decoder.held_pixels == 40_000
        first.release()
        first.release()  # idempotent: every path that ends a request releases
        assert decoder.held_pixels == 20_000
        assert len(await decoder.decode_all([png_url])) == 1
        await decoder.aclose()

    asyncio.run(scenario())
