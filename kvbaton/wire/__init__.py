"""The bottom of the process stack: typed frames between kvbaton processes, and the thread that owns
their sockets. Used by `kv` (transports), `engine` and `disagg` (router <-> worker); imports none of them.
"""

from kvbaton.wire.codec import MAX_CONTROL_FRAME_BYTES, ChannelError, Codec
from kvbaton.wire.io_thread import IOThread
from kvbaton.wire.signed import SECRET_ENV, SignedCodec, cluster_secret

__all__ = ["MAX_CONTROL_FRAME_BYTES", "SECRET_ENV", "ChannelError", "Codec", "IOThread", "SignedCodec",
           "cluster_secret"]
