"""`kvbaton serve --encrypt-traffic` end to end: the tiny-model router over real worker processes with
CURVE on every ZeroMQ socket. Greedy output must equal transformers', and a probe from outside shows
the sockets are CURVE servers: a plain client's frame never reaches the router, a worker's command
socket or a KV receiver, while a frame from a client with the cluster's keys does (and is refused, in
the log, for its missing signature)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import zmq

from kvbaton.cli import build_parser, deployment_from_args
from kvbaton.wire import SECRET_ENV, CurveKeys, curve_client
from tests.support.helpers import hf_greedy, tiny_prompts
from tests.support.pd import collect, router_over, run
from tests.support.wait import async_wait_until

MAX_NEW = 16
SECRET = b"encrypted-traffic-test-secret-0123456789"
PLAIN_PROBE = b"p" * 11  # distinct lengths: the log names a refused frame by its size
CURVE_PROBE = b"c" * 23



def test_the_flag_reaches_the_deployment():
    assert deployment_from_args(build_parser().parse_args(["serve", "--encrypt-traffic"])).encrypt_traffic
    assert not deployment_from_args(build_parser().parse_args(["serve"])).encrypt_traffic


def probe(ctx: zmq.Context, address: str, keys: CurveKeys | None, payload: bytes) -> zmq.Socket:
    """A PUSH that sends `payload` once it has a peer (keep it open until then: LINGER is 0)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    curve_client(sock, keys)
    sock.connect(address)
    sock.send(payload)
    return sock


async def wait_for(seen, where: str, timeout_s: float = 10.0) -> None:
    """Until `seen()` is true (bounded)."""
    await async_wait_until(seen, timeout_s, message=f"the probe with the cluster's keys never reached {where}")


def refused(text: str, where: str, payload: bytes) -> bool:
    return f"{where}: refused a frame ({len(payload)} bytes)" in text


@pytest.mark.parametrize("prefill, transport", [(0, "shm"), (1, "tcp")], ids=["colocated", "1p1d-tcp"])
def test_encrypted_deployment_matches_transformers(tiny_llama, prefill, transport, tmp_path: Path, monkeypatch,
                                                   caplog):
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())  # what deploy() and its workers use
    keys = CurveKeys.from_secret(SECRET)
    prompts = tiny_prompts(21, [3, 9, 17, 40])
    caplog.set_level(logging.WARNING, logger="kvbaton.wire.sequenced")  # the router refuses in its codec

    async def scenario(ctx: zmq.Context):
        async with router_over(tiny_llama, prefill=prefill, decode=1, transport=transport, local_prefill_threshold=0,
                               log_dir=tmp_path, encrypt_traffic=True) as router:
            outs = await asyncio.gather(*(collect(router, f"r{i}", p, MAX_NEW) for i, p in enumerate(prompts)))
            # (where the frame lands, its socket's address, the log the refusal goes to)
            targets = [("router", router.pool.address, None)]
            for w in router.pool.workers.values():
                targets.append((w.name, w.address, tmp_path / f"{w.name}.log"))
                if w.receiver is not None:
                    targets.append((f"{w.name} KV receiver", w.receiver, tmp_path / f"{w.name}.log"))
            probes = [probe(ctx, address, k, payload) for _, address, _ in targets
                      for k, payload in ((None, PLAIN_PROBE), (keys, CURVE_PROBE))]
            for where, _, log in targets:
                text = (lambda log=log: log.read_text() if log else caplog.text)
                await wait_for(lambda where=where, text=text: refused(text(), where, CURVE_PROBE), where)
                assert not refused(text(), where, PLAIN_PROBE), f"a plain frame reached {where}"
            for sock in probes:
                sock.close()
            return outs, dict(router.counters), [where for where, _, _ in targets]

    ctx = zmq.Context()
    try:
        outs, counters, probed = run(scenario(ctx))
    finally:
        ctx.destroy(linger=0)
    assert outs == hf_greedy(tiny_llama, prompts, MAX_NEW)
    if prefill:
        assert counters["disaggregated"] == len(prompts) and counters["fallbacks"] == 0, counters
        assert "kvbaton-decode-0 KV receiver" in probed
