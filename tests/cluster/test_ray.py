"""`--backend ray`: a private Ray head on 127.0.0.1, gang-scheduled placement groups, fast and
clean failure of impossible placements, and real workers started as Ray actors.

Everything that starts Ray is marked slow (a head costs ~10 s here); one head serves the module
and is stopped by PID at the end.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvbaton.cluster.ray import (
    PlacementError,
    RayLauncher,
    bind_to_node,
    check_feasible,
    plan_groups,
    spread_selector,
)
from kvbaton.cluster.ray.actor import _Secret
from kvbaton.config import CacheConfig, EngineConfig
from kvbaton.messages.router_worker import FromWorker, Shutdown, WorkerHello
from kvbaton.messages.worker_spec import ROUTER_NAME, ConnectorSpec, WorkerRole, WorkerSpec
from kvbaton.wire import Peer, SequencedCodec, cluster_secret
from tests.support.helpers import TINY_VOCAB
from tests.support.wait import async_wait_until

NUM_CPUS = 2
ROUTER = Peer.fresh(ROUTER_NAME)  # the session the real-worker test plays the router in


def spec(role: str, index: int = 0, model: str = "unused", router: str = "tcp://127.0.0.1:1") -> WorkerSpec:
    engine = EngineConfig(model=model, dtype="float32", num_threads=1, kernels=False,
                          cache=CacheConfig(block_size=4, num_blocks=64))
    return WorkerSpec(role=WorkerRole(role), index=index, engine=engine, router=router, heartbeat_s=0.2,
                      router_session=ROUTER.session.hex())


# ---- without a cluster -------------------------------------------------------------------------


def test_plan_one_bundle_per_rank():
    groups = plan_groups([spec("prefill"), spec("decode")], 0.5, ranks=4)
    assert [g.pool for g in groups] == [WorkerRole.PREFILL, WorkerRole.DECODE]
    assert groups[0].bundles == ({"CPU": 0.5},) * 4 and groups[0].cpus == 2.0
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="cpus_per_worker"):
            plan_groups([spec("decode")], bad)


def test_infeasible_plans_are_refused_before_anything_is_reserved():
    nodes = {"n1": 2.0, "n2": 2.0}
    check_feasible(plan_groups([spec("prefill"), spec("decode")], 2), nodes)
    with pytest.raises(PlacementError, match="prefill pool: kvbaton-prefill-0 needs 3 CPU per rank but the largest "
                                             "node has 2"):
        check_feasible(plan_groups([spec("prefill")], 3), nodes)
    with pytest.raises(PlacementError, match=r"the decode pool \(3 worker\(s\) x 2 rank\(s\) x 1 CPU\): 6 CPU"):
        check_feasible(plan_groups([spec("decode", i) for i in range(3)], 1, ranks=2), nodes)


def test_pools_avoid_each_others_nodes_only_when_the_rest_has_room():
    free = {"a": 4.0, "b": 4.0, "c": 1.0}
    assert spread_selector(set(), 2, 1, free) is None  # nothing to avoid yet
    assert spread_selector({"a"}, 5, 1, free) == {"ray.io/node-id": "!in(a)"}
    assert spread_selector({"b", "a"}, 1, 1, free) == {"ray.io/node-id": "!in(a,b)"}
    assert spread_selector({"a"}, 6, 1, free) is None  # b + c hold 5 CPU: share nodes instead
    assert spread_selector({"a", "b"}, 1, 2, free) is None  # c cannot hold a 2-CPU rank
    assert spread_selector({"a", "b", "c"}, 1, 1, free) is None  # one pool per node is impossible


def test_loopback_hosts_become_the_node_address_off_loopback():
    s = msgspec.structs.replace(spec("decode"), router="tcp://10.0.0.1:5000", connector=ConnectorSpec(transport="tcp"))
    assert bind_to_node(s, "127.0.0.1") == s
    moved = bind_to_node(s, "10.0.0.7")
    assert (moved.host, moved.connector.host, moved.router) == ("10.0.0.7", "10.0.0.7", s.router)
    pinned = msgspec.structs.replace(s, host="10.0.0.9", connector=ConnectorSpec())
    assert bind_to_node(pinned, "10.0.0.7").host == "10.0.0.9"


def test_the_secret_never_shows_in_a_repr():
    sealed = _Secret(b"s3cr3t-s3cr3t-s3cr3t")
    assert "s3cr3t" not in repr(sealed) and "s3cr3t" not in str([sealed])
    assert sealed.reveal() == b"s3cr3t-s3cr3t-s3cr3t"


# ---- a private local cluster -------------------------------------------------------------------


@pytest.fixture(scope="module")
def launcher():
    launcher = RayLauncher(cluster_secret(), num_cpus=NUM_CPUS, placement_timeout_s=10.0)
    t0 = time.monotonic()
    launcher.start()
    print(f"ray head up in {time.monotonic() - t0:.1f} s")
    head = launcher.head
    try:
        yield launcher
    finally:
        launcher.close()
        assert head.proc.poll() is not None
        assert not head.temp_dir.exists()
        with pytest.raises(ProcessLookupError):
            os.killpg(head.proc.pid, 0)  # nothing of its session is left


def live_groups() -> dict[str, dict]:
    import ray

    return {pg_id: t for pg_id, t in ray.util.placement_group_table().items() if t["state"] != "REMOVED"}


def listening_addresses(pids: set[int]) -> list[str]:
    """The local addresses of the TCP sockets these processes listen on (from /proc)."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except (FileNotFoundError, PermissionError):
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.append(_decode_ip(fields[1].split(":")[0]))
    return found


