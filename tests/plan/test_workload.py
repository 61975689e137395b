"""The request pool: rescaled unit-rate arrivals are the bench's own arrivals at that rate."""

from __future__ import annotations

import pytest

from kvbaton.config import ConfigError
from kvbaton.plan.workload import Workload
from kvbaton.sim.workload import synthetic_requests
from kvbaton.workload.arrivals import ArrivalConfig


def test_pool_at_a_rate_is_the_bench_load_at_that_rate() -> None:
    load = Workload(qps=10, input_len=32, output_len=8, range_ratio=0.5)
    pool = load.pool(50, seed=3)
    direct = synthetic_requests(load.dataset(50), ArrivalConfig(request_rate=7.0), 3)
    scaled = pool.at(7.0, 50)
    assert [r.prompt_token_ids for r in scaled] == [r.prompt_token_ids for r in direct]
    assert [r.arrival_s for r in scaled] == pytest.approx([r.arrival_s for r in direct])


def test_shared_prefixes_share_token_ids() -> None:
    pool = Workload(qps=1, input_len=8, output_len=4, prefix_len=32, num_prefixes=2).pool(4, seed=0)
    first = [r.prompt_token_ids[:32] for r in pool.unit_rate]
    assert first[0] == first[2] and first[0] != first[1]


@pytest.mark.parametrize("kw", [dict(qps=-1), dict(qps=float("inf")), dict(input_len=0),
                                dict(range_ratio=1.0), dict(attainment_target=0.0)])
def test_bad_loads(kw: dict) -> None:
    with pytest.raises(ConfigError):
        Workload(**{"qps": 1.0, "input_len": 8, "output_len": 4, **kw})
