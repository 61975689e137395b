"""The prefill worker: computes prompts and sends their KV, layer by layer, to the decode worker the
router chose (`AddRequest.remote_decode`); the engine's runner begins each hand-off when a prompt ends
and the engine's hand-off frees the blocks once the send ends. No commands of its own."""

from __future__ import annotations

from kvbaton.messages.worker_spec import WorkerRole
from kvbaton.worker.roles.engine_role import EngineRole


class PrefillRole(EngineRole):
    role = WorkerRole.PREFILL
    sends_kv = True
