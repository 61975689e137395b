"""The hostile requests of the hardening round two (issue 27), measured on a live `kvbaton serve`: what each
costs the server and its other clients. Prints one line per case; the figures go into
benchmarks/results/hardening.md. Run it at a commit before and after a fix to compare (the CPU kind is printed).

    .venv/bin/python benchmarks/hostile_requests.py
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import httpx

from common.machine import cpu_kind, cpu_name, kvbaton_commit
from common.servers import Server, free_port, kvbaton_server

CHAT, C = "/v1/chat/completions", "/v1/completions"


@dataclass
class Probed:
    """A request sent while /health is polled on a thread: its answer and time, /health's worst wait, and the
    peak RSS of process `pid` (MiB) over its RSS before, when a pid is given."""

    response: httpx.Response
    took_s: float
    worst_wait_s: float
    rss_growth_mib: float


def rss_mib(pid: int) -> float:
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def probed(base: str, path: str, body: dict, pid: int | None = None, every_s: float = 0.05) -> Probed:
    worst, before = [0.0], rss_mib(pid) if pid else 0.0
    peak, stop = [before], threading.Event()

    def probe() -> None:
        while not stop.is_set():
            start = time.monotonic()
            httpx.get(f"{base}/health", timeout=300)
            worst[0] = max(worst[0], time.monotonic() - start)
            peak[0] = max(peak[0], rss_mib(pid)) if pid else 0.0
            stop.wait(every_s)

    prober = threading.Thread(target=probe)
    prober.start()
    start = time.monotonic()
    try:
        response = httpx.post(f"{base}{path}", json=body, timeout=600)
    finally:
        took = time.monotonic() - start
        stop.set()
        prober.join()
    return Probed(response, took, worst[0], peak[0] - before)


def tool_schemas(base: str) -> str:
    """24 tools of 9,800 empty sub-schemas each (a 944 KB body): its answer, and /health's worst wait meanwhile."""
    tool = {"type": "object", "properties": {"a": {"anyOf": [{}] * 9800}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": tool}} for i in range(24)]}
    p = probed(base, CHAT, body)
    return (f"tools x24 of 9,800 sub-schemas: {p.response.status_code} in {p.took_s:.2f} s; "
            f"/health's worst wait {p.worst_wait_s:.2f} s")


def big_bodies(base: str) -> str:
    """A 5 MB stop list and a 30 MB prompt, over the 4 MiB limit: what urllib and httpx see (3 tries each)."""
    seen = []
    for name, body in (("5 MB stop list", {"prompt": "hi", "stop": ["stop"] * 700_000}),
                       ("30 MB prompt", {"prompt": "hi " * 10_000_000})):
        content = json.dumps(body).encode()
        for client in ("urllib", "httpx"):
            results = []
            for _ in range(3):
                try:
                    if client == "httpx":
                        results.append(str(httpx.post(f"{base}{C}", content=content, timeout=60,
                                                      headers={"Content-Type": "application/json"}).status_code))
                    else:
                        urllib.request.urlopen(urllib.request.Request(
                            f"{base}{C}", data=content, headers={"Content-Type": "application/json"}), timeout=60)
                        results.append("200")
                except urllib.error.HTTPError as exc:
                    results.append(str(exc.code))
                except (OSError, httpx.HTTPError) as exc:
                    results.append(type(exc).__name__)
            seen.append(f"{name} via {client}: {'/'.join(results)}")
    return "; ".join(seen)


def abandoned_streams(base: str) -> str:
    """16 streamed n=16 chats whose client closes at once: the admission entries still pending after 10 s."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps({"messages": [{"role": "user", "content": "Tell me a story."}], "n": 16, "stream": True,
                          "max_tokens": 16}).encode()
    for _ in range(16):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    time.sleep(10)
    pending = httpx.get(f"{base}/stats", timeout=10).json()["num_pending_admission"]
    after = httpx.post(f"{base}{C}", json={"prompt": "Hi", "max_tokens": 1}, timeout=60).status_code
    return f"16 streamed n=16 chats abandoned: {pending} admission entries pending 10 s later; next request: {after}"


def logprob_body(base: str, pid: int) -> str:
    """One completion of 1,000 tokens x 20 logprobs, not streamed (21,000 entries to render, about what
    --max-request-output-tokens admits at --max-model-len 1024): /health's worst wait while it runs, and the server
    process's peak RSS over its RSS before."""
    body = {"prompt": "Hi", "max_tokens": 1000, "logprobs": 20, "ignore_eos": True, "temperature": 1.0}
    p = probed(base, C, body, pid, every_s=0.02)
    return (f"1,000 tokens x logprobs 20, whole: {p.response.status_code} in {p.took_s:.1f} s, "
            f"{len(p.response.content) / 2**20:.1f} MiB; /health's worst wait {p.worst_wait_s * 1e3:.0f} ms; "
            f"server RSS +{p.rss_growth_mib:.0f} MiB at peak")


def foreign_host(base: str) -> str:
    r = httpx.post(f"{base}{C}", json={"prompt": "Hi", "max_tokens": 1}, headers={"Host": "attacker.example"})
    return f"a completion named Host: attacker.example on a loopback server: {r.status_code}"


def main() -> None:
    print(f"CPU: {cpu_name()} ({cpu_kind()}), {os.cpu_count()} cores; kvbaton {kvbaton_commit()}")
    with tempfile.TemporaryDirectory() as tmp:
        spec = kvbaton_server(name="kvbaton serve", port=free_port(), log_path=Path(tmp) / "serve.log",
                              serve_args=["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024"],
                              env=dict(os.environ), timeout_s=240)
        with Server(spec) as server:
            assert server.pid is not None
            print(logprob_body(server.base_url, server.pid), flush=True)
            for case in (tool_schemas, big_bodies, foreign_host, abandoned_streams):
                print(case(server.base_url), flush=True)


if __name__ == "__main__":
    main()
