"""An expert-parallel group meets on its host only: rank 0's store is bound there (torch's own would listen on
every interface), gloo is pinned to that host's interface, and a deployment refuses groups off loopback
unless the operator allowed unauthenticated sockets there."""

from __future__ import annotations

import datetime
import os

import pytest

from kvbaton.cluster.deploy import DeploymentSpec, check_group_exposure
from kvbaton.config import ConfigError
from kvbaton.parallel.rendezvous import GLOO_INTERFACE_ENV, address_of, meet
from kvbaton.platform.net import interface_of
from kvbaton.router.worker_pool import PoolConfig
from tests.support.procs import listening_addresses

TIMEOUT = datetime.timedelta(seconds=10)


def test_rank_0_hosts_the_store_on_the_group_host_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GLOO_INTERFACE_ENV, raising=False)
    host = meet("127.0.0.1", 0, 2, True, TIMEOUT)
    try:
        port = str(host.store.port)
        assert listening_addresses(os.getpid())[port] == "127.0.0.1"  # torch's own: *:port
        mate = meet("127.0.0.1", host.store.port, 2, False, TIMEOUT)
        mate.store.set("from rank 1", "hello")
        assert host.store.get("from rank 1") == b"hello"
        loopback_interface = interface_of("127.0.0.1")
        assert loopback_interface is not None and os.environ[GLOO_INTERFACE_ENV] == loopback_interface
    finally:
        host.close()
    assert port not in listening_addresses(os.getpid())


def test_a_rendezvous_is_tcp_host_port() -> None:
    assert address_of("tcp://127.0.0.1:29500") == ("127.0.0.1", 29500)
    for bad in ("file:///tmp/store", "tcp://127.0.0.1", "127.0.0.1:29500"):
        with pytest.raises(ConfigError, match="tcp://host:port"):
            address_of(bad)


def test_groups_off_loopback_need_the_operator_s_consent() -> None:
    grouped = DeploymentSpec(num_decode=2, pool=PoolConfig(decode_ep_size=2))
    with pytest.raises(ConfigError, match="--allow-insecure-kv-transport"):
        check_group_exposure(grouped, "192.0.2.7")
    check_group_exposure(grouped, "127.0.0.1")
    check_group_exposure(DeploymentSpec(num_decode=2, pool=PoolConfig(decode_ep_size=2),
                                        allow_insecure_kv_transport=True), "192.0.2.7")
    check_group_exposure(DeploymentSpec(num_decode=2), "192.0.2.7")  # no group: nothing to expose
