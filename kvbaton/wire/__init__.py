"""The bottom of the process stack: typed frames between kvbaton processes, and the thread that owns
their sockets (`SignedCodec`; `SequencedCodec` where replays matter), and the sockets' optional CURVE
encryption (`curve`). Used by `kv` (transports), `engine`, `router` and `worker` (router <-> worker); imports
none of them.
"""

from kvbaton.wire.codec import MAX_CONTROL_FRAME_BYTES, ChannelError, Codec, MalformedMessage
from kvbaton.wire.curve import CurveKeys, CurveUnavailable, curve_client, curve_keys, curve_server, require_curve
from kvbaton.wire.io_thread import IOThread
from kvbaton.wire.sequenced import SESSION_BYTES, Header, Peer, Received, SequencedCodec
from kvbaton.wire.signed import SECRET_ENV, SignedCodec, cluster_secret

__all__ = ["MAX_CONTROL_FRAME_BYTES", "SECRET_ENV", "SESSION_BYTES", "ChannelError", "Codec", "CurveKeys",
           "CurveUnavailable", "Header", "IOThread", "MalformedMessage", "Peer", "Received", "SequencedCodec",
           "SignedCodec", "cluster_secret", "curve_client", "curve_keys", "curve_server", "require_curve"]
