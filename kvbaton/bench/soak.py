"""A seeded mixed load for soak runs, and what a soak checks on the server afterwards.

Each of `concurrency` clients loops until the deadline, drawing from its own seeded RNG one of

    WHOLE        a non-streamed request, read to the end
    STREAM       a streamed request, read to `data: [DONE]`
    DISCONNECT   a streamed request whose connection is closed after a few chunks
    EARLY_CLOSE  a non-streamed request whose connection is closed before the answer comes
    STOP         a non-streamed request with stop strings (the text must not contain them)

with a fresh prompt of random words (random from the first word on, so the prefix cache cannot
make the load trivial), a random length and a random `max_tokens`, on either endpoint.

Shared by tests/soak/test_soak.py (bounded, in CI), the idle checks of tests/fuzz/test_api_fuzz.py and
benchmarks/soak.py (long). It is a plain HTTP client: it imports nothing of the serving stack.
"""

from __future__ import annotations

import asyncio
import enum
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

WORDS = ("river stone lamp orange violet engine garden thunder paper silver window market forest candle "
         "rocket winter harbor pencil tiger meadow copper saddle mirror lantern canyon marble velvet "
         "anchor falcon cedar quartz ember willow glacier comet bamboo ivory tundra prism nectar basalt").split()
STOP_WORDS = ("the", "and", "of", ".", ",", "is", "a", "\n")


class Kind(enum.Enum):
    WHOLE = "whole"
    STREAM = "stream"
    DISCONNECT = "disconnect"
    EARLY_CLOSE = "early_close"
    STOP = "stop"


class Outcome(enum.Enum):
    SERVED = "served"  # answered in full, and the answer passed its checks
    DISCONNECTED = "disconnected"  # closed by us on purpose
    ERROR = "error"  # an error status, a broken stream, a failed check or a hang


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    duration_s: float
    concurrency: int = 4
    seed: int = 0
    min_prompt_words: int = 4
    max_prompt_words: int = 64
    max_tokens: int = 16
    timeout_s: float = 120.0  # the longest silence a request may meet; past it the request counts as a hang
    weights: tuple[tuple[Kind, int], ...] = ((Kind.WHOLE, 3), (Kind.STREAM, 3), (Kind.DISCONNECT, 2),
                                             (Kind.EARLY_CLOSE, 1), (Kind.STOP, 2))

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.concurrency < 1 or not 1 <= self.min_prompt_words <= self.max_prompt_words:
            raise ValueError(f"bad soak config: {self}")


@dataclass
class SoakResult:
    counts: Counter[tuple[Kind, Outcome]] = field(default_factory=Counter)  # (Kind, Outcome) -> requests
    statuses: Counter[int] = field(default_factory=Counter)  # HTTP status -> requests (those that got one)
    latencies_s: list[float] = field(default_factory=list)  # end to end, served requests only
    errors: list[str] = field(default_factory=list)  # one line per error (the first few hundred)

    def record(self, kind: Kind, outcome: Outcome, latency_s: float | None = None, error: str | None = None) -> None:
        self.counts[kind, outcome] += 1
        if outcome is Outcome.SERVED and latency_s is not None:
            self.latencies_s.append(latency_s)
        if error is not None and len(self.errors) < 300:
            self.errors.append(f"{kind.value}: {error}")

    def total(self, outcome: Outcome) -> int:
        return sum(n for (_, o), n in self.counts.items() if o is outcome)

    def percentile_s(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]

    def summary(self) -> str:
        counts = sorted(self.counts.items(), key=lambda item: (item[0][0].value, item[0][1].value))
        by_kind = ", ".join(f"{k.value}/{o.value}={n}" for (k, o), n in counts)
        return (f"served={self.total(Outcome.SERVED)} disconnected={self.total(Outcome.DISCONNECTED)} "
                f"errors={self.total(Outcome.ERROR)} statuses={dict(sorted(self.statuses.items()))} "
                f"p50={self.percentile_s(50):.2f}s p99={self.percentile_s(99):.2f}s [{by_kind}]")


# ---- one request ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Planned:
    kind: Kind
    endpoint: str
    body: dict[str, Any]
    cut_after_chunks: int = 0  # DISCONNECT: chunks read before the connection is closed
    close_after_s: float = 0.0  # EARLY_CLOSE: how long we wait before closing


def plan_request(rng: random.Random, config: SoakConfig) -> Planned:
    kinds, weights = zip(*config.weights)
    kind = rng.choices(kinds, weights)[0]
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(config.min_prompt_words, config.max_prompt_words)))
    body: dict[str, Any] = {"max_tokens": rng.randint(1, config.max_tokens),
                            "temperature": rng.choice((0.0, 0.0, 0.7, 1.0)), "seed": rng.randrange(2**31)}
    chat = rng.random() < 0.5
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    if kind in (Kind.STREAM, Kind.DISCONNECT):
        body["stream"] = True
        body["stream_options"] = {"include_usage": rng.random() < 0.5}
    if kind is Kind.STOP:
        body["stop"] = rng.sample(STOP_WORDS, rng.randint(1, 3))
        body["max_tokens"] = config.max_tokens
    return Planned(kind=kind, endpoint="/v1/chat/completions" if chat else "/v1/completions", body=body,
                   cut_after_chunks=rng.randint(1, 6), close_after_s=rng.uniform(0.05, 1.0))


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice["text"] or ""
    message = choice.get("message") or choice.get("delta") or {}
    return message.get("content") or ""