def _decode_ip(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # per-word byte order
    addr = ipaddress.ip_address(raw)
    return str(getattr(addr, "ipv4_mapped", None) or addr)


def session_pids(pgid: int) -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.add(int(entry.name))
            except ProcessLookupError:
                pass
    return pids


@pytest.mark.slow
def test_private_head_is_on_loopback_only(launcher):
    import ray

    assert launcher.gcs_address.startswith("127.0.0.1:")
    assert launcher.start() == "127.0.0.1"  # idempotent: the router's host, on loopback here
    assert [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]] == ["127.0.0.1"]
    assert launcher.node_ip == "127.0.0.1"
    assert ray.cluster_resources()["CPU"] == NUM_CPUS
    pids = session_pids(launcher.head.proc.pid)
    addresses = listening_addresses(pids)
    assert len(pids) >= 3 and addresses  # gcs_server, raylet, ... and their ports
    assert set(addresses) == {"127.0.0.1"}, addresses
    assert ray.nodes()[0]["RayletSocketName"].startswith(f"{launcher.head.temp_dir}/")  # a private temp dir


@pytest.mark.slow
def test_each_worker_gets_a_packed_group_with_a_bundle_per_rank(launcher):
    from ray.util.placement_group import remove_placement_group

    pgs = launcher.reserve([spec("prefill"), spec("decode")], 0.25, ranks=2)
    try:
        table = live_groups()
        for pg, name in zip(pgs, ["kvbaton-prefill-0", "kvbaton-decode-0"]):
            entry = table[pg.id.hex()]
            assert (entry["name"], entry["strategy"], entry["state"]) == (name, "PACK", "CREATED")
            assert entry["bundles"] == {0: {"CPU": 0.25}, 1: {"CPU": 0.25}}
    finally:
        for pg in pgs:
            remove_placement_group(pg)
    assert live_groups() == {}


