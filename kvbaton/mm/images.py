"""The images a request carries, as the frontend takes them in: where their bytes come from, what they may cost,
and what they are once decoded.

A chat content part `{"type": "image_url", "image_url": {"url": ...}}` names its image by a `data:` URL (base64)
or, only where the operator allows its host, an http(s) URL (a server that fetches any URL a client names is an
SSRF hole: it reaches what only the server can). Every limit is checked before the work it bounds: the encoded
size before base64 is decoded (and while a fetch streams), the pixel count from the image's header before a
pixel is decoded (a decompression bomb states its size up front: a 100-megapixel PNG of zeros is 100 KB on the
wire and 300 MB decoded). What comes out is RGB pixels and their hash: the same picture sent as PNG, WebP
lossless or BMP is the same image (the encoder cache's key), different pixels never are.

Torch-free (the frontend imports it); decoding is CPU work, so `ImageDecoder` runs it on a few threads of its
own, never on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import hashlib
import io
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from kvbaton.config import ConfigError

# the formats a client may send (Pillow reads many more: each is parser code an attacker could aim at)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
FETCH_TIMEOUT_S = 10.0
# Pillow warns of an image over its MAX_IMAGE_PIXELS (89.5 MP) at open and refuses one over twice that: the bound
# that counts is ours (`ImageLimits.max_pixels`, checked right after open, before decoding), so its warning would
# only be a log line an attacker can write
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


class ImageRefused(ValueError):
    """An image the server does not take: the message names the content part and why; `status` is the HTTP
    status to answer with (400, 413 for bytes over the limit, 503 while the decoders are saturated)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, kw_only=True)
class ImageLimits:
    max_images: int = 8  # per request
    max_bytes: int = 8 * 2**20  # one image, encoded (after base64 decoding; a fetch's body)
    max_pixels: int = 4096 * 3072  # one image, width x height (12.6 MP)
    # a request's images together: their RGB goes to the worker in one frame (64 MiB: messages' control limit)
    max_request_pixels: int = 16 * 2**20
    # the decoded images of every request in flight (a request holds its own until it ends: a retry on another
    # worker sends them again): 128 MP is 384 MB of RGB; a request beyond waits for none, it is refused (503)
    max_held_pixels: int = 128 * 2**20
    # hosts http(s) image URLs may name (exact names, lower case); empty: only data: URLs
    allowed_hosts: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if min(self.max_images, self.max_bytes, self.max_pixels, self.max_request_pixels, self.max_held_pixels) < 1:
            raise ConfigError("--max-images-per-request, --max-image-bytes and --max-image-pixels must be >= 1")
        if Image.MAX_IMAGE_PIXELS and self.max_pixels > 2 * Image.MAX_IMAGE_PIXELS:  # Pillow refuses beyond
            raise ConfigError(f"--max-image-pixels must be <= {2 * Image.MAX_IMAGE_PIXELS} (Pillow's own bound)")


@dataclass(frozen=True)
class DecodedImage:
    digest: str  # sha256 of the size and the RGB pixels: what the encoder cache is keyed by
    width: int
    height: int
    rgb: bytes = field(repr=False)  # width x height x 3, row-major

    @classmethod
    def of_rgb(cls, width: int, height: int, rgb: bytes) -> DecodedImage:
        return cls(hashlib.sha256(f"{width}x{height}:".encode() + rgb).hexdigest(), width, height, rgb)

    @classmethod
    def of_pil(cls, image: Image.Image) -> DecodedImage:
        """An image already decoded (the offline engine's callers hand PIL images over)."""
        rgb = image.convert("RGB")
        return cls.of_rgb(rgb.width, rgb.height, rgb.tobytes())

    def to_pil(self) -> Image.Image:
        return Image.frombytes("RGB", (self.width, self.height), self.rgb)


