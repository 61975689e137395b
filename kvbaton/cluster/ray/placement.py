"""Gang placement: one PACK placement group per worker, all of a request's groups or none.

    pool "prefill"   [pg kvbaton-prefill-0: bundle 0 .. N-1]  [pg kvbaton-prefill-1: ...]
    pool "decode"    [pg kvbaton-decode-0:  bundle 0 .. N-1]  ...
                      └ one PACK placement group per worker (N = its tensor-parallel ranks)

- Gang: a worker's bundles are reserved all together or not at all (a placement group is atomic),
  and one reservation keeps all of its placement groups or none: an impossible request fails before
  anything is reserved, one that is not granted in time gives back all it got.
- Pools spread: the groups of a pool avoid the nodes that hold other pools (a per-bundle label
  selector `ray.io/node-id: !in(...)`), but only when the other nodes have room for the whole
  pool; otherwise the pools share nodes (a soft preference, decided from the current free CPUs).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import ray
from ray._private.state import available_resources_per_node, total_resources_per_node
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from kvbaton.messages.worker_spec import WorkerRole, WorkerSpec

NODE_ID_LABEL = "ray.io/node-id"


class PlacementError(RuntimeError):
    """The cluster cannot hold the requested workers; nothing of the request was kept."""


@dataclass(frozen=True)
class GroupPlan:
    """One worker's gang: a bundle per rank, packed."""

    spec: WorkerSpec
    bundles: tuple[dict[str, float], ...]

    @property
    def pool(self) -> WorkerRole:
        return self.spec.role

    @property
    def cpus(self) -> float:
        return sum(b["CPU"] for b in self.bundles)


def plan_groups(specs: Sequence[WorkerSpec], cpus_per_worker: float, ranks: int = 1) -> list[GroupPlan]:
    if cpus_per_worker <= 0 or (cpus_per_worker > 1 and cpus_per_worker != int(cpus_per_worker)):
        raise ValueError(f"cpus_per_worker must be a fraction of 1 or a whole number, not {cpus_per_worker}")
    if ranks < 1:
        raise ValueError("a worker has at least one rank")
    return [GroupPlan(spec, tuple({"CPU": float(cpus_per_worker)} for _ in range(ranks))) for spec in specs]


def check_feasible(groups: Sequence[GroupPlan], node_cpus: dict[str, float]) -> None:
    """Fail before reserving anything when no cluster state could hold `groups`."""
    largest, total = max(node_cpus.values(), default=0.0), sum(node_cpus.values())
    for g in groups:
        if max(b["CPU"] for b in g.bundles) > largest:
            raise PlacementError(f"cannot place the {g.pool.value} pool: {g.spec.name} needs "
                                 f"{g.bundles[0]['CPU']:g} CPU per rank but the largest node has {largest:g}; "
                                 f"{cluster_summary()}")
    demand = sum(g.cpus for g in groups)
    if demand > total:
        raise PlacementError(f"cannot place {describe_pools(groups)}: {demand:g} CPU in all, but "
                             f"{cluster_summary()}")


def spread_selector(avoid: set[str], pool_cpus: float, largest_bundle: float,
                    free_cpus: dict[str, float]) -> dict[str, str] | None:
    """A label selector that keeps a pool off the `avoid` nodes, if the other nodes have room."""
    others = {node: cpus for node, cpus in free_cpus.items() if node not in avoid}
    if not avoid or not others or sum(others.values()) < pool_cpus or max(others.values()) < largest_bundle:
        return None
    return {NODE_ID_LABEL: f"!in({','.join(sorted(avoid))})"}


def reserve_groups(groups: Sequence[GroupPlan], held: Mapping[WorkerRole, set[str]],
                   timeout_s: float) -> list[PlacementGroup]:
    """One ready placement group per plan, in order, pool by pool; `held`: the nodes each pool
    already holds. All or nothing: PlacementError (with every group given back) otherwise."""
    check_feasible(groups, node_cpus(total_resources_per_node()))
    deadline = time.monotonic() + timeout_s
    created: dict[str, PlacementGroup] = {}  # by worker name, in the order of `groups`
    try:
        for pool in dict.fromkeys(g.pool for g in groups):
            avoid = {node for other, nodes in held.items() if other != pool for node in nodes}
            avoid |= {node for g in groups if g.pool != pool and g.spec.name in created
                      for node in bundle_nodes(created[g.spec.name])}
            _reserve_pool([g for g in groups if g.pool == pool], avoid, deadline, timeout_s, created)
    except BaseException:
        for pg in created.values():
            remove_placement_group(pg)
        raise
    return [created[g.spec.name] for g in groups]


def _reserve_pool(groups: list[GroupPlan], avoid: set[str], deadline: float, timeout_s: float,
                  created: dict[str, PlacementGroup]) -> None:
    selector = spread_selector(avoid, sum(g.cpus for g in groups), max(g.bundles[0]["CPU"] for g in groups),
                               node_cpus(available_resources_per_node()))
    for g in groups:
        labels = [selector] * len(g.bundles) if selector else None
        created[g.spec.name] = placement_group(list(g.bundles), strategy="PACK", name=g.spec.name,
                                               bundle_label_selector=labels)
    pgs = [created[g.spec.name] for g in groups]
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs),
                        timeout=max(0.0, deadline - time.monotonic()))
    if len(ready) < len(pgs):
        waiting = [g.spec.name for g, pg in zip(groups, pgs) if not _is_ready(pg)]
        raise PlacementError(f"cannot place {describe_pools(groups)}: {', '.join(waiting)} not granted within "
                             f"{timeout_s:g} s; {cluster_summary()}. Nothing was kept.")


def bundle_nodes(pg: PlacementGroup) -> list[str]:
    """The node of each bundle of a ready placement group."""
    by_index = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    return [by_index[i] for i in range(pg.bundle_count)]


def _is_ready(pg: PlacementGroup) -> bool:
    return ray.util.placement_group_table(pg)["state"] == "CREATED"


def describe_pools(groups: Sequence[GroupPlan]) -> str:
    pools: dict[WorkerRole, list[GroupPlan]] = {}
    for g in groups:
        pools.setdefault(g.pool, []).append(g)
    return " + ".join(f"the {pool.value} pool ({len(gs)} worker(s) x {len(gs[0].bundles)} rank(s) x "
                      f"{gs[0].bundles[0]['CPU']:g} CPU)" for pool, gs in pools.items())


def cluster_summary() -> str:
    """Every node's CPUs, total and free: for error messages, so never raises."""
    try:
        totals, free = total_resources_per_node(), available_resources_per_node()
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    except Exception as exc:  # noqa: BLE001 - only for the error message
        return f"the cluster's resources are unknown ({exc})"
    nodes = ", ".join(f"{ips.get(node, node[:8])}: {res.get('CPU', 0):g} CPU, {free.get(node, {}).get('CPU', 0):g} free"
                      for node, res in totals.items())
    total = sum(res.get("CPU", 0) for res in totals.values())
    return f"the cluster has {total:g} CPU on {len(totals)} node(s) ({nodes})"


def node_cpus(per_node: dict[str, dict[str, float]]) -> dict[str, float]:
    return {node: res.get("CPU", 0.0) for node, res in per_node.items()}
