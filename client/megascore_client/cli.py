"""The ``megascore`` command line.

Subcommands::

    megascore serve ...                       run a server (needs megascore[server])
    megascore score INPUT.jsonl -o OUT.jsonl  score a JSONL file (resumable)
    megascore info                            model info as JSON
    megascore health                          exit 0 when SERVING
    megascore load-weights MODEL              hot-swap weights
    megascore push-weights PATH               stream safetensors from here (progress bar)

Connection flags (all but ``serve``): ``--target`` (default ``$MEGASCORE_TARGET`` or
127.0.0.1:50051), ``--token`` (default ``$MEGASCORE_TOKEN``), ``--token-file``
(default ``$MEGASCORE_TOKEN_FILE``), ``--tls``,
``--root-ca``, ``--client-cert``, ``--client-key``, ``--server-name``, ``--timeout``,
``--load-balancing``. ``megascore score --wait-for-server S`` rides out a server that is
down or restarting for up to S seconds (the client's ``wait_for_server_s``); the
per-request ``--timeout`` must then exceed S, and defaults to 60 + S.

``serve`` is not part of the client: it is the command registered under the name
``serve`` in the entry point group :data:`COMMAND_GROUP` (the package declares
``megascore_server.main:main`` there), so the client never imports the server.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from importlib.metadata import entry_points
from pathlib import Path

from megascore import __version__
from megascore_client import score_jsonl
from megascore_client.channel import TlsConfig
from megascore_client.client import ScoringClient
from megascore_client.client_base import LOAD_WEIGHTS_TIMEOUT_S
from megascore_client.errors import ScoringError
from megascore_client.push import requests as push
from megascore_client.push.requests import ElapsedLine

__all__ = ["COMMAND_GROUP", "build_parser", "main", "make_client", "serve"]

COMMAND_GROUP = "megascore.commands"
DEFAULT_TARGET = "127.0.0.1:50051"
_INSTALL_SERVER = "Install it with: pip install 'megascore[server]'"
DEFAULT_TIMEOUT_S = 60.0


_TIMEOUT_HELP = {
    "score": f"deadline of each request in seconds (default: {DEFAULT_TIMEOUT_S:g} plus "
    "--wait-for-server)",
    "load-weights": f"deadline of the load in seconds (default: {LOAD_WEIGHTS_TIMEOUT_S:g})",
    "push-weights": f"deadline of the whole push in seconds (default: {push.PUSH_TIMEOUT_S:g})",
}


def _add_connection_args(parser: argparse.ArgumentParser, command: str) -> None:
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--target",
        default=os.environ.get("MEGASCORE_TARGET", DEFAULT_TARGET),
        help="server address, e.g. host:port or dns:///name:port (env MEGASCORE_TARGET)",
    )
    group.add_argument(
        "--token",
        default=os.environ.get("MEGASCORE_TOKEN"),
        help="bearer token (env MEGASCORE_TOKEN)",
    )
    group.add_argument(
        "--token-file",
        default=os.environ.get("MEGASCORE_TOKEN_FILE"),
        help="file holding the bearer token, instead of --token (env MEGASCORE_TOKEN_FILE)",
    )
    group.add_argument("--tls", action="store_true", help="use TLS (implied by the TLS files)")
    group.add_argument("--root-ca", help="PEM CA bundle of the server certificate")
    group.add_argument("--client-cert", help="PEM client certificate (mutual TLS)")
    group.add_argument("--client-key", help="PEM client key (mutual TLS)")
    group.add_argument("--server-name", help="expected server certificate name")
    group.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=_TIMEOUT_HELP.get(
            command, f"deadline of the request in seconds (default: {DEFAULT_TIMEOUT_S:g})"
        ),
    )
    group.add_argument(
        "--load-balancing",
        choices=("pick_first", "round_robin", "prefix"),
        help="load balancing over the target's addresses: gRPC's pick_first (default) or "
        "round_robin, or prefix (each Score request to the replica its first tokens hash to)",
    )


def _wait_for_server(args: argparse.Namespace) -> float:
    return getattr(args, "wait_for_server", 0.0)


def _timeout(args: argparse.Namespace) -> float:
    """``--timeout``, or its default: 60 s plus ``--wait-for-server`` (the re-sends of
    a request waiting for the server happen inside its deadline)."""
    if args.timeout is not None:
        return args.timeout
    return DEFAULT_TIMEOUT_S + _wait_for_server(args)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Cross-flag checks argparse cannot do; exits with a usage error (2)."""
    wait = _wait_for_server(args)
    if wait > 0 and args.timeout is not None and args.timeout <= wait:
        parser.error(
            f"--timeout ({args.timeout:g} s) must exceed --wait-for-server ({wait:g} s): "
            "the re-sends happen inside each request's deadline; leave --timeout out "
            f"(default {DEFAULT_TIMEOUT_S:g} + {wait:g} s) or raise it"
        )