@pytest.mark.slow
def test_impossible_placement_fails_fast_and_keeps_nothing(launcher):
    # fast: these messages come only from the feasibility check made before anything is reserved or waited for
    # (a placement that waited would say "not granted within"), so no clock is needed to tell
    with pytest.raises(PlacementError, match=r"prefill pool .* \+ the decode pool \(2 worker\(s\) x 1 rank\(s\) x 1 "
                                             r"CPU\): 3 CPU in all, but the cluster has 2 CPU on 1 node\(s\) "
                                             r"\(127.0.0.1: 2 CPU, [\d.]+ free\)"):
        launcher.launch_many([spec("prefill"), spec("decode", 0), spec("decode", 1)], cpus_per_worker=1)
    with pytest.raises(PlacementError, match="needs 8 CPU per rank but the largest node has 2"):
        launcher.launch_many([spec("decode")], cpus_per_worker=8)
    launcher.cpus_per_worker = 8  # what the protocol's one-worker `launch` places by
    try:
        with pytest.raises(PlacementError, match="needs 8 CPU per rank but the largest node has 2"):
            launcher.launch(spec("decode"))
    finally:
        launcher.cpus_per_worker = None
    assert live_groups() == {} and launcher.list_workers() == []


@pytest.mark.slow
def test_placement_not_granted_in_time_gives_back_what_it_got(launcher):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    other = placement_group([{"CPU": 1.25}])  # someone else's: leaves 0.75 CPU
    ray.get(other.ready(), timeout=10)
    saved, launcher.placement_timeout_s = launcher.placement_timeout_s, 2.0  # a setting, not a stand-in
    t0 = time.monotonic()
    try:
        with pytest.raises(PlacementError, match=r"kvbaton-decode-0 not granted within 2 s; the cluster has 2 CPU .*"
                                                 r"[\d.]+ free\)\. Nothing was kept"):
            launcher.launch_many([spec("prefill"), spec("decode")], cpus_per_worker=0.5)  # prefill fits, decode not
        assert time.monotonic() - t0 < 15  # a generous deadline: 7.5x the 2 s placement timeout
        assert set(live_groups()) == {other.id.hex()}  # the granted prefill group went back too
        assert launcher.list_workers() == []
    finally:
        launcher.placement_timeout_s = saved
        remove_placement_group(other)


JOIN_SCRIPT = """
import json, sys
import ray
from kvbaton.cluster.ray import RayLauncher
from kvbaton.config import EngineConfig
from kvbaton.messages.worker_spec import WorkerRole, WorkerSpec
launcher = RayLauncher(b"0123456789abcdef0123", address=sys.argv[1])
host = launcher.start()
address = launcher.gcs_address
spec = WorkerSpec(role=WorkerRole.DECODE, index=7, engine=EngineConfig(model="unused"), router="tcp://127.0.0.1:1")
pg = launcher.reserve([spec], 0.25)[0]
state = ray.util.placement_group_table(pg)["state"]
nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
launcher.close()
print("RESULT", json.dumps({"address": address, "host": host, "node_ip": nodes, "state": state,
                            "head": launcher.head is None}))
"""


