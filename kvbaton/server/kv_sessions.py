"""`POST /admin/kv/save` and `POST /admin/kv/restore`: a session's KV out to a file and back in.

    save:    prompt / messages -> a 1-token generation (computes what the pool lacks; write-through puts every
             full block into the shared tiers) -> read those blocks from the tiers -> a signed session file
    restore: session file -> checked (signature, model, layout, each block's key from its tokens)
             -> put into the shared tiers -> the next request with that prefix loads it (`cached_tokens`)

Only the shared tiers (shm, redis) take part: the server reaches them as its workers do; a disk tier is one
worker's own directory, locked by it. Tier I/O runs in a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from fastapi import FastAPI, Request, Response

from kvbaton.kv.store.base import KVTier
from kvbaton.kv.store.keys import StoreKeys, model_fingerprint
from kvbaton.kv.store.records import RecordKey
from kvbaton.kv.store.session import (
    SessionError,
    StoreTarget,
    export_session,
    read_session,
    restore_session,
    session_keys,
)
from kvbaton.kv.store.tiers import SHARED_TIERS, open_tier
from kvbaton.sched.sampling_params import SamplingParams
from kvbaton.server.engine_client import EngineClient
from kvbaton.server.errors import ApiError
from kvbaton.server.prompts import PromptEncoder
from kvbaton.server.protocol import KVSaveRequest, plain_messages

SAVE_WAIT_S = 10.0  # how long a save waits for the workers' write-through to reach the tiers
SESSION_MEDIA_TYPE = "application/vnd.kvbaton.kv-session"


class KVSessions:
    def __init__(self, client: EngineClient, prompts: PromptEncoder, secret: bytes | None) -> None:
        self.client, self.prompts, self.secret = client, prompts, secret
        self._opened: tuple[StoreTarget, list[KVTier], StoreKeys] | None = None
        self._lock = asyncio.Lock()

    async def save(self, req: KVSaveRequest) -> tuple[bytes, int]:
        """The session file of the request's prompt, and how many tokens of KV it holds."""
        target, tiers, keys = await self._tiers()
        if target.config.write_policy != "write-through":
            raise ApiError(409, "saving a session needs --kv-store-write-policy write-through (the workers put "
                                "blocks into the store only as they are evicted otherwise)", "ConflictError")
        if req.messages is not None:
            _, token_ids = await self.prompts.chat(plain_messages(req.messages), add_generation_prompt=False)
        else:
            assert req.prompt is not None  # the request model allows exactly one
            _, token_ids = await self.prompts.completion(req.prompt)
        await self._compute(token_ids, req.cache_salt)
        block_keys = session_keys(keys, target.layout, token_ids, req.cache_salt)
        await self._wait_until_stored(tiers, block_keys)
        try:
            data = await asyncio.to_thread(export_session, tiers, keys, target.layout, token_ids, req.cache_salt,
                                           self._secret())
        except SessionError as exc:
            raise ApiError(409 if block_keys else 400, str(exc), "ConflictError" if block_keys else "BadRequestError",
                           "prompt") from None
        return data, len(block_keys) * target.layout.block_size

    async def restore(self, data: bytes) -> dict[str, int]:
        target, tiers, keys = await self._tiers()
        max_tokens = self.client.info.max_model_len
        try:
            session = await asyncio.to_thread(read_session, data, keys, target.layout, self._secret(), max_tokens)
        except SessionError as exc:
            raise ApiError(400, str(exc), "BadRequestError") from None
        stored = await asyncio.to_thread(restore_session, tiers, session)
        if stored < len(session.payloads):
            raise ApiError(507, f"the shared KV tiers took {stored} of the session's {len(session.payloads)} blocks "
                                "(full, or a tier is down)", "InsufficientStorageError")
        return {"tokens": session.num_tokens, "blocks": stored, "prompt_tokens": len(session.header.token_ids)}

    async def close(self) -> None:
        if self._opened is not None:
            for tier in self._opened[1]:
                await asyncio.to_thread(tier.close)

    async def _compute(self, token_ids: list[int], cache_salt: str | None) -> None:
        params = SamplingParams(max_tokens=1, temperature=0.0, cache_salt=cache_salt)
        request_id = f"kv-save-{secrets.token_hex(8)}"
        async for _ in self.client.generate(request_id, None, token_ids, params):
            pass

    async def _wait_until_stored(self, tiers: list[KVTier], block_keys: list[bytes]) -> None:
        """The workers write blocks through after they send a step's outputs: wait for them (bounded)."""
        deadline = time.monotonic() + SAVE_WAIT_S
        while time.monotonic() < deadline:
            held = await asyncio.to_thread(lambda: max((tier.contains(block_keys) for tier in tiers), default=0))
            if held == len(block_keys):
                return
            await asyncio.sleep(0.05)

    async def _tiers(self) -> tuple[StoreTarget, list[KVTier], StoreKeys]:
        async with self._lock:
            if self._opened is None:
                target = self.client.kv_store_target()
                shared = [name for name in target.config.ordered_tiers if name in SHARED_TIERS] if target else []
                if target is None or not shared:
                    raise ApiError(409, "KV sessions need a shared KV store tier: start the server with --kv-store "
                                        "shm (or redis)", "ConflictError")
                payload = target.layout.bytes_per_block
                # NOTE: the workers' record key: deploy() hands them this same secret
                record_key = RecordKey.of_secret(self._secret())
                tiers = await asyncio.to_thread(lambda: [open_tier(name, target.config, payload, record_key)
                                                         for name in shared])
                fingerprint = await asyncio.to_thread(model_fingerprint, target.model_dir)
                self._opened = (target, tiers, StoreKeys.of(fingerprint, target.layout))
            return self._opened

    def _secret(self) -> bytes:
        if self.secret is None:
            raise ApiError(409, "this server was started without a cluster secret for KV sessions", "ConflictError")
        return self.secret


def add_kv_session_routes(app: FastAPI, sessions: KVSessions) -> None:
    @app.post("/admin/kv/save")
    async def save(req: KVSaveRequest) -> Response:
        data, tokens = await sessions.save(req)
        return Response(data, media_type=SESSION_MEDIA_TYPE, headers={"X-KV-Session-Tokens": str(tokens)})

    @app.post("/admin/kv/restore")
    async def restore(raw: Request) -> dict[str, int]:
        return await sessions.restore(await raw.body())
