"""The running deployment, as `kvbaton doctor` sees it: HTTP only (its health, admin and metrics endpoints)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


class DoctorError(Exception):
    """The diagnosis cannot start (server unreachable, key refused): one line, exit status 2."""


class EndpointError(Exception):
    """One endpoint answered with an error: its step reports it and the diagnosis goes on."""

    def __init__(self, path: str, status: int, message: str) -> None:
        super().__init__(f"{path}: {status} {message}")
        self.status = status


class DeploymentClient:
    def __init__(self, url: str, api_key: str | None, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # NOTE: no proxies from the environment: a deployment on loopback must be reached directly
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, trust_env=False)

    def close(self) -> None:
        self.http.close()

    def check(self) -> list[dict[str, Any]]:
        """The workers, if the server is up and takes our admin key; else DoctorError."""
        try:
            self.http.get("/health")
            resp = self.http.get("/workers")
        except httpx.HTTPError as exc:
            raise DoctorError(f"cannot reach {self.url}: {exc or type(exc).__name__}") from None
        if resp.status_code in (401, 403):
            raise DoctorError(f"{self.url} refused the admin request ({resp.status_code}): {_message(resp)}; "
                              "pass its admin key with --api-key (or $KVBATON_ADMIN_API_KEY)")
        if resp.status_code != 200:
            raise DoctorError(f"{self.url}/workers answered {resp.status_code}: {_message(resp)}")
        workers: list[dict[str, Any]] = resp.json()["workers"]
        return workers

    def get(self, path: str) -> Any:
        return self._answer(path, lambda: self.http.get(path))

    def post(self, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        return self._answer(path, lambda: self.http.post(path, json=body, timeout=timeout_s))

    def metrics(self) -> Metrics:
        try:
            text = self.http.get("/metrics").text
        except httpx.HTTPError as exc:
            raise EndpointError("/metrics", 0, str(exc) or type(exc).__name__) from None
        return Metrics.parse(text)

    def _answer(self, path: str, call: Any) -> Any:
        try:
            resp = call()
        except httpx.HTTPError as exc:
            raise EndpointError(path, 0, str(exc) or type(exc).__name__) from None
        if resp.status_code != 200:
            raise EndpointError(path, resp.status_code, _message(resp))
        return resp.json()


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


@dataclass
class Metrics:
    """A /metrics scrape: each sample's value by name, and a histogram's cumulative buckets."""

    values: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def parse(cls, text: str) -> Metrics:
        metrics = cls()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                metrics.values[sample.name].append((dict(sample.labels), float(sample.value)))
        return metrics

    def total(self, name: str, **labels: str) -> float:
        """The sum over the series of `name` whose labels include `labels` (0 if none)."""
        return sum(v for series, v in self.values.get(name, []) if labels.items() <= series.items())

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for series, v in self.values.get(name, []):
            out[series.get(label, "")] += v
        return dict(out)

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """A histogram's cumulative (upper edge, count) pairs, summed over its series, by edge."""
        edges = self.by_label(f"{name}_bucket", "le")
        return sorted((float(edge), count) for edge, count in edges.items())


def share_at_least(buckets: list[tuple[float, float]], tokens: float) -> float | None:
    """The share of observations >= `tokens` (integers): exact where `tokens - 1` is an edge, linearly
    interpolated within a bucket otherwise (as Prometheus' histogram_quantile). None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    below, x = 0.0, tokens - 1  # fewer than `tokens` = at most tokens - 1
    prev_edge, prev_count = 0.0, 0.0
    for edge, count in buckets:
        if x <= edge:
            width = edge - prev_edge
            frac = 1.0 if math.isinf(edge) or width <= 0 else (x - prev_edge) / width
            below = prev_count + (count - prev_count) * max(0.0, min(1.0, frac))
            break
        prev_edge, prev_count = edge, count
    else:
        below = total
    return max(0.0, (total - below) / total)