def data_url_bytes(url: str, limits: ImageLimits, where: str = "image_url") -> bytes:
    """A `data:[<type>][;base64],<payload>` URL's bytes, its size checked before the payload is decoded. The
    declared media type is not trusted (the image's own header decides its format)."""
    header, comma, payload = url.partition(",")
    if not comma or not header.startswith("data:"):
        raise ImageRefused(f"{where}: not a data: URL")
    if not header.endswith(";base64"):
        raise ImageRefused(f"{where}: a data: URL's image must be base64 (data:image/png;base64,...)")
    if len(payload) > 4 * (limits.max_bytes // 3 + 1) + 4:  # base64's 4 characters per 3 bytes, and padding
        raise ImageRefused(f"{where}: the image is over this server's {limits.max_bytes} bytes", 413)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused(f"{where}: the data: URL's payload is not valid base64") from None
    if len(data) > limits.max_bytes:
        raise ImageRefused(f"{where}: the image is over this server's {limits.max_bytes} bytes", 413)
    return data


def allowed_url(url: str, limits: ImageLimits, where: str = "image_url") -> str:
    """`url` if it is an http(s) URL of an allowed host, else why not."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ImageRefused(f"{where}: an image is a data: URL or an http(s) URL, not {parts.scheme or url[:20]!r}")
    if not limits.allowed_hosts:
        raise ImageRefused(f"{where}: image URLs are off on this server: send the image as a data: URL")
    host = (parts.hostname or "").lower()
    if host not in limits.allowed_hosts:
        raise ImageRefused(f"{where}: images from host {host[:80]!r} are not allowed on this server")
    return url


async def fetch_image(client: httpx.AsyncClient, url: str, limits: ImageLimits, where: str = "image_url") -> bytes:
    """An allowed URL's body, at most `limits.max_bytes` of it read (no redirects: a redirect could lead
    anywhere the allow-list does not)."""
    try:
        async with client.stream("GET", url, follow_redirects=False, timeout=FETCH_TIMEOUT_S) as resp:
            if resp.status_code != 200:
                raise ImageRefused(f"{where}: fetching the image answered HTTP {resp.status_code}")
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limits.max_bytes:
                raise ImageRefused(f"{where}: the image is over this server's {limits.max_bytes} bytes", 413)
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > limits.max_bytes:
                    raise ImageRefused(f"{where}: the image is over this server's {limits.max_bytes} bytes", 413)
            return bytes(body)
    except httpx.HTTPError as exc:
        raise ImageRefused(f"{where}: fetching the image failed ({type(exc).__name__})") from None


def decode_image(data: bytes, limits: ImageLimits, where: str = "image_url",
                 reserve: Callable[[int, str], None] | None = None) -> DecodedImage:
    """`data` decoded to RGB (an animation's first frame), its size checked from the header first; `reserve`
    (pixels, where) may refuse the pixels before they are decoded."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:  # reads the header only
            width, height = im.size
            if width * height > limits.max_pixels:
                raise ImageRefused(f"{where}: the image is {width}x{height} = {width * height / 1e6:.1f} MP, over "
                                   f"this server's {limits.max_pixels / 1e6:.1f} MP")
            if reserve is not None:
                reserve(width * height, where)
            rgb = im.convert("RGB").tobytes()  # decodes: a truncated or corrupt image fails here
    except ImageRefused:
        raise
    except Image.DecompressionBombError:  # Pillow's own bound, far above ours: its header said so
        raise ImageRefused(f"{where}: the image's stated size is over this server's "
                           f"{limits.max_pixels / 1e6:.1f} MP") from None
    except UnidentifiedImageError:
        raise ImageRefused(f"{where}: not an image this server reads ({', '.join(FORMATS)})") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:  # what Pillow's decoders raise on bad data
        raise ImageRefused(f"{where}: the image is truncated or corrupt ({type(exc).__name__})") from None
    return DecodedImage.of_rgb(width, height, rgb)


class ImageHold:
    """The decoded pixels one request holds of its decoder's budget, from their header check until `release`
    (idempotent: every path that ends the request calls it)."""

    def __init__(self, decoder: ImageDecoder) -> None:
        self._decoder = decoder
        self.pixels = 0

    def reserve(self, pixels: int, where: str) -> None:
        """Called on a decoding thread, before the pixels are decoded: ImageRefused if they would not fit."""
        decoder, limits = self._decoder, self._decoder.limits
        with decoder._lock:
            if self.pixels + pixels > limits.max_request_pixels:
                raise ImageRefused(f"{where}: the request's images are over this server's "
                                   f"{limits.max_request_pixels / 1e6:.1f} MP in all")
            if decoder.held_pixels + pixels > limits.max_held_pixels:
                raise ImageRefused(f"{where}: the images of the requests in flight fill this server's "
                                   f"{limits.max_held_pixels / 1e6:.0f} MP; retry", 503)
            self.pixels += pixels
            decoder.held_pixels += pixels

    def release(self) -> None:
        with self._decoder._lock:
            self._decoder.held_pixels -= self.pixels
            self.pixels = 0


class ImageDecoder:
    """Takes a request's image URLs to decoded images off the event loop: base64 and pixels on `threads` threads of
    its own, fetches (allowed hosts only) on the loop's client. At most `max_pending` images wait or decode at
    once, a request that would go beyond refused (503) whole before any of its images is decoded; the decoded
    pixels of all requests in flight are bounded too (`ImageLimits.max_held_pixels`, `ImageHold`)."""

    def __init__(self, limits: ImageLimits, threads: int = 2, max_pending: int = 64) -> None:
        self.limits = limits
        self.max_pending = max_pending
        self.held_pixels = 0  # by the requests in flight (under _lock: the decoding threads reserve)
        self._lock = threading.Lock()
        self._pending = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kvbaton-images")
        self._client: httpx.AsyncClient | None = None

    async def decode_all(self, urls: list[str], hold: ImageHold | None = None) -> list[DecodedImage]:
        """Every image of a request, in order, its pixels held by `hold` (released here if one fails);
        ImageRefused naming the first that fails."""
        if len(urls) > self.limits.max_images:
            raise ImageRefused(f"image_url: {len(urls)} images, over this server's {self.limits.max_images} a request")
        if self._pending + len(urls) > self.max_pending:
            raise ImageRefused(f"image_url: {self._pending} images are being decoded, this server's most; retry", 503)
        hold = hold if hold is not None else ImageHold(self)
        self._pending += len(urls)
        try:
            # NOTE: every image runs to its end before the first failure is raised: one still decoding would
            # reserve its pixels after the hold was released
            done = await asyncio.gather(*(self._one(url, f"image {i}", hold) for i, url in enumerate(urls)),
                                        return_exceptions=True)
        finally:
            self._pending -= len(urls)
        failure = next((d for d in done if isinstance(d, BaseException)), None)
        if failure is not None:
            hold.release()
            raise failure
        return [d for d in done if isinstance(d, DecodedImage)]

    async def _one(self, url: str, where: str, hold: ImageHold) -> DecodedImage:
        loop = asyncio.get_running_loop()
        if url.startswith("data:"):
            data = await loop.run_in_executor(self._pool, data_url_bytes, url, self.limits, where)
        else:
            allowed_url(url, self.limits, where)
            if self._client is None:
                self._client = httpx.AsyncClient(trust_env=False)  # no proxy from the environment
            data = await fetch_image(self._client, url, self.limits, where)
        return await loop.run_in_executor(self._pool, decode_image, data, self.limits, where, hold.reserve)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        self._pool.shutdown(wait=False, cancel_futures=True)