def _missing_input(args: argparse.Namespace) -> str | None:
    """What is wrong with the local file a command reads, or None."""
    if args.command == "score" and not args.input.is_file():
        return f"input {args.input}: no such file"
    if args.command == "push-weights" and not Path(args.path).exists():
        return f"path {args.path}: no such file or directory"
    return None


class WaitNotice:
    """Says on stderr what a command waits for and for how long (the client's
    ``on_wait``): a line when the wait starts, one every ``every_s`` seconds, and one
    when the server answered."""

    def __init__(self, command: str, target: str, budget_s: float, every_s: float = 5.0):
        self.prefix = f"megascore {command}:"
        self.target, self.budget_s, self.every_s = target, budget_s, every_s
        self._said = -math.inf
        self._lock = threading.Lock()

    def __call__(self, waited_s: float, error: ScoringError | None) -> None:
        with self._lock:
            if error is None:
                text = f"the server at {self.target} answered after {waited_s:.1f} s"
            elif self._said == -math.inf:
                self._said = waited_s
                text = f"waiting up to {self.budget_s:g} s for the server at {self.target}: {error}"
            elif waited_s - self._said >= self.every_s:
                self._said = waited_s
                text = f"still waiting for the server at {self.target}: {waited_s:.1f} s"
            else:
                return
            print(f"{self.prefix} {text}", file=sys.stderr, flush=True)


def make_client(args: argparse.Namespace) -> ScoringClient:
    """Builds a :class:`ScoringClient` from the connection flags (and ``score``'s
    ``--wait-for-server``)."""
    tls_files = (args.root_ca, args.client_cert, args.client_key, args.server_name)
    tls = None
    if args.tls or any(tls_files):
        tls = TlsConfig(
            root_ca=args.root_ca,
            client_cert=args.client_cert,
            client_key=args.client_key,
            server_name=args.server_name,
        )
    token = args.token
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    return ScoringClient(
        args.target,
        tls=tls,
        token=token,
        timeout=_timeout(args),
        load_balancing=args.load_balancing,
        wait_for_server_s=_wait_for_server(args),
        on_wait=WaitNotice(args.command, args.target, _wait_for_server(args)),
    )


def _cmd_score(args, client: ScoringClient) -> int:
    return score_jsonl.run(args, client)


def _cmd_info(args, client: ScoringClient) -> int:
    print(json.dumps(client.model_info().to_dict(), indent=2))
    return 0


def _cmd_health(args, client: ScoringClient) -> int:
    if args.wait:
        start = time.monotonic()
        try:
            status = client.wait_until_serving(timeout=args.wait)
        except ScoringError as exc:
            print(exc.details)
            return 1
        waited = time.monotonic() - start
        if waited >= 1.0:  # said on stderr: stdout stays the status alone
            print(f"megascore health: SERVING after {waited:.1f} s", file=sys.stderr)
    else:
        try:
            status = client.health(args.service)
        except ScoringError as exc:
            print(f"{exc.code.name}: {exc.details}")
            return 1
    print(status.status)
    return 0 if status.serving else 1