def ray_client_env(mode: str | None = None, **auth: str) -> dict[str, str]:
    """This environment with only the given RAY_AUTH_* settings (what a user's shell would set)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    return {**env, **({"RAY_AUTH_MODE": mode} if mode else {}), **{f"RAY_AUTH_{k}": v for k, v in auth.items()}}


@pytest.mark.slow
def test_another_process_joins_with_address_and_leaves_the_head_running(launcher):
    env = ray_client_env("token", TOKEN_PATH=str(launcher.head.token_path))  # --address: the user's auth settings
    out = subprocess.run([sys.executable, "-c", JOIN_SCRIPT, launcher.gcs_address], capture_output=True, text=True,
                         timeout=120, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    result = json.loads(lines[0][7:])
    assert result == {"address": launcher.gcs_address, "host": "127.0.0.1", "node_ip": ["127.0.0.1"],
                      "state": "CREATED", "head": True}
    assert launcher.head.proc.poll() is None  # joining never stops a head it did not start
    assert live_groups() == {}  # the joined driver's group went with it


CLIENT_SCRIPT = """
import sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR")
print("RESULT", ray.get(ray.remote(lambda: ray.get_runtime_context().get_node_id()).remote(), timeout=30))
"""


@pytest.mark.slow
def test_the_private_head_refuses_a_client_without_its_token(launcher):
    token_path = launcher.head.token_path
    assert token_path.stat().st_mode & 0o777 == 0o600 and len(token_path.read_text()) == 64
    assert not {k for k in os.environ if k.startswith("RAY_AUTH_")}  # the driver's settings were scoped
    for pid in session_pids(launcher.head.proc.pid):
        assert token_path.read_bytes() not in cmdline(pid)

    def client(env: dict[str, str]) -> subprocess.CompletedProcess:
        env["RAY_gcs_server_port_wait_time_s"] = "2"  # how long a refused driver retries (Ray: 20 tries, ~1 s apart)
        return subprocess.run([sys.executable, "-c", CLIENT_SCRIPT, launcher.gcs_address], capture_output=True,
                              text=True, timeout=60, env=env)

    t0 = time.monotonic()
    for env in (ray_client_env(), ray_client_env("token", TOKEN="0" * 64)):  # no token; a wrong one
        out = client(env)
        assert out.returncode != 0 and "InvalidAuthToken" in out.stderr, out.stderr[-3000:]
        assert "RESULT" not in out.stdout
    out = client(ray_client_env("token", TOKEN_PATH=str(token_path)))
    assert out.returncode == 0 and "RESULT " in out.stdout, out.stderr[-3000:]
    print(f"two refusals and one admission in {time.monotonic() - t0:.1f} s")


# ---- real workers ------------------------------------------------------------------------------


def await_hellos(socket: zmq.Socket, codec: SequencedCodec, names: set[str],
                 timeout_s: float) -> dict[str, WorkerHello]:
    hellos: dict[str, WorkerHello] = {}
    deadline = time.monotonic() + timeout_s
    while set(hellos) != names and time.monotonic() < deadline:
        if socket.poll(500):
            received = codec.try_decode(socket.recv(), "test router", hello=WorkerHello)
            if received is not None and isinstance(received.msg, WorkerHello):
                msg = received.msg
                hellos[msg.name] = msg
    return hellos


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.slow
def test_prefill_and_decode_workers_start_as_actors_and_announce(launcher, tiny_models):
    ctx = zmq.Context()
    router = ctx.socket(zmq.PULL)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    model = str(tiny_models["llama"])
    specs = [spec("prefill", 0, model, f"tcp://127.0.0.1:{port}"), spec("decode", 0, model, f"tcp://127.0.0.1:{port}")]
    names = {s.name for s in specs}
    try:
        t0 = time.monotonic()
        placed = launcher.launch_many(specs, cpus_per_worker=0.5)
        assert {(w.name, w.rank, w.node_ip) for w in placed} == {(n, 0, "127.0.0.1") for n in names}
        assert len({w.placement_group_id for w in placed}) == 2
        codec = SequencedCodec(launcher.secret, FromWorker, ROUTER)
        hellos = await_hellos(router, codec, names, 180)
        assert set(hellos) == names, f"only {sorted(hellos)} said hello"
        print(f"workers announced in {time.monotonic() - t0:.1f} s")
        workers = {w.name: w for w in launcher.list_workers()}
        for name, hello in hellos.items():
            assert launcher.is_alive(name) and launcher.pid(name) == hello.pid == workers[name].pid
            assert workers[name].actor_id and hello.address.startswith("tcp://127.0.0.1:")
            assert cmdline(hello.pid).split(b"\0")[0].startswith(name.encode())  # `ps` shows kvbaton-<role>-<i>
        for pid in session_pids(launcher.head.proc.pid):  # workers, actors, raylet, ...
            assert launcher.secret not in cmdline(pid)
        push = ctx.socket(zmq.PUSH)
        push.connect(hellos["kvbaton-decode-0"].address)
        push.send(codec.encode(Shutdown(), "kvbaton-decode-0"))
        launcher.stop("kvbaton-decode-0", timeout_s=20)
        assert launcher.exit_codes["kvbaton-decode-0"] == 0  # exits on its own: no signal needed
        assert not launcher.is_alive("kvbaton-decode-0") and launcher.is_alive("kvbaton-prefill-0")
        push.close(linger=0)
        launcher.stop_all(timeout_s=0)  # not told to shut down: interrupted (SIGKILL after 5 s)
        codes = {n: launcher.exit_codes.get(n) for n in names}
        # -SIGINT: the prefill worker ended on the interrupt, not on the SIGKILL that would follow 5 s later
        assert codes == {"kvbaton-decode-0": 0, "kvbaton-prefill-0": -signal.SIGINT}
    finally:
        launcher.stop_all(timeout_s=0)
        router.close(linger=0)
        ctx.term()
    assert live_groups() == {} and launcher.list_workers() == []
    for hello in hellos.values():
        assert not Path(f"/proc/{hello.pid}").exists()


@pytest.mark.slow
@contextlib.asynccontextmanager
async def served(launcher: RayLauncher, model: Path, num_prefill: int, num_decode: int,
                 local_prefill_threshold: int | None = None, **pool: object):
    """A router over a worker pool on the Ray cluster (`pool`: PoolConfig fields beyond fast heartbeats), shut
    down at the end."""
    from kvbaton.router.router import Router, RouterConfig
    from kvbaton.router.worker_pool import PoolConfig, WorkerPool
    from kvbaton.text.tokenizer import Tokenizer

    config = PoolConfig(heartbeat_s=0.2, dead_after_s=5.0, start_timeout_s=180.0, **pool)  # type: ignore[arg-type]
    workers = WorkerPool(spec("decode", model=str(model)).engine, launcher, launcher.secret, config,
                         ConnectorSpec(transport="shm"), host=launcher.start())
    router_config = RouterConfig() if local_prefill_threshold is None else \
        RouterConfig(local_prefill_threshold=local_prefill_threshold)
    router = Router(workers, Tokenizer(model), router_config)
    try:
        await router.start(num_prefill, num_decode)
        yield router
    finally:
        await router.shutdown()


def test_serve_prefill_to_decode_through_ray(launcher, tiny_models):
    import asyncio

    from tests.support.helpers import hf_greedy
    from tests.support.pd import collect

    model = tiny_models["llama"]
    prompts = [[(7 * i + 3 * j) % TINY_VOCAB + 1 for j in range(n)] for i, n in enumerate([3, 11, 26])]
    launcher.cpus_per_worker = 0.5

    async def scenario():
        async with served(launcher, model, 1, 1) as router:
            pool = router.pool
            outs = await asyncio.gather(*(collect(router, f"r{i}", p, 12) for i, p in enumerate(prompts)))
            roles = {w["name"]: w["role"] for w in router.workers_view()}
            pid = launcher.pid("kvbaton-prefill-0")
            await asyncio.to_thread(launcher.kill, "kvbaton-prefill-0")  # how the router fences a dead worker
            assert not launcher.is_alive("kvbaton-prefill-0") and not Path(f"/proc/{pid}").exists()
            # the pool replaces it under its name, in a new actor and group (bounded wait)
            await async_wait_until(
                lambda: pool.supervisor.restarts("kvbaton-prefill-0") and "kvbaton-prefill-0" in pool.workers,
                120.0, interval_s=0.1, message="the pool did not replace kvbaton-prefill-0")
            assert pool.workers["kvbaton-prefill-0"].pid not in (None, pid) and router.is_alive
            outs.append(await collect(router, "again", prompts[2], 12))
            return outs, roles

    try:
        outs, roles = asyncio.run(asyncio.wait_for(scenario(), 300))
    finally:
        launcher.cpus_per_worker = None
    assert roles == {"kvbaton-prefill-0": "prefill", "kvbaton-decode-0": "decode"}
    assert outs == hf_greedy(model, prompts + prompts[2:], 12)
    assert live_groups() == {} and launcher.list_workers() == []


def test_expert_parallel_groups_through_ray(launcher, tiny_moe_models):
    """1P(EP2) + 1D(EP2): each group's two ranks in one PACK placement group (a bundle each), serving."""
    import asyncio

    from tests.support.helpers import hf_greedy
    from tests.support.pd import collect

    model = tiny_moe_models["qwen3_moe"]
    prompts = [[(5 * i + 3 * j) % TINY_VOCAB + 1 for j in range(n)] for i, n in enumerate([4, 13, 27])]
    launcher.cpus_per_worker = 0.5

    async def scenario():
        async with served(launcher, model, 1, 1, local_prefill_threshold=0, prefill_ep_size=2,
                          decode_ep_size=2) as router:
            outs = await asyncio.gather(*(collect(router, f"r{i}", p, 10) for i, p in enumerate(prompts)))
            return outs, launcher.list_workers()

    try:
        outs, ranks = asyncio.run(asyncio.wait_for(scenario(), 300))
    finally:
        launcher.cpus_per_worker = None
    assert outs == hf_greedy(model, prompts, 10)
    by_group: dict[str, list[tuple[str, int]]] = {}
    for w in ranks:
        by_group.setdefault(w.placement_group_id, []).append((w.name, w.bundle_index))
    assert sorted(sorted(g) for g in by_group.values()) == [
        [("kvbaton-decode-0", 0), ("kvbaton-decode-1", 1)], [("kvbaton-prefill-0", 0), ("kvbaton-prefill-1", 1)]]
    assert live_groups() == {} and launcher.list_workers() == []


