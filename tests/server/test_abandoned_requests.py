"""A client that leaves takes its request with it, on the real `kvbaton serve`: every admission entry
released (a choice that never started included), every engine request aborted and its blocks freed,
whatever the request was (streamed or not, n = 1 or many) and whenever the client left (at once, after
the first byte, mid-generation). Before, sixteen streamed `n: 16` chats whose client closed at once left
256 entries pending for good, and the server answered everyone after "server busy"."""

from __future__ import annotations

import json
import socket
from contextlib import ExitStack

import httpx
import pytest

from tests.support.server import stats, wait_idle
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow
CHAT = "/v1/chat/completions"


def _send(base: str, path: str, body: dict) -> socket.socket:
    """The request written on a raw socket (a client that can vanish at any byte); the open socket."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def _chat(n: int, stream: bool, max_tokens: int = 16) -> dict:
    return {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}], "n": n,
            "stream": stream, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}


def test_streams_whose_client_leaves_release_every_admission_entry(default_server):
    # 16 x n=16 = 256 choices: the server's whole admission queue, each chat closed before its first byte
    for _ in range(16):
        _send(default_server, CHAT, _chat(n=16, stream=True)).close()
    for _ in range(16):  # and 16 single streams closed after their first byte
        with _send(default_server, CHAT, _chat(n=1, stream=True, max_tokens=200)) as sock:
            assert sock.recv(1)
    wait_idle(default_server)
    ok = httpx.post(f"{default_server}{CHAT}", json=_chat(n=16, stream=False, max_tokens=2), timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 16, ok.text[:300]


def test_a_request_whose_client_leaves_mid_generation_is_aborted(default_server):
    """4 prompts x n=4, not streamed, each asking for 900 tokens: the client leaves while they run, and every
    one of the 16 sequences is aborted and its blocks freed, none run to its end."""
    wait_idle(default_server)
    before = stats(default_server)["router"]["aborted"]
    with ExitStack() as clients:
        for _ in range(4):
            clients.enter_context(_send(default_server, CHAT, _chat(n=4, stream=False, max_tokens=900)))
        wait_until(lambda: stats(default_server)["num_running"] >= 4, 60, message="the requests never started")
    after = wait_idle(default_server)
    assert after["router"]["aborted"] - before == 16, after["router"]
