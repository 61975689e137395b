"""The decode worker: reserves blocks for a prompt's KV (reporting its own prefix-cache hit, so only
the blocks it lacks travel), takes the KV in, and decodes once the first token arrives; short
prompts it prefills itself (a plain `AddRequest`)."""

from __future__ import annotations

from kvbaton.engine.core import EngineCore
from kvbaton.messages.router_worker import (
    CancelReceive,
    PrepareReceive,
    ReceiveReady,
    ReceiveRefused,
    RequestFailed,
    StartDecode,
)
from kvbaton.messages.worker_spec import WorkerRole
from kvbaton.sched.sampling_params import InvalidRequestError
from kvbaton.worker.roles.base import Handler, WorkerContext
from kvbaton.worker.roles.engine_role import EngineRole, received_embeddings


class DecodeRole(EngineRole):
    role = WorkerRole.DECODE
    receives_kv = True

    def role_commands(self, worker: WorkerContext) -> dict[type, Handler]:
        return {PrepareReceive: lambda msg: prepare_receive(self.core, worker, msg),
                StartDecode: lambda msg: self.core.handoff.start_decode(msg.request_id, msg.first_token_id),
                CancelReceive: lambda msg: cancel_receive(self.core, msg)}


def prepare_receive(core: EngineCore, worker: WorkerContext, msg: PrepareReceive) -> None:
    """Reserve blocks for the prompt's KV; answer ReceiveReady, ReceiveRefused (no room now) or
    RequestFailed (a request this engine cannot run)."""
    try:
        embeddings = received_embeddings(msg.embeddings)
        req = core.new_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.priority,
                               image_digests=[digest for digest, _ in embeddings],
                               image_sizes=[(e.width, e.height) for e in msg.embeddings])
        reserved = core.reserve_for_transfer(req, msg.deadline_s, embeddings)
    except (InvalidRequestError, ValueError) as exc:
        worker.send(RequestFailed(worker.name, msg.request_id, str(exc)))
        return
    if reserved is None:
        worker.send(ReceiveRefused(worker.name, msg.request_id, "no free KV blocks"))
        return
    worker.send(ReceiveReady(worker.name, msg.request_id, reserved.num_cached_tokens, reserved.dst_block_ids))


def cancel_receive(core: EngineCore, msg: CancelReceive) -> None:
    for request_id in msg.request_ids:
        core.cancel_receive(request_id)