def test_an_afd_deployment_is_gang_placed_and_a_dead_expert_worker_returns_to_its_bundle(launcher, tiny_moe_models):
    """1 attention worker over 2 expert workers (EPLB on): the three in one PACK placement group, a bundle each,
    serving transformers' tokens; an expert worker killed is replaced in its own bundle, on the port the attention
    worker connects to, and the deployment serves on."""
    import asyncio

    from tests.support.helpers import hf_greedy
    from tests.support.pd import collect

    model = tiny_moe_models["qwen3_moe"]
    prompts = [[(3 * i + 5 * j) % TINY_VOCAB + 1 for j in range(n)] for i, n in enumerate([5, 17, 9])]
    launcher.cpus_per_worker = 0.5

    async def scenario():
        async with served(launcher, model, 0, 1, local_prefill_threshold=0, expert_workers=2, afd_micro_batches=2,
                          num_redundant_experts=2, eplb_interval_steps=2) as router:
            pool = router.pool
            outs = await asyncio.gather(*(collect(router, f"r{i}", p, 10) for i, p in enumerate(prompts)))
            placed = {(w.name, w.bundle_index): w.placement_group_id for w in launcher.list_workers()}
            exchange = pool.workers["kvbaton-expert-1"].experts.address
            await asyncio.to_thread(launcher.kill, "kvbaton-expert-1")  # how the router fences a dead worker
            await async_wait_until(
                lambda: pool.supervisor.restarts("kvbaton-expert-1") and "kvbaton-expert-1" in pool.workers,
                120.0, interval_s=0.1, message="the pool did not replace kvbaton-expert-1")
            replaced = {(w.name, w.bundle_index): w.placement_group_id for w in launcher.list_workers()}
            again = await asyncio.gather(*(collect(router, f"again{i}", p, 10) for i, p in enumerate(prompts)))
            return outs + again, placed, replaced, exchange, pool.workers["kvbaton-expert-1"].experts.address

    try:
        outs, placed, replaced, exchange, exchange_after = asyncio.run(asyncio.wait_for(scenario(), 300))
    finally:
        launcher.cpus_per_worker = None
    assert outs == hf_greedy(model, prompts, 10) * 2
    assert sorted(placed) == [("kvbaton-both-0", 2), ("kvbaton-expert-0", 0), ("kvbaton-expert-1", 1)]
    assert len(set(placed.values())) == 1, "one placement group for the whole deployment"
    assert replaced == placed and exchange_after == exchange
    assert live_groups() == {} and launcher.list_workers() == []
