"""A worker's command socket refuses what the cluster did not sign (unauthenticated, forged,
malformed, pickled, oversized), logs it, and goes on serving; workers are named in `ps`."""

from __future__ import annotations

import pickle
from pathlib import Path

import msgspec
import zmq

from kvbaton.messages.router_worker import Shutdown, ToWorker
from kvbaton.wire import MAX_CONTROL_FRAME_BYTES, SignedCodec
from tests.support.helpers import hf_greedy, tiny_prompts
from tests.support.pd import collect, router_over, run
from tests.support.wait import async_wait_until


def test_bad_frames_are_refused_and_the_worker_keeps_serving(tiny_llama, tmp_path):
    prompt = tiny_prompts(3, [12])[0]

    log = tmp_path / "kvbaton-both-0.log"

    async def scenario():
        async with router_over(tiny_llama, prefill=0, decode=1, log_dir=tmp_path) as router:
            worker = router.pool.workers["kvbaton-both-0"]
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(worker.address)
            unsigned = msgspec.msgpack.encode(Shutdown())
            forged = SignedCodec(b"not-the-cluster-secret!", ToWorker).encode(Shutdown())
            evil = pickle.dumps(("os.system", "touch /tmp/kvbaton-pwned"))
            for frame in (unsigned, forged, b"\x00" * 8, evil, forged[:32] + evil,
                          b"x" * (MAX_CONTROL_FRAME_BYTES + 1)):
                sock.send(frame)
            sock.close()
            ctx.term()
            # the worker has refused the bad frames (each is logged) before it is asked to serve again
            await async_wait_until(lambda: log.read_text().count("refused a frame") >= 5, 30.0,
                                   message=lambda: f"the worker did not refuse the frames: {log.read_text()}")
            out = await collect(router, "after-bad-frames", prompt, 10)
            return out, worker.pid, Path(f"/proc/{worker.pid}/cmdline").read_bytes()

    out, pid, cmdline = run(scenario())
    assert out == hf_greedy(tiny_llama, [prompt], 10)[0]
    assert cmdline.split(b"\0")[0].startswith(b"kvbaton-both-0")
    text = log.read_text()
    assert text.count("refused a frame") >= 5, text
    assert "bad signature" in text and "too short" in text
    assert not Path("/tmp/kvbaton-pwned").exists()
