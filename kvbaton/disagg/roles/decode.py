"""The decode worker: reserves blocks for a prompt's KV (reporting its own prefix-cache hit, so only
the blocks it lacks travel), takes the KV in, and decodes once the first token arrives; short
prompts it prefills itself (a plain `AddRequest`)."""

from __future__ import annotations

from kvbaton.disagg.messages import (
    CancelReceive,
    PrepareReceive,
    ReceiveReady,
    ReceiveRefused,
    RequestFailed,
    StartDecode,
)
from kvbaton.disagg.roles.base import Handler, Role, WorkerContext
from kvbaton.disagg.spec import WorkerRole
from kvbaton.engine.sampling_params import InvalidRequestError


class DecodeRole(Role):
    role = WorkerRole.DECODE
    receives_kv = True

    def commands(self, worker: WorkerContext) -> dict[type, Handler]:
        return {PrepareReceive: lambda msg: prepare_receive(worker, msg),
                StartDecode: lambda msg: worker.core.start_decode(msg.request_id, msg.first_token_id),
                CancelReceive: lambda msg: cancel_receive(worker, msg)}


def prepare_receive(worker: WorkerContext, msg: PrepareReceive) -> None:
    """Reserve blocks for the prompt's KV; answer ReceiveReady, ReceiveRefused (no room now) or
    RequestFailed (a request this engine cannot run)."""
    req = worker.core.new_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.priority)
    try:
        reserved = worker.core.reserve_for_transfer(req, msg.deadline_s)
    except (InvalidRequestError, ValueError) as exc:
        worker.send(RequestFailed(worker.name, msg.request_id, str(exc)))
        return
    if reserved is None:
        worker.send(ReceiveRefused(worker.name, msg.request_id, "no free KV blocks"))
        return
    worker.send(ReceiveReady(worker.name, msg.request_id, reserved.num_cached_tokens, reserved.dst_block_ids))


def cancel_receive(worker: WorkerContext, msg: CancelReceive) -> None:
    for request_id in msg.request_ids:
        worker.core.cancel_receive(request_id)
