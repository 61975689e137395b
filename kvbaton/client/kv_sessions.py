"""`kvbaton kv save` and `kvbaton kv restore`: a session's KV from a running server into a file, and back.

    kvbaton kv save --messages chat.json -o chat.kvs      # the KV of a conversation so far
    kvbaton kv restore chat.kvs                           # later, or on another server with the same secret

The server signs the file with its cluster secret and checks it on restore (see
`kvbaton.kv.store.session`); both need `kvbaton serve --kv-store shm` (or redis). httpx is imported only
when a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

DEFAULT_SERVER = "http://127.0.0.1:8000"


class KVSessionError(Exception):
    """A one-line reason the command failed."""


def add_kv_parser(subparsers: argparse._SubParsersAction) -> None:
    kv = subparsers.add_parser("kv", help="save a session's KV from a running server to a file, or restore one")
    sub = kv.add_subparsers(dest="kv_command", required=True)
    save = sub.add_parser("save", help="compute (or find) a prompt's KV on the server and write it to a file")
    source = save.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="a completion prompt (text)")
    source.add_argument("--messages", type=Path, help="a JSON file holding a chat's messages so far")
    save.add_argument("--cache-salt", default=None, help="the cache_salt the session's requests use")
    save.add_argument("-o", "--output", type=Path, required=True, help="the session file to write")
    restore = sub.add_parser("restore", help="put a saved session's KV into the server's shared KV store")
    restore.add_argument("file", type=Path)
    for p in (save, restore):
        p.add_argument("--url", default=DEFAULT_SERVER, help="the server's base URL (default: %(default)s)")
        p.add_argument("--api-key", default=os.environ.get("KVBATON_ADMIN_API_KEY", os.environ.get("KVBATON_API_KEY")),
                       help="the server's admin key (default: $KVBATON_ADMIN_API_KEY, else $KVBATON_API_KEY)")


def cmd_kv(args: argparse.Namespace) -> int:
    try:
        print(save(args) if args.kv_command == "save" else restore(args))
    except KVSessionError as exc:
        print(f"kvbaton: error: {exc}", file=sys.stderr)
        return 2
    return 0


def save(args: argparse.Namespace) -> str:
    body: dict = {"cache_salt": args.cache_salt} if args.cache_salt else {}
    if args.messages is not None:
        try:
            body["messages"] = json.loads(args.messages.read_text())
        except (OSError, ValueError) as exc:
            raise KVSessionError(f"cannot read messages from {args.messages}: {exc}") from None
    else:
        body["prompt"] = args.prompt
    resp = _post(args, "/admin/kv/save", json=body)
    try:
        _write_private(args.output, resp.content)
    except OSError as exc:
        raise KVSessionError(f"cannot write {args.output}: {exc}") from None
    return f"saved {resp.headers.get('x-kv-session-tokens', '?')} tokens of KV to {args.output} " \
           f"({len(resp.content)} bytes)"


def _write_private(path: Path, data: bytes) -> None:
    """Readable by its owner only: the KV of a prompt gives the prompt away (and a restore trusts it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o600)  # a file that was there keeps its mode through O_CREAT
        f.write(data)


def restore(args: argparse.Namespace) -> str:
    try:
        data = args.file.read_bytes()
    except OSError as exc:
        raise KVSessionError(f"cannot read {args.file}: {exc}") from None
    result = _post(args, "/admin/kv/restore", content=data,
                   headers={"Content-Type": "application/vnd.kvbaton.kv-session"}).json()
    return f"restored {result['tokens']} tokens of KV ({result['blocks']} blocks) from {args.file}"


def _post(args: argparse.Namespace, path: str, **kwargs: Any) -> httpx.Response:
    import httpx

    headers = {**kwargs.pop("headers", {}), **({"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})}
    try:
        resp = httpx.post(f"{args.url.rstrip('/')}{path}", headers=headers, timeout=600, **kwargs)
    except httpx.HTTPError as exc:
        raise KVSessionError(f"cannot reach {args.url}: {exc}") from None
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text[:200]
        raise KVSessionError(f"{resp.status_code}: {message}")
    return resp
