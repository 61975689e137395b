"""Mooncake's data plane is unauthenticated: a worker refuses to start it off loopback unless the
operator allowed it explicitly (`kvbaton serve --allow-insecure-kv-transport`)."""

from __future__ import annotations

import secrets

import pytest
import torch

from kvbaton.cli import build_parser, deployment_from_args
from kvbaton.kv.connectors import ConnectorConfig, make_receiver, make_sender
from kvbaton.kv.connectors.mooncake.engine import check_data_plane
from kvbaton.kv.pools import KVPools
from kvbaton.platform.net import is_loopback
from tests.kv import kv_receiver_peer as peer

SECRET = secrets.token_hex(16).encode()


@pytest.mark.parametrize("make", [make_sender, make_receiver])
def test_a_non_loopback_host_is_refused_with_the_reason(make):
    pools = KVPools(peer.kv_layout(torch.float32), peer.pools(torch.float32))
    with pytest.raises(ValueError, match=r"on 10\.0\.0\.7: its data plane is unauthenticated.*"
                                         r"--allow-insecure-kv-transport"):
        make(ConnectorConfig("mooncake", SECRET, host="10.0.0.7"), pools)


def test_loopback_or_an_explicit_allow_passes():
    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
        assert is_loopback(host)
        check_data_plane(host, allow_insecure=False)
    for host in ("0.0.0.0", "10.0.0.7", "node-3.cluster", "::"):
        assert not is_loopback(host)
        check_data_plane(host, allow_insecure=True)


def test_the_serve_flag_reaches_the_deployment():
    args = build_parser().parse_args(["serve", "--kv-transport", "mooncake", "--allow-insecure-kv-transport"])
    assert deployment_from_args(args).allow_insecure_kv_transport
    assert not deployment_from_args(build_parser().parse_args(["serve"])).allow_insecure_kv_transport
