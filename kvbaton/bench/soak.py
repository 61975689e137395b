"""A seeded mixed load for soak runs, and what a soak checks on the server afterwards.

Each of `concurrency` clients loops until the deadline, taking the next kind from a bag all clients
share (every kind as many times as its weight, in a seeded shuffle, refilled when empty: the first
`sum(weights)` requests hold every kind, however slow the server) and the rest from its own seeded RNG:

    WHOLE        a non-streamed request, read to the end
    STREAM       a streamed request, read to `data: [DONE]`
    DISCONNECT   a streamed request whose connection is closed after a few chunks
    EARLY_CLOSE  a non-streamed request whose connection is closed before the answer comes
    STOP         a non-streamed request with stop strings (the text must not contain them)
    N_SAMPLES    n = 2-4 choices, whole or streamed to the end (every choice must finish)
    STRUCTURED   a chat whose answer a JSON schema constrains (a finished answer must parse and match)
    TOOLS        a chat with `tool_choice: "required"` (a finished answer must be a call of the tool)

DISCONNECT and EARLY_CLOSE ask for n = 1-4 choices: a vanishing client of several choices must free
every choice's admission entry and KV blocks (hardening issue 27, item 1). Each request has a fresh
prompt of random words (random from the first word on, so the prefix cache cannot make the load
trivial), a random length and a random `max_tokens`, on either endpoint (the last two kinds: chat).

Shared by tests/soak/test_soak.py (bounded, in CI), the idle checks of tests/fuzz/test_api_fuzz.py and
benchmarks/soak.py (long). It is a plain HTTP client: it imports nothing of the serving stack.
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import random
import threading
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
    N_SAMPLES = "n_samples"
    STRUCTURED = "structured"
    TOOLS = "tools"


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
    # Requests started before the clients stop, the deadline past or not: a bag of every kind in a bounded soak.
    min_requests: int = 0
    weights: tuple[tuple[Kind, int], ...] = ((Kind.WHOLE, 3), (Kind.STREAM, 3), (Kind.DISCONNECT, 2),
                                             (Kind.EARLY_CLOSE, 1), (Kind.STOP, 2), (Kind.N_SAMPLES, 2),
                                             (Kind.STRUCTURED, 1), (Kind.TOOLS, 1))

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


# The constrained kinds' schemas: short answers (bounded strings), so that most finish within their tokens.
ANSWER_SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12},
                                                  "count": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["word", "count"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
CONSTRAINED_MAX_TOKENS = 48


class KindBag:
    """The kinds of the next requests: each kind `weight` times per bag, shuffled by a seeded RNG."""

    def __init__(self, config: SoakConfig) -> None:
        self._rng = random.Random(config.seed)
        self._weights = config.weights
        self._bag: list[Kind] = []
        self.taken = 0

    def take(self) -> Kind:
        if not self._bag:
            self._bag = [kind for kind, weight in self._weights for _ in range(weight)]
            self._rng.shuffle(self._bag)
        self.taken += 1
        return self._bag.pop()


def plan_request(rng: random.Random, config: SoakConfig, kind: Kind) -> Planned:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(config.min_prompt_words, config.max_prompt_words)))
    body: dict[str, Any] = {"max_tokens": rng.randint(1, config.max_tokens),
                            "temperature": rng.choice((0.0, 0.0, 0.7, 1.0)), "seed": rng.randrange(2**31)}
    chat = rng.random() < 0.5 or kind in (Kind.STRUCTURED, Kind.TOOLS)
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    if kind in (Kind.DISCONNECT, Kind.EARLY_CLOSE):
        body["n"] = rng.choice((1, 1, 2, 4))
    elif kind is Kind.N_SAMPLES:
        body["n"] = rng.randint(2, 4)
    if kind in (Kind.STREAM, Kind.DISCONNECT) or (kind is Kind.N_SAMPLES and rng.random() < 0.5):
        body["stream"] = True
        body["stream_options"] = {"include_usage": rng.random() < 0.5}
    if kind is Kind.STRUCTURED:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    elif kind is Kind.TOOLS:
        body |= {"tools": [WEATHER_TOOL], "tool_choice": "required"}
    if kind in (Kind.STRUCTURED, Kind.TOOLS):
        body["max_tokens"] = CONSTRAINED_MAX_TOKENS
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
    n, max_tokens = planned.body.get("n", 1), planned.body["max_tokens"]
    if len(answer["choices"]) != n:
        return f"{len(answer['choices'])} choices for n={n}"
    if answer["usage"]["completion_tokens"] > n * max_tokens:
        return f"{answer['usage']['completion_tokens']} tokens for n={n} x max_tokens={max_tokens}"
    for choice in answer["choices"]:
        if (error := check_choice(planned, choice)) is not None:
            return error
    return None


def check_choice(planned: Planned, choice: dict[str, Any]) -> str | None:
    finish, text = choice["finish_reason"], _choice_text(choice)
    if planned.kind is Kind.TOOLS:
        return _check_tool_calls(choice) if finish == "tool_calls" else None if finish == "length" else \
            f"finish_reason {finish!r} with tool_choice required"
    if finish not in ("stop", "length"):
        return f"finish_reason {finish!r}"
    if planned.kind is Kind.STRUCTURED and finish == "stop":
        value = json.loads(text)  # a ValueError here is recorded as the request's error
        if not isinstance(value, dict) or set(value) != {"word", "count"} or len(value["word"]) > 12:
            return f"answer {text!r} does not match its schema"
    leaked = [s for s in planned.body.get("stop", []) if s in text]
    return f"stop strings {leaked} in the text {text!r}" if leaked else None


def _check_tool_calls(choice: dict[str, Any]) -> str | None:
    calls = choice["message"].get("tool_calls") or []
    for call in calls:
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] != "get_weather" or set(arguments) != {"city"}:
            return f"tool call {call['function']} is not one of get_weather(city)"
    return None if calls else "finish_reason tool_calls without a call"


async def read_stream(resp: httpx.Response, cut_after_chunks: int | None,
                      num_choices: int = 1) -> tuple[bool, str | None]:
    """(completed, error) of a streamed answer; stops after `cut_after_chunks` data events if given.

    Read to the end, every one of `num_choices` choices must have finished (one finish_reason each)."""
    chunks, finished = 0, Counter[int]()
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            ok = sorted(finished) == list(range(num_choices)) and set(finished.values()) == {1}
            return True, None if ok else f"choices finished {dict(finished)} for n={num_choices}"
        event = json.loads(data)
        if event.get("error"):
            return False, f"error event in the stream: {event['error']}"
        finished.update(c["index"] for c in event.get("choices", ()) if c.get("finish_reason"))
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
        completed, error = await read_stream(resp, cut, planned.body.get("n", 1))
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


async def _client_loop(base_url: str, config: SoakConfig, index: int, deadline: float, kinds: KindBag,
                       result: SoakResult) -> None:
    rng = random.Random(config.seed * 1000 + index)
    async with make_client(config.timeout_s) as client:
        while time.monotonic() < deadline or kinds.taken < config.min_requests:
            await send(client, base_url, plan_request(rng, config, kinds.take()), result)


async def run_soak_async(base_url: str, config: SoakConfig) -> SoakResult:
    result, kinds = SoakResult(), KindBag(config)
    deadline = time.monotonic() + config.duration_s
    await asyncio.gather(*(_client_loop(base_url, config, i, deadline, kinds, result)
                           for i in range(config.concurrency)))
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


def private_mib(pid: int) -> float:
    """Memory only `pid` holds (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup), MiB.

    NOTE: what a leak grows, unlike RSS: RSS also counts the pages a process touches of another's shared memory
    (a 1P+1D decode worker reads KV from the prefill worker's 1 GiB shm pool, and its RSS climbs towards that
    pool's size as it touches more of it, while no memory is allocated anywhere)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, value = line.partition(":")
        if name.startswith("Private_"):
            fields[name] = int(value.split()[0])
    return (fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)) / 1024


