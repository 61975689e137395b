"""What the server lets in: request bodies of bounded size, and the admin routes only for those meant to use them.

Admin routes (`/admin/*`, and `/workers`, which shows PIDs and addresses):

    bound to        admin key set        no admin key
    loopback        Bearer ADMIN_KEY     open (or Bearer API_KEY when --api-key is set, as before)
    other address   Bearer ADMIN_KEY     disabled (403 saying how to enable them)

Bound to loopback, the Host header must also name loopback (a DNS-rebinding page sends its own
name), and a browser's Origin, when sent, must be the Host itself (a cross-site form POST cannot
set a header, but its Origin gives it away).

Bound to loopback without `--api-key`, every other route asks the same of Host, and of Origin that it
names loopback: else a web page the developer visits could rebind its name to 127.0.0.1 and run
completions on the developer's machine, or probe its prefix cache through `cached_tokens`. (With an
API key the key guards /v1, and a reverse proxy on the same host may forward its public name.)
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvbaton.server.errors import HttpError

EMPTY: Mapping[str, tuple[int, str]] = MappingProxyType({})

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ADMIN_PATHS = ("/admin", "/workers", "/experts")  # /experts: routing statistics say something of the traffic


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_matches(headers: Headers, key: str) -> bool:
    return hmac.compare_digest(headers.get("authorization", "").encode(), f"Bearer {key}".encode())


@dataclass(frozen=True, kw_only=True)
class AdminAccess:
    bind_host: str
    admin_api_key: str | None = None
    api_key: str | None = None  # guards the admin routes only when bound to loopback without an admin key

    def refusal(self, headers: Headers) -> HttpError | None:
        """Why this request may not use an admin route, or None."""
        loopback = is_loopback(self.bind_host)
        if not loopback and not self.admin_api_key:
            return HttpError(403, f"the admin routes and /workers are disabled: this server listens on "
                                  f"{self.bind_host}, beyond loopback, without an admin key; restart it with "
                                  f"--admin-api-key KEY (or $KVBATON_ADMIN_API_KEY) to enable them",
                             "PermissionDeniedError")
        host = headers.get("host", "")
        if loopback and not is_loopback(_hostname(host)):
            return HttpError(403, f"admin requests must name this server by a loopback name, not Host {host[:80]!r}",
                             "PermissionDeniedError")
        origin = headers.get("origin")
        if origin is not None and _netloc(origin).lower() != host.lower():
            return HttpError(403, f"cross-origin admin requests are refused (Origin {origin[:80]!r})",
                             "PermissionDeniedError")
        key = self.admin_api_key or (self.api_key if loopback else None)
        if key and not bearer_matches(headers, key):
            return HttpError(401, "invalid or missing admin API key", "AuthenticationError")
        return None


class AccessCheck:
    """ASGI middleware: `--api-key` on /v1/*, the admin routes as `AdminAccess` decides.

    A plain ASGI class, not `@app.middleware("http")`: Starlette's BaseHTTPMiddleware hands the app a
    `receive` that never reports a disconnect to `Request.is_disconnected()`, so a non-streamed request
    whose client left went on computing to its last token."""

    def __init__(self, app: ASGIApp, admin: AdminAccess, api_key: str | None) -> None:
        self.app = app
        self.admin = admin
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope["path"], Headers(scope=scope))
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, path: str, headers: Headers) -> HttpError | None:
        if path.startswith(ADMIN_PATHS):
            return self.admin.refusal(headers)
        if self.api_key:
            if path.startswith("/v1") and not bearer_matches(headers, self.api_key):
                return HttpError(401, "invalid or missing API key", "AuthenticationError")
            return None
        return foreign_name_refusal(headers) if is_loopback(self.admin.bind_host) else None


def foreign_name_refusal(headers: Headers) -> HttpError | None:
    """Why a loopback-bound server refuses this request (named by a foreign Host, or sent from a page that
    is not itself on loopback), or None."""
    host = headers.get("host", "")
    if not is_loopback(_hostname(host)):
        return HttpError(403, f"this server listens on loopback and answers loopback names only (localhost, "
                              f"127.0.0.1, [::1]), not Host {host[:80]!r}; to serve other names, bind it beyond "
                              f"loopback or set --api-key", "PermissionDeniedError")
    origin = headers.get("origin")
    if origin is not None and not is_loopback(_hostname(_netloc(origin))):
        return HttpError(403, f"requests from web pages beyond loopback are refused (Origin {origin[:80]!r})",
                         "PermissionDeniedError")
    return None


def _hostname(netloc: str) -> str:
    try:
        return urlsplit(f"//{netloc}").hostname or ""
    except ValueError:  # e.g. an unclosed "[" (not an IPv6 address): no name at all
        return ""


def _netloc(url: str) -> str:
    try:
        return urlsplit(url).netloc
    except ValueError:
        return ""


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413 as soon as it is known to be:
    up front from Content-Length, else while it is read. The app gets the body already read, so nothing
    downstream buffers more than the limit.

    Before the 413, what the client is still sending is read and dropped, up to `DRAIN_MAX_BYTES` or
    `DRAIN_MAX_S` (nginx's lingering close): a server that answers and closes mid-upload makes the client's
    kernel see a reset, and urllib or httpx then report "connection reset" instead of the 413. Beyond those
    bounds (a 2 GB upload, a client trickling bytes) the connection is cut as before; a client that sent
    `Expect: 100-continue` has sent nothing yet and is answered at once."""

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: Mapping[str, tuple[int, str]] = EMPTY) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = path_limits  # path -> (its limit, the flag that sets it): e.g. a KV session upload

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes, flag = self.path_limits.get(scope["path"], (self.max_bytes, "--max-request-bytes"))
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            if int(length) <= DRAIN_MAX_BYTES and headers.get("expect", "").lower() != "100-continue":
                await _drain(receive, DRAIN_MAX_BYTES)
            await self._too_large(scope, send, max_bytes, flag)
            return
        chunks, size, last = [], 0, None
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see it
                last = message
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                if message.get("more_body", False):
                    await _drain(receive, DRAIN_MAX_BYTES - size)
                await self._too_large(scope, send, max_bytes, flag)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), last, receive), send)

    async def _too_large(self, scope: Scope, send: Send, max_bytes: int, flag: str) -> None:
        error = HttpError(413, f"request body exceeds {max_bytes} bytes ({flag})", "RequestTooLargeError")
        await error.response(headers={"Connection": "close"})(scope, _no_receive, send)


DRAIN_MAX_BYTES = 64 * 2**20
DRAIN_MAX_S = 10.0


async def _drain(receive: Receive, max_bytes: int) -> None:
    """Read and drop the request's body until its end, `max_bytes`, `DRAIN_MAX_S` or the client leaving."""

    async def read() -> None:
        left = max_bytes
        while left > 0:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            left -= len(message.get("body", b""))

    try:
        await asyncio.wait_for(read(), DRAIN_MAX_S)
    except asyncio.TimeoutError:
        return


def _replay(body: bytes, last: Message | None, receive: Receive) -> Receive:
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    if last is not None:
        pending.append(last)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}
