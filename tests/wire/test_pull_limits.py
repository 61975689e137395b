"""What libzmq does with a frame over ZMQ_MAXMSGSIZE, on the kind of PULL socket the router and the
workers bind: it reads the frame's size field, refuses before allocating or buffering the body, and
drops *that peer's connection* only; a legitimate peer on the same socket loses nothing.

(libzmq src/v2_decoder.cpp `size_ready`: a declared size above maxmsgsize fails with EMSGSIZE before
`init_size`; the stream engine then closes that connection.)"""

from __future__ import annotations

import socket
import struct
import time

import zmq

LIMIT = 4096


def zmtp_push_greeting() -> bytes:
    """A ZMTP 3.1 greeting and NULL-mechanism READY, byte for byte as libzmq's PUSH sends them (RFC 37)."""
    greeting = b"\xff" + b"\0" * 7 + b"\x01\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
    return greeting + b"\x04" + bytes([len(body)]) + body


def zmtp_connect(port: int) -> socket.socket:
    """A raw TCP peer through the ZMTP handshake: greeting and READY out, the socket's greeting and READY in
    (a frame sent before the handshake ends would be read as a handshake command)."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    raw.sendall(zmtp_push_greeting())
    got = b""
    while not (len(got) > 66 and len(got) >= 66 + got[65]):  # 64-byte greeting, then flags, size, READY body
        chunk = raw.recv(4096)
        assert chunk, "the PULL socket closed the connection during the handshake"
        got += chunk
    assert got[66:72] == b"\x05READY"
    return raw


def closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """Read (and discard) what the peer sends until it closes the connection, or the timeout."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not sock.recv(4096):
                return True
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
    return False


def test_an_oversized_frame_drops_only_the_attackers_connection():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.MAXMSGSIZE, LIMIT)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    legit, attacker = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    for s in (legit, attacker):
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
    raw = zmtp_connect(port)
    try:
        for i in range(100):
            legit.send(b"legit %d" % i)
        attacker.send(b"A" * (LIMIT + 1))  # a whole oversized frame from a ZeroMQ peer
        # a raw peer declares a 1 GiB frame and sends 16 bytes of it: refused on the size field alone
        raw.sendall(b"\x02" + struct.pack(">Q", 2**30) + b"B" * 16)
        attacker.send(b"after")  # its connection is gone with the oversized frame; this may come later
        for i in range(100, 200):
            legit.send(b"legit %d" % i)
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while sum(m.startswith(b"legit") for m in got) < 200 and time.monotonic() < deadline:
            if pull.poll(100):
                got.append(pull.recv())
        assert [m for m in got if m.startswith(b"legit")] == [b"legit %d" % i for i in range(200)]
        assert not any(len(m) > LIMIT or m.startswith(b"B") for m in got)
        assert closed_by_peer(raw, 5), "libzmq kept the raw peer's connection after a 1 GiB size field"
    finally:
        raw.close()
        for s in (legit, attacker, pull):
            s.close(linger=0)
        ctx.term()


def test_the_raw_peer_is_a_valid_zmtp_peer_below_the_limit():
    """The control for the test above: the same handshake with a small frame is delivered and kept open."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.MAXMSGSIZE, LIMIT)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    raw = zmtp_connect(port)
    try:
        raw.sendall(b"\x00\x05hello")
        assert pull.poll(5000) and pull.recv() == b"hello"
        assert not closed_by_peer(raw, 0.5)
    finally:
        raw.close()
        pull.close(linger=0)
        ctx.term()