def check_whole(planned: Planned, answer: dict[str, Any]) -> str | None:
    """Why a whole answer is wrong, or None."""
    choice = answer["choices"][0]
    text, usage = _choice_text(choice), answer["usage"]
    if choice["finish_reason"] not in ("stop", "length"):
        return f"finish_reason {choice['finish_reason']!r}"
    if usage["completion_tokens"] > planned.body["max_tokens"]:
        return f"{usage['completion_tokens']} tokens for max_tokens={planned.body['max_tokens']}"
    leaked = [s for s in planned.body.get("stop", []) if s in text]
    return f"stop strings {leaked} in the text {text!r}" if leaked else None


async def read_stream(resp: httpx.Response, cut_after_chunks: int | None) -> tuple[bool, str | None]:
    """(completed, error) of a streamed answer; stops after `cut_after_chunks` data events if given."""
    chunks = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return True, None
        event = json.loads(data)
        if event.get("error"):
            return False, f"error event in the stream: {event['error']}"
        chunks += 1
        if cut_after_chunks is not None and chunks >= cut_after_chunks:
            return False, None
    return False, "the stream ended without [DONE]"


async def send(client: httpx.AsyncClient, base_url: str, planned: Planned, result: SoakResult) -> None:
    """One planned request, recorded in `result`; never raises (but for cancellation)."""
    t = time.perf_counter()
    try:
        outcome, error = await _send(client, base_url + planned.endpoint, planned, result)
    except httpx.TimeoutException:
        outcome, error = Outcome.ERROR, f"silent for {client.timeout.read:.0f}s: {json.dumps(planned.body)[:200]}"
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        outcome, error = Outcome.ERROR, f"{type(exc).__name__}: {exc}"
    result.record(planned.kind, outcome, time.perf_counter() - t, error)


async def _send(client: httpx.AsyncClient, url: str, planned: Planned,
                result: SoakResult) -> tuple[Outcome, str | None]:
    if planned.kind is Kind.EARLY_CLOSE:
        try:
            resp = await asyncio.wait_for(client.post(url, json=planned.body), planned.close_after_s)
        except asyncio.TimeoutError:  # the connection is closed with the cancelled request
            return Outcome.DISCONNECTED, None
        return _whole_outcome(planned, resp, result)
    if not planned.body.get("stream"):
        return _whole_outcome(planned, await client.post(url, json=planned.body), result)
    async with client.stream("POST", url, json=planned.body) as resp:
        result.statuses[resp.status_code] += 1
        if resp.status_code != 200:
            return Outcome.ERROR, f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
        cut = planned.cut_after_chunks if planned.kind is Kind.DISCONNECT else None
        completed, error = await read_stream(resp, cut)
    # NOTE: leaving the block unread closes the connection (the pool keeps none alive): the disconnect.
    if error is not None:
        return Outcome.ERROR, error
    return (Outcome.SERVED if completed else Outcome.DISCONNECTED), None


def _whole_outcome(planned: Planned, resp: httpx.Response, result: SoakResult) -> tuple[Outcome, str | None]:
    result.statuses[resp.status_code] += 1
    if resp.status_code != 200:
        return Outcome.ERROR, f"HTTP {resp.status_code}: {resp.text[:300]}"
    error = check_whole(planned, resp.json())
    return (Outcome.ERROR, error) if error else (Outcome.SERVED, None)


# ---- the load --------------------------------------------------------------------------------


def make_client(timeout_s: float) -> httpx.AsyncClient:
    # NOTE: no keep-alive, so every request has its own connection and closing one is a real disconnect;
    # trust_env=False so a proxy in the environment cannot reroute loopback traffic.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0), trust_env=False)


async def _client_loop(base_url: str, config: SoakConfig, index: int, deadline: float, result: SoakResult) -> None:
    rng = random.Random(config.seed * 1000 + index)
    async with make_client(config.timeout_s) as client:
        while time.monotonic() < deadline:
            await send(client, base_url, plan_request(rng, config), result)


async def run_soak_async(base_url: str, config: SoakConfig) -> SoakResult:
    result = SoakResult()
    deadline = time.monotonic() + config.duration_s
    await asyncio.gather(*(_client_loop(base_url, config, i, deadline, result) for i in range(config.concurrency)))
    return result


def run_soak(base_url: str, config: SoakConfig) -> SoakResult:
    """The mixed load for `config.duration_s` (then each client finishes the request it is in)."""
    return asyncio.run(run_soak_async(base_url, config))


# ---- the server, before and after -----------------------------------------------------------


def rss_mib(pid: int) -> float:
    """Resident set size of `pid` (VmRSS in /proc/PID/status), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def workers(base_url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{base_url}/workers", timeout=10, trust_env=False).json()["workers"]


def stats(base_url: str) -> dict[str, Any]:
    return httpx.get(f"{base_url}/stats", timeout=10, trust_env=False).json()


def is_idle(s: dict[str, Any]) -> bool:
    return (s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0.0
            and s["num_in_flight"] == 0 and s["num_pending_admission"] == 0)


def wait_idle(base_url: str, timeout_s: float = 30.0) -> dict[str, Any] | None:
    """`/stats` once the server is idle, or None if it is not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = stats(base_url)
        if is_idle(s):
            return s
        time.sleep(0.25)
    return None
