"""One OpenAI-compatible endpoint as a terminal client talks to it: the model it serves, answers as they stream.

Whatever goes wrong (no server at the URL, a refused key, a 4xx or 5xx, an error event in the stream,
a stream cut short) becomes a `ClientError` whose one-line message says what happened.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

import httpx

from kvbaton.client.sse import SSEDecoder, parse_event, sse_lines

CONNECT_TIMEOUT_S = 10.0


class ClientError(Exception):
    """A problem the user can act on; the CLI prints it on one line and exits with status 2."""


@dataclass(frozen=True)
class Endpoint:
    url: str  # the API base, e.g. http://127.0.0.1:8000/v1
    api_key: str | None = None
    timeout_s: float = 600.0  # the longest silence while waiting for the next byte

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ClientError(f"--url must start with http:// or https://, got {self.url!r}")

    def connect(self) -> httpx.Client:
        # NOTE: no keep-alive: between two turns a person may think for minutes, and a server that
        # closed the idle connection just as the next request reuses it would fail that request.
        return httpx.Client(timeout=httpx.Timeout(self.timeout_s, connect=CONNECT_TIMEOUT_S),
                            limits=httpx.Limits(max_keepalive_connections=0))

    def first_model(self, http: httpx.Client) -> str:
        """The first model the server lists at GET /models."""
        url = self._url("/models")
        try:
            resp = http.get(url, headers=self._headers())
        except httpx.HTTPError as exc:
            raise ClientError(_failure(url, exc)) from exc
        if resp.status_code != 200:
            raise ClientError(_refusal(url, resp))
        try:
            return str(resp.json()["data"][0]["id"])
        except (KeyError, IndexError, TypeError, ValueError):
            raise ClientError(f"{url} lists no model ({resp.text[:200]!r}); pass --model") from None

    def stream(self, http: httpx.Client, path: str, body: dict[str, Any]) -> Iterator[str]:
        """POST `body` (streamed) to `path`; yields the answer's text as it arrives."""
        url = self._url(path)
        try:
            with http.stream("POST", url, json={**body, "stream": True}, headers=self._headers()) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise ClientError(_refusal(url, resp))
                yield from _texts(sse_lines(resp.iter_text()), url)
        except httpx.HTTPError as exc:
            raise ClientError(_failure(url, exc)) from exc

    def _url(self, path: str) -> str:
        return self.url.rstrip("/") + path

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _texts(lines: Iterable[str], url: str) -> Iterator[str]:
    """The text of each streamed chunk, up to `[DONE]`; an error event or a cut stream raises."""
    decoder, finished = SSEDecoder(), False
    for line in chain(lines, [""]):  # the blank line ends an event the server left unterminated
        data = decoder.feed(line)
        if data is None:
            continue
        event = parse_event(data)
        if event.error:
            raise ClientError(f"{url} ended the answer with an error: {event.error}")
        if event.done:
            return
        finished = finished or event.finish_reason is not None
        if event.text:
            yield event.text
    if not finished:
        raise ClientError(f"{url} closed the stream before the answer was finished")


def _refusal(url: str, resp: httpx.Response) -> str:
    try:
        error = resp.json().get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return f"{url} answered {resp.status_code}: {message or resp.text[:200] or resp.reason_phrase}"


def _failure(url: str, exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect to {url}: {exc}"
    return f"request to {url} failed: {type(exc).__name__}: {exc}"
