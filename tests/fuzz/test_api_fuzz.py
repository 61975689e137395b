"""Schemathesis over the real server's own OpenAPI schema, colocated and `--prefill 1 --decode 2`.

Each deployment gets one bounded, seeded run (MAX_EXAMPLES cases or its BUDGET_S of wall time,
whichever ends first) of positive and negative cases for `/v1/completions` and
`/v1/chat/completions`, plus the GET endpoints (`/admin` is left out: it starts and drains
workers). Every generated request has `max_tokens` capped at MAX_TOKENS (and set: a request
without it may run to `max_model_len`), so the run stays bounded; streamed cases are kept.

A case fails on a 5xx (schemathesis' `not_a_server_error`), on no answer within
REQUEST_TIMEOUT_S, or on a 200 stream that carries an error event or ends without
`data: [DONE]` (a 5xx in disguise). Failures are collected, not raised, so one run reports
every distinct defect with a curl reproducer. Afterwards the server must be idle again, have
the same healthy workers (same PIDs) and give the same greedy text as before the run.

KVBATON_FUZZ_SEED=<int> replays the run with other cases (the default seed is fixed, for CI).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core import NotSet
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi import schemas as _openapi_schemas  # noqa: F401

from kvbaton.bench.soak import is_idle, stats, wait_idle, workers
from tests.support.server import Served, served

pytestmark = pytest.mark.slow
# NOTE: the OpenAPI loader's modules are imported above, at collection, not on the first fuzz run: pytest rewrites
# a plugin's modules as they are imported, and CPython 3.11.7's ast.parse failed on one of them ("AST constructor
# recursion depth mismatch", a CPython bug) when it happened deep in a test session.

SEED = int(os.environ.get("KVBATON_FUZZ_SEED", "1010"))
MAX_EXAMPLES = 60
# Wall time per deployment; cases drawn after it are not sent (counted as unsent). NOTE: PD gets more: each
# answered case there crosses three processes (prefill, KV handoff, decode) and is several times slower.
BUDGET_S = {"colocated": 12.0, "pd": 16.0}  # the seed fixes the cases: a run stops later in the same sequence
REQUEST_TIMEOUT_S = 20.0  # the longest silence allowed: 8 tokens take well under a second here
MAX_TOKENS = 8
PROMPT = "The three primary colors are"
DEPLOYMENTS = {
    "colocated": [],
    # NOTE: threshold 0 sends every prompt through the prefill worker and the KV handoff.
    "pd": ["--prefill", "1", "--decode", "2", "--local-prefill-threshold", "0"],
}
GREEDY: dict[str, str] = {}  # deployment -> greedy text of PROMPT; every deployment must agree


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def deployment(request) -> tuple[str, Served]:
    with served("--dtype", "float32", "--max-model-len", "1024", *DEPLOYMENTS[request.param]) as s:
        yield request.param, s


@dataclass
class Tally:
    sent: int = 0
    unsent: int = 0
    statuses: Counter = field(default_factory=Counter)  # (operation, status or "no answer") -> cases
    failures: dict[tuple[str, str], str] = field(default_factory=dict)  # (operation, what) -> first reproducer

    def fail(self, case: schemathesis.Case, what: str, detail: str) -> None:
        key = (case.operation.label, what)
        if key not in self.failures:
            self.failures[key] = f"{detail}\n    reproducer: {reproducer(case)}"

    def summary(self) -> str:
        by_status = Counter()
        for (_, status), n in self.statuses.items():
            by_status[status if isinstance(status, str) else f"{status // 100}xx"] += n
        return f"sent={self.sent} unsent={self.unsent} {dict(by_status)} by operation={dict(self.statuses)}"


def reproducer(case: schemathesis.Case) -> str:
    """The request as sent. NOTE: not `case.as_curl_command()`: its sanitizer masks every key with "token" in it."""
    body = case.body
    if isinstance(body, bytes):
        shown = repr(body)
    elif isinstance(body, NotSet):
        shown = "(no body)"
    else:
        shown = json.dumps(body)
    return f"{case.method.upper()} {case.path} {shown[:1500]}"


def cap_max_tokens(body: object) -> object:
    """`max_tokens` and `max_completion_tokens` at most MAX_TOKENS, of the same JSON type; `max_tokens`
    always present and not null (bools, strings and values below 1 are left for the server to refuse)."""
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[key] = type(value)(MAX_TOKENS)
    if body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    return body


def openapi_document(base: str) -> dict:
    """The server's own OpenAPI document: served at /openapi.json if it is, else the same app's, built
    in-process in front of a real one-worker deployment (the document depends on the routes only)."""
    resp = httpx.get(f"{base}/openapi.json", timeout=10, trust_env=False)
    if resp.status_code == 200:
        return resp.json()
    if "built" not in _DOCUMENT:
        _DOCUMENT["built"] = asyncio.run(_built_document())
    return _DOCUMENT["built"]


_DOCUMENT: dict[str, dict] = {}


async def _built_document() -> dict:
    from kvbaton.cluster.deploy import DeploymentSpec, deploy
    from kvbaton.config import EngineConfig
    from kvbaton.models.registry import pull_default_model
    from kvbaton.server.api import ServerSettings, build_app
    from kvbaton.text.tokenizer import Tokenizer

    model_dir = str(pull_default_model())
    deployment = await deploy(EngineConfig(model=model_dir, dtype="float32", max_model_len=1024),
                              Tokenizer(model_dir), DeploymentSpec())
    try:
        app = build_app(deployment.router, ServerSettings(served_model_name="schema"))
        app.state.server.prompts.close()
        return app.openapi()
    finally:
        await deployment.shutdown()


def load_schema(base: str) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_dict(openapi_document(base)).exclude(path_regex="^/admin")

    @schema.hook
    def map_body(_ctx, body):
        return cap_max_tokens(body)

    return schema


def case_strategy(schema: schemathesis.BaseSchema) -> st.SearchStrategy:
    """Positive and negative POST cases (positive ones weighted twice) and, as one branch, the GETs."""
    ops = [result.ok() for result in schema.get_all_operations()]
    posts = [op for op in ops if op.method.upper() == "POST"]
    gets = st.one_of([op.as_strategy() for op in ops if op.method.upper() == "GET"])
    positive = [op.as_strategy() for op in posts]
    negative = [op.as_strategy(generation_mode=GenerationMode.NEGATIVE) for op in posts]
    return st.one_of(gets, *positive, *positive, *negative)


def stream_problem(resp: schemathesis.Response) -> str | None:
    """Why a 200 event stream is broken (an error event, no [DONE] at the end), or None."""
    events = [line[5:].strip() for line in resp.text.splitlines() if line.startswith("data:")]
    errors = [e for e in events if e.startswith("{") and '"error"' in e]
    if errors:
        return f"error event in a 200 stream: {errors[0][:300]}"
    if not events or events[-1] != "[DONE]":
        return f"200 stream without a final [DONE]: {resp.text[-300:]!r}"
    return None


def exercise(case: schemathesis.Case, base: str, tally: Tally) -> None:
    label = case.operation.label
    tally.sent += 1
    try:
        resp = case.call(base_url=base, timeout=REQUEST_TIMEOUT_S)  # requests: a per-read timeout
    except requests.RequestException as exc:
        tally.statuses[label, "no answer"] += 1
        tally.fail(case, f"no answer ({type(exc).__name__})",
                   f"no answer within {REQUEST_TIMEOUT_S:.0f}s: {type(exc).__name__}")
        return
    tally.statuses[label, resp.status_code] += 1
    try:
        case.validate_response(resp, checks=[not_a_server_error])
    except (Failure, FailureGroup):
        tally.fail(case, f"HTTP {resp.status_code}", f"HTTP {resp.status_code}: {resp.text[:300]}")
        return
    content_type = (resp.headers.get("content-type") or [""])[0]  # schemathesis: lowercase keys, list values
    if resp.status_code == 200 and content_type.startswith("text/event-stream"):
        problem = stream_problem(resp)
        if problem:
            tally.fail(case, problem[:40], problem)


def fuzz(base: str, budget_s: float) -> Tally:
    tally = Tally()
    strategy = case_strategy(load_schema(base))
    deadline = time.monotonic() + budget_s

    @seed(SEED)
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(case=strategy)
    def one_case(case: schemathesis.Case) -> None:
        if time.monotonic() > deadline:
            tally.unsent += 1
            return
        exercise(case, base, tally)

    one_case()
    return tally


def greedy_text(base: str) -> str:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=60, trust_env=False)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def after_problems(base: str, pids_before: dict[str, int], reference: str) -> list[str]:
    """What is wrong with the server after the run: not idle, a worker lost or unhealthy, another greedy text."""
    problems = []
    if wait_idle(base, timeout_s=15) is None:
        problems.append(f"/stats not idle 15 s after the run: {stats(base)}")
    now = workers(base)
    if {w["name"]: w["pid"] for w in now} != pids_before:
        problems.append(f"workers changed: before {pids_before}, after {[(w['name'], w['pid']) for w in now]}")
    problems += [f"worker {w['name']} unhealthy: {w}" for w in now if not w["healthy"]]
    health = httpx.get(f"{base}/health", timeout=10, trust_env=False)
    if health.status_code != 200:
        problems.append(f"/health {health.status_code}: {health.text}")
    try:
        text = greedy_text(base)
    except (AssertionError, httpx.HTTPError) as exc:
        problems.append(f"a valid request failed after the run: {exc}")
    else:
        if text != reference:
            problems.append(f"greedy text changed: {reference!r} before, {text!r} after")
    return problems


def test_fuzz_openapi_no_server_errors(deployment):
    name, server = deployment
    assert is_idle(stats(server.base))
    pids_before = {w["name"]: w["pid"] for w in workers(server.base)}
    reference = GREEDY.setdefault(name, greedy_text(server.base))
    t = time.monotonic()
    tally = fuzz(server.base, BUDGET_S[name])
    print(f"\n[{name}] {time.monotonic() - t:.0f}s seed={SEED} {tally.summary()}")
    problems = [f"{op} -> {what}: {detail}" for (op, what), detail in tally.failures.items()]
    problems += after_problems(server.base, pids_before, reference)
    if len(set(GREEDY.values())) > 1:
        problems.append(f"deployments disagree on the greedy text: {GREEDY}")
    assert tally.sent > 0
    assert not problems, (f"[{name}] {len(problems)} problem(s) ({tally.summary()}):\n" + "\n".join(problems)
                          + f"\n--- server log tail ---\n{server.log_tail()}")