def open_fds(pid: int) -> int:
    """How many file descriptors `pid` holds open (entries of /proc/PID/fd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


MIB_PER_MB = 1e6 / 2**20


@dataclass
class ProcessTrace:
    """RSS, private memory and open fds of named processes, sampled every `every_s` seconds on a thread.

    A slope is a least-squares line through every sample: a leak shows as a steady climb, while the
    allocator's ups and downs under load average out over a long enough run."""

    pids: dict[str, int]
    every_s: float = 5.0
    samples: list[tuple[float, dict[str, float], dict[str, float], dict[str, int]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        self.samples.append((time.monotonic(), {n: rss_mib(p) for n, p in self.pids.items()},
                             {n: private_mib(p) for n, p in self.pids.items()},
                             {n: open_fds(p) for n, p in self.pids.items()}))

    def __enter__(self) -> ProcessTrace:
        def run() -> None:
            while not self._stop.wait(self.every_s):
                self.sample()

        self.sample()
        self._thread = threading.Thread(target=run, name="soak-process-trace", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.sample()

    def slope_mb_per_min(self, name: str, private: bool = False) -> float:
        """The least-squares slope of `name`'s RSS (or private memory) over the samples, in MB (10^6 bytes) a minute."""
        t = [s[0] for s in self.samples]
        y = [(s[2] if private else s[1])[name] / MIB_PER_MB for s in self.samples]
        if len(t) < 3:
            return float("nan")
        t_mean, y_mean = sum(t) / len(t), sum(y) / len(y)
        var = sum((ti - t_mean) ** 2 for ti in t)
        return 60.0 * sum((ti - t_mean) * (yi - y_mean) for ti, yi in zip(t, y)) / var

    def fds_range(self, name: str) -> tuple[int, int]:
        fds = [s[3][name] for s in self.samples]
        return min(fds), max(fds)


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
