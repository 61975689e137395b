"""Mooncake's data plane is unauthenticated and listens on every interface whatever host it is given: a worker
refuses to start it, on loopback too, unless the operator allowed it explicitly
(`kvbaton serve --allow-insecure-kv-transport`)."""

from __future__ import annotations

import os
import re
import secrets

import pytest
import torch

from kvbaton.cli import build_parser, deployment_from_args
from kvbaton.kv.connectors import ConnectorConfig, make_receiver, make_sender
from kvbaton.kv.connectors.mooncake.engine import check_data_plane
from kvbaton.kv.pools import KVPools
from kvbaton.platform.net import is_loopback
from tests.kv import kv_receiver_peer as peer
from tests.support.procs import listening_addresses

SECRET = secrets.token_hex(16).encode()


@pytest.mark.parametrize("make", [make_sender, make_receiver])
@pytest.mark.parametrize("host", ["10.0.0.7", "127.0.0.1"])
def test_the_transport_is_refused_without_the_operator_s_consent(make, host):
    pools = KVPools(peer.kv_layout(torch.float32), peer.pools(torch.float32))
    with pytest.raises(ValueError, match=rf"on {re.escape(host)}: its data plane is unauthenticated.*"
                                         r"every interface.*--allow-insecure-kv-transport"):
        make(ConnectorConfig("mooncake", SECRET, host=host), pools)


def test_only_an_explicit_allow_passes():
    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
        assert is_loopback(host)
        with pytest.raises(ValueError, match="on loopback too"):
            check_data_plane(host, allow_insecure=False)
        check_data_plane(host, allow_insecure=True)
    for host in ("0.0.0.0", "10.0.0.7", "node-3.cluster", "::"):
        assert not is_loopback(host)
        check_data_plane(host, allow_insecure=True)


def test_given_loopback_the_engine_still_listens_on_every_interface():
    """Why loopback is no exemption: read from the kernel's listening sockets (`ss`), not from our flags. If a
    Mooncake release binds the host it is given, this fails: then loopback may pass again."""
    from kvbaton.kv.connectors.mooncake.engine import Engine

    engine = Engine("127.0.0.1", KVPools(peer.kv_layout(torch.float32), peer.pools(torch.float32)),
                    allow_insecure=True)
    try:
        bound = listening_addresses(os.getpid())
        assert bound[str(engine.engine.get_rpc_port())] in ("0.0.0.0", "*"), bound
    finally:
        engine.close()


def test_the_serve_flag_reaches_the_deployment():
    args = build_parser().parse_args(["serve", "--kv-transport", "mooncake", "--allow-insecure-kv-transport"])
    assert deployment_from_args(args).allow_insecure_kv_transport
    assert not deployment_from_args(build_parser().parse_args(["serve"])).allow_insecure_kv_transport


def test_a_deployment_refuses_it_before_any_worker_starts():
    from kvbaton.cluster.deploy import DeploymentSpec
    from kvbaton.config import ConfigError

    with pytest.raises(ConfigError, match="on loopback too.*--allow-insecure-kv-transport"):
        DeploymentSpec(kv_transport="mooncake")
    assert DeploymentSpec(kv_transport="mooncake", allow_insecure_kv_transport=True).kv_transport == "mooncake"


def test_a_deployment_refuses_the_mooncake_store_tier_without_consent():
    from kvbaton.cluster.deploy import DeploymentSpec, check_store_exposure
    from kvbaton.config import ConfigError, KVStoreConfig

    store = KVStoreConfig(tiers=("shm", "mooncake"))
    with pytest.raises(ConfigError, match="mooncake KV store tier.*every interface.*--allow-insecure-kv-transport"):
        check_store_exposure(store, DeploymentSpec())
    check_store_exposure(store, DeploymentSpec(allow_insecure_kv_transport=True))
    check_store_exposure(KVStoreConfig(tiers=("shm", "disk", "redis")), DeploymentSpec())
