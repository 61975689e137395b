"""ZeroMQ CURVE encryption of kvbaton's sockets (`kvbaton serve --encrypt-traffic`).

Both keypairs come from the cluster secret, so every process that holds it (the router, every
worker) derives the same two without exchanging anything: one for sockets that bind (CURVE
servers), one for sockets that connect (CURVE clients).

    server secret key = BLAKE2b-256(cluster secret, person="kvbaton-curve-sv")   public = curve_public(it)
    client secret key = BLAKE2b-256(cluster secret, person="kvbaton-curve-cl")   public = curve_public(it)

NOTE: no ZAP handler is installed, so a server takes any client key; what keeps strangers out is
that a client must know the server's public key to complete the handshake (CurveZMQ never sends
it), and only holders of the secret can derive it. Every frame is HMAC-signed besides (`signed`,
`sequenced`): CURVE adds confidentiality, not a second authority.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

SERVER_PERSON = b"kvbaton-curve-sv"  # blake2b personalization: at most 16 bytes, one per key
CLIENT_PERSON = b"kvbaton-curve-cl"


class CurveUnavailable(RuntimeError):
    """Encryption was asked for, but this libzmq was built without CURVE."""


def require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveUnavailable(f"--encrypt-traffic needs ZeroMQ CURVE, and this libzmq ({zmq.zmq_version()}) "
                               "was built without it")


@dataclass(frozen=True)
class Keypair:
    public: bytes  # Z85, 40 bytes
    secret: bytes = field(repr=False)  # Z85, 40 bytes; never in a log line

    @classmethod
    def derive(cls, cluster_secret: bytes, person: bytes) -> Keypair:
        secret = z85.encode(hashlib.blake2b(cluster_secret, digest_size=32, person=person).digest())
        return cls(zmq.curve_public(secret), secret)


@dataclass(frozen=True)
class CurveKeys:
    """The cluster's two keypairs. `serve` before a socket binds, `connect` before it connects."""

    server: Keypair
    client: Keypair

    @classmethod
    def from_secret(cls, cluster_secret: bytes) -> CurveKeys:
        """CurveUnavailable without CURVE in libzmq; ValueError for a secret under 16 bytes."""
        require_curve()
        if len(cluster_secret) < 16:
            raise ValueError("cluster secret must be at least 16 bytes")
        return cls(Keypair.derive(cluster_secret, SERVER_PERSON), Keypair.derive(cluster_secret, CLIENT_PERSON))

    def serve(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.server.secret
        sock.curve_publickey = self.server.public
        sock.curve_server = True

    def connect(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server.public
        sock.curve_secretkey = self.client.secret
        sock.curve_publickey = self.client.public


def curve_keys(cluster_secret: bytes, encrypt: bool) -> CurveKeys | None:
    """The keys if `encrypt`, else None (plain sockets); what `curve_server`/`curve_client` take."""
    return CurveKeys.from_secret(cluster_secret) if encrypt else None


def curve_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make `sock` (before it binds) a CURVE server, or leave it plain for None."""
    if keys is not None:
        keys.serve(sock)


def curve_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make `sock` (before it connects) a CURVE client, or leave it plain for None."""
    if keys is not None:
        keys.connect(sock)