def _cmd_load_weights(args, client: ScoringClient) -> int:
    line = None if args.no_progress else ElapsedLine(f"loading {args.model}", sys.stderr)
    try:
        result = client.load_weights(
            args.model, args.weights_version, timeout=args.timeout, progress=line
        )
    finally:
        if line is not None:
            line.close()
    print(
        json.dumps(
            {
                "weights_version": result.weights_version,
                "previous_weights_version": result.previous_weights_version,
                "load_ms": result.load_ms,
            }
        )
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand except ``serve``."""
    parser = argparse.ArgumentParser(
        prog="megascore", description="Score token sequences with a megascore server."
    )
    parser.add_argument("--version", action="version", version=f"megascore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("serve", help="run a server (arguments go to the server; needs the extra)")

    score = sub.add_parser("score", help="score a JSONL file of token ids or texts")
    score_jsonl.add_arguments(score)
    score.set_defaults(func=_cmd_score)

    info = sub.add_parser("info", help="print model info as JSON")
    info.set_defaults(func=_cmd_info)

    health = sub.add_parser("health", help="gRPC health check: exit 0 when SERVING")
    health.add_argument("--service", default="", help="service name ('' = whole server)")
    health.add_argument(
        "--wait", type=float, default=0.0, metavar="SECONDS", help="poll until SERVING"
    )
    health.set_defaults(func=_cmd_health)

    load = sub.add_parser("load-weights", help="load new weights into the running server")
    load.add_argument("model", help="checkpoint on the server: hf:DIR or megatron:DIR")
    load.add_argument(
        "--weights-version", default="", help="version label (default: derived by the server)"
    )
    load.add_argument(
        "--no-progress", action="store_true", help="no elapsed-time line on stderr while loading"
    )
    load.set_defaults(func=_cmd_load_weights)

    push_cmd = sub.add_parser("push-weights", help="stream weights from files here into the server")
    push.add_cli_arguments(push_cmd)
    push_cmd.set_defaults(func=push.run_cli)

    for name in ("score", "info", "health", "load-weights", "push-weights"):
        _add_connection_args(sub.choices[name], name)
        sub.choices[name].set_defaults(subparser=sub.choices[name])
        _show_defaults(sub.choices[name])
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Appends ``(default: X)`` to the help of every option with a value default that
    its help does not already state."""
    for action in parser._actions:
        default = action.default
        if action.nargs == 0 or default in (None, "", argparse.SUPPRESS) or not action.help:
            continue
        if "default" not in action.help:
            action.help += f" (default: {default})"


def serve(argv: list[str]) -> int:
    """``megascore serve``: runs the ``serve`` entry point of :data:`COMMAND_GROUP`
    (``megascore_server.main:main``) with ``argv``; exit 2 with a message saying what
    to install when there is none or its modules are missing."""
    found = entry_points(group=COMMAND_GROUP, name="serve")
    if not found:
        print(
            "megascore serve needs the server, which is not installed (no 'serve' entry "
            f"point in group {COMMAND_GROUP!r}). {_INSTALL_SERVER}",
            file=sys.stderr,
        )
        return 2
    command = next(iter(found))
    try:
        server_main = command.load()
    except ModuleNotFoundError as exc:
        print(
            f"megascore serve needs the server extra, which is not installed (missing "
            f"module {exc.name!r} for {command.value}). {_INSTALL_SERVER}",
            file=sys.stderr,
        )
        return 2
    return int(server_main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``megascore`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "serve":
        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    _check_args(args.subparser, args)
    missing = _missing_input(args)
    if missing:  # reported before any connection, whatever the server's state
        print(f"megascore {args.command}: error: {missing}", file=sys.stderr)
        return 2
    try:
        with make_client(args) as client:
            return args.func(args, client)
    except ScoringError as exc:
        print(f"megascore {args.command}: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"megascore {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"megascore {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
