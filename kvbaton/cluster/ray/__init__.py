"""`--backend ray`: workers as Ray actors in gang-scheduled placement groups.

    launcher.py   RayLauncher: the `Launcher` protocol over a joined or private cluster
    placement.py  one PACK placement group per worker, pools spread, all or nothing
    actor.py      WorkerHost: the actor that runs one rank's worker as its child process
    head.py       LocalHead: a private single-machine head, stopped by PID (never `ray stop`)
    loopback.py   keeping every Ray address on 127.0.0.1, and checking it
    auth.py       the private head's Ray auth token: a 0600 file, read by the head and by us
"""

from kvbaton.cluster.ray.actor import HostInfo, WorkerHost, bind_to_node
from kvbaton.cluster.ray.head import LocalHead
from kvbaton.cluster.ray.launcher import RayLauncher, RayWorker
from kvbaton.cluster.ray.loopback import LOOPBACK, check_loopback
from kvbaton.cluster.ray.placement import (
    GroupPlan,
    PlacementError,
    check_feasible,
    plan_groups,
    spread_selector,
)

__all__ = [
    "LOOPBACK",
    "GroupPlan",
    "HostInfo",
    "LocalHead",
    "PlacementError",
    "RayLauncher",
    "RayWorker",
    "WorkerHost",
    "bind_to_node",
    "check_feasible",
    "check_loopback",
    "plan_groups",
    "spread_selector",
]
