"""The restart budget and back-off of a worker slot (no processes: pure bookkeeping)."""

from __future__ import annotations

import pytest

from kvbaton.config import ConfigError, EngineConfig
from kvbaton.messages.worker_spec import WorkerRole, WorkerSpec
from kvbaton.router.supervision import RestartPolicy, Slot, SlotState


def slot() -> Slot:
    return Slot(spec=WorkerSpec(role=WorkerRole.BOTH, index=0, engine=EngineConfig(model="unused"),
                                router="tcp://127.0.0.1:1"))


def test_backoff_doubles_up_to_its_cap_then_the_budget_is_spent():
    policy = RestartPolicy(max_restarts=5, window_s=600, backoff_s=0.5, max_backoff_s=4.0)
    s, delays = slot(), []
    while (delay := s.backoff(policy, now=100.0)) is not None:
        delays.append(delay)
        s.recent.append(100.0)
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0]
    s.state, s.reason = SlotState.DOWN, "its process exited"
    assert "restart budget is spent" in s.describe(policy) and s.view(policy)["state"] == "down"


def test_restarts_older_than_the_window_no_longer_count():
    policy = RestartPolicy(max_restarts=2, window_s=60)
    s = slot()
    s.recent.extend([0.0, 30.0])
    assert s.backoff(policy, now=59.0) is None
    assert s.backoff(policy, now=61.0) == 1.0  # the first has left the window: one restart counts


def test_a_zero_budget_never_restarts_and_bad_policies_are_refused():
    assert slot().backoff(RestartPolicy(max_restarts=0), now=0.0) is None
    with pytest.raises(ConfigError):
        RestartPolicy(backoff_s=2.0, max_backoff_s=1.0)
    with pytest.raises(ConfigError):
        RestartPolicy(max_restarts=-1)
