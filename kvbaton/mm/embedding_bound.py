"""How many bytes of image embeddings one request may carry (E/P/D): they travel in one control frame, from the
encoder worker to the router and on to a language worker with the prompt, and the receiving socket drops a frame
over its bound. Torch-free: the router refuses a request over it at admission, before its images are encoded
(`Router.validate`), and an encoder worker checks what it made (`worker/roles/encode.py`)."""

from __future__ import annotations

from kvbaton.wire import MAX_CONTROL_FRAME_BYTES

MAX_EMBEDDING_BYTES = MAX_CONTROL_FRAME_BYTES - 4 * 2**20  # the rest: the prompt, its parameters, the framing


def embeddings_refusal(num_bytes: int, limit: int = MAX_EMBEDDING_BYTES) -> str | None:
    """Why a request's embeddings of `num_bytes` in all cannot travel, None if they can."""
    if num_bytes <= limit:
        return None
    return (f"the images' embeddings take {num_bytes / 2**20:.1f} MiB, over the {limit / 2**20:.1f} MiB a request may "
            "carry: send fewer images")
