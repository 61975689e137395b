"""`kvbaton chat` and `kvbaton complete` flags, and the loop that reads what the user types.

Wiring into the top-level CLI: `add_client_parsers(subparsers)` adds both commands, `main(args)`
runs a parsed one. httpx is imported only once a command runs, so `kvbaton --help` stays quick.
Input is read line by line from stdin, with a `> ` prompt only on a terminal, so a script can
pipe a conversation in and read from stdout each answer alone, followed by a newline.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbaton.client.sessions import Session

DEFAULT_URL = "http://127.0.0.1:8000/v1"
QUIT = ("/quit", "/exit")


def add_client_parsers(subparsers: argparse._SubParsersAction) -> None:
    chat = subparsers.add_parser("chat", help="chat in the terminal with a running OpenAI-compatible server",
                                 description="Each line read is a turn; the conversation keeps its history. "
                                             "/quit or end of input ends it.")
    _add_endpoint_args(chat)
    chat.add_argument("--system", default=None, help="a system message to begin the conversation with")
    complete = subparsers.add_parser("complete", help="complete prompts on a running OpenAI-compatible server",
                                     description="Completes --prompt, or each line read (no history between "
                                                 "them) until /quit or end of input.")
    _add_endpoint_args(complete)
    complete.add_argument("--prompt", default=None, help="complete this one prompt and exit")


def _add_endpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help="the API base URL (default: %(default)s)")
    p.add_argument("--model", default=None, help="the model to ask (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("KVBATON_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $KVBATON_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("--max-tokens", type=int, default=None, help="the longest answer (default: the server's)")
    p.add_argument("--temperature", type=float, default=None, help="0: greedy (default: the server's)")


def main(args: argparse.Namespace) -> int:
    """Run a parsed `chat` or `complete`; a problem with the server prints one line and returns 2."""
    from kvbaton.client.endpoint import ClientError, Endpoint
    from kvbaton.client.sessions import Sampling, Session

    try:
        endpoint = Endpoint(args.url, args.api_key)
        with endpoint.connect() as http:
            sampling = Sampling(args.model or endpoint.first_model(http), args.max_tokens, args.temperature)
            _run(args, Session(endpoint=endpoint, http=http, sampling=sampling, out=sys.stdout))
    except ClientError as exc:
        print(f"kvbaton: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace, session: Session) -> None:
    from kvbaton.client.sessions import Conversation

    if args.command == "complete" and args.prompt is not None:
        session.complete(args.prompt)
        return
    _banner(args.command, session.sampling.model, session.endpoint.url)
    if args.command == "chat":
        conversation = Conversation.start(session, args.system)
        for line in user_lines():
            conversation.say(line)
    else:
        for line in user_lines():
            session.complete(line)


def user_lines(prompt: str = "> ") -> Iterator[str]:
    """The lines typed (after a prompt, on a terminal) or piped in, until end of input or /quit; blank ones skipped."""
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            try:
                line = input(prompt)
            except EOFError:
                print(file=sys.stderr)
                return
        else:
            line = sys.stdin.readline()
            if not line:
                return
        line = line.rstrip("\r\n")
        if line.strip() in QUIT:
            return
        if line.strip():
            yield line


def _banner(command: str, model: str, url: str) -> None:
    if sys.stdin.isatty():  # a pipe gets the answers alone
        print(f"kvbaton {command}: {model} at {url}; /quit or Ctrl-D ends", file=sys.stderr)
