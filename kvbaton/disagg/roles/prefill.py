"""The prefill worker: computes prompts and sends their KV, layer by layer, to the decode worker the
router chose (`AddRequest.remote_decode`); the engine's runner begins each hand-off when a prompt ends
and the engine's hand-off frees the blocks once the send ends. No commands of its own."""

from __future__ import annotations

from kvbaton.disagg.roles.base import Role
from kvbaton.disagg.spec import WorkerRole


class PrefillRole(Role):
    role = WorkerRole.PREFILL
    sends_kv = True
