"""AdmissionController: refusals by queue length and by pending prompt tokens, every release idempotent,
and the backstop that drops an entry nobody released (on a clock the test moves, as the simulator does)."""

from __future__ import annotations

import logging

import pytest

from kvbaton.server.admission import AdmissionController, AdmissionLimits


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_refuses_by_queue_length_and_by_pending_tokens():
    admission = AdmissionController(AdmissionLimits(max_waiting_requests=2), kv_capacity_tokens=100)
    assert admission.try_admit("a", 60) is None
    assert admission.try_admit("b", 50) == "server busy: 60 prompt tokens already waiting for KV cache space"
    assert admission.try_admit("b", 40) is None
    assert admission.try_admit("c", 1) == "server busy: 2 requests already waiting"
    admission.started("a")
    admission.started("a")  # twice: counted once
    assert admission.num_pending == 1 and admission.try_admit("c", 60) is None


def test_an_id_admitted_twice_is_one_entry():
    admission = AdmissionController(AdmissionLimits(), kv_capacity_tokens=100)
    assert admission.try_admit("a", 50) is None and admission.try_admit("a", 50) is None
    assert admission.num_pending == 1 and admission.try_admit("b", 50) is None


def test_an_entry_nobody_released_is_dropped_after_its_lifetime(caplog):
    clock = Clock()
    admission = AdmissionController(AdmissionLimits(max_waiting_requests=2, max_pending_s=60),
                                    kv_capacity_tokens=100, clock=clock)
    admission.try_admit("leaked", 10)
    clock.now = 30
    admission.try_admit("young", 10)
    assert admission.try_admit("third", 10) == "server busy: 2 requests already waiting"
    clock.now = 61
    with caplog.at_level(logging.WARNING, "kvbaton.server.admission"):
        assert admission.try_admit("third", 10) is None
    assert admission.num_expired == 1 and "admission entry of leaked dropped after 61 s" in caplog.text
    clock.now = 200
    assert admission.num_pending == 0 and admission.num_expired == 3


@pytest.mark.parametrize("limits", [dict(max_waiting_requests=0), dict(max_pending_s=0)])
def test_limits_are_checked(limits):
    with pytest.raises(ValueError):
        AdmissionLimits(**limits)
