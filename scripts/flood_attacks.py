"""The bad clients of ``scripts/flood.py``, one attack per process, until SIGTERM.

``python scripts/flood_attacks.py ATTACK --http HOST:PORT --grpc HOST:PORT [sizes]``
prints ``ready`` once the attack is established, keeps it up until SIGTERM, closes
everything and prints its counts as one JSON line (``counts``: events by kind,
``problems``: answers a server must never give, a 5xx but 503 or INTERNAL / UNKNOWN).

* ``idle``: ``--idle-http`` TCP connections to the HTTP port that send nothing and
  ``--idle-grpc`` to the gRPC port that send the HTTP/2 preface and SETTINGS, then
  nothing; one the server closes is reopened;
* ``slowloris``: ``--slowloris`` HTTP connections trickling a request head, and
  ``--slowloris-grpc`` gRPC ones trickling the HTTP/2 preface, a byte every
  ``--trickle-s``; reopened when closed;
* ``unread``: ``--unread`` ScoreStreams (a connection each) that send requests with
  ~50 KB answers as fast as flow control lets them and never read an answer; ``ready``
  once every stream's writes stalled;
* ``churn``: ``--churn-rate`` connections a second, alternately to either port, each
  opened and dropped at once (a reset: no TIME_WAIT left on this side);
* ``bodies``: ``--body-clients`` clients sending, in turn, an HTTP body of exactly
  ``--max-body-bytes`` (a prompt longer than any model takes), one byte over with a
  Content-Length and chunked (413), and gRPC ScoreRequests of the limit and over it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import signal
import socket
import struct
import sys
import time
from collections import Counter

import grpc
import numpy as np

from megascore.api.wire import encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore.v1 import scoring_pb2_grpc as pb_grpc

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_SETTINGS = struct.pack(">I", 0)[1:] + b"\x04\x00" + struct.pack(">I", 0)  # empty SETTINGS
SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: flood\r\nX-Slow: "
SERVER_FAULTS = ("INTERNAL", "UNKNOWN")


class Attack:
    """Counts, problems and the stop signal shared by one attack's tasks."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.http = _address(args.http)
        self.grpc = args.grpc
        self.counts: Counter = Counter()
        self.problems: list[str] = []
        self.stop = asyncio.Event()

    def answer(self, kind: str, status: int | str) -> None:
        """Counts an answer; a 5xx but 503, INTERNAL or UNKNOWN is a problem."""
        self.counts[f"{kind} {status}"] += 1
        bad = status in SERVER_FAULTS or (
            isinstance(status, int) and status >= 500 and status != 503
        )
        if bad and len(self.problems) < 20:
            self.problems.append(f"{kind}: {status}")

    async def sleep(self, seconds: float) -> bool:
        """Waits ``seconds`` or until the stop; True when stopped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)
        return self.stop.is_set()


def _address(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host, int(port)


def _drop(writer: asyncio.StreamWriter) -> None:
    """Closes with a reset (SO_LINGER 0): the client side keeps no TIME_WAIT."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


async def hold(attack: Attack, name: str, address, opening: bytes, trickle, opened) -> None:
    """Keeps one connection to ``address`` open until the stop: sends ``opening``, then a
    byte of ``trickle`` (an iterable of bytes, may be endless) every ``--trickle-s``;
    reopens it when the server closes it (counted ``closed by server``)."""
    first = True
    while not attack.stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(*address)
        except OSError as exc:
            attack.counts[f"{name} connect failed {type(exc).__name__}"] += 1
            await attack.sleep(0.5)
            continue
        attack.counts[f"{name} opened"] += 1
        if first:
            first = False
            opened.release()
        writer.write(opening)
        until_closed = asyncio.ensure_future(reader.read())
        for byte in itertools.chain(trickle(), [None]):
            await asyncio.wait({until_closed}, timeout=attack.args.trickle_s)
            if until_closed.done() or attack.stop.is_set():
                break
            if byte is not None:
                writer.write(bytes([byte]))
        if not until_closed.done():
            stop = asyncio.ensure_future(attack.stop.wait())
            await asyncio.wait({until_closed, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
        if until_closed.done() and not attack.stop.is_set():
            attack.counts[f"{name} closed by server"] += 1
        until_closed.cancel()
        _drop(writer)


async def _holding(attack: Attack, plan: list[tuple]) -> None:
    """Runs :func:`hold` for each ``(name, count, address, opening, trickle)`` of ``plan``;
    ``ready`` once each connection opened."""
    opened = asyncio.Semaphore(0)
    tasks = []
    for name, count, address, opening, trickle in plan:
        for _ in range(count):
            tasks.append(
                asyncio.ensure_future(hold(attack, name, address, opening, trickle, opened))
            )
    for _ in tasks:
        await opened.acquire()
    print("ready", flush=True)
    await asyncio.gather(*tasks)


async def idle(attack: Attack) -> None:
    args, grpc_address = attack.args, _address(attack.grpc)
    await _holding(
        attack,
        [
            ("http idle", args.idle_http, attack.http, b"", tuple),
            ("grpc idle", args.idle_grpc, grpc_address, H2_PREFACE + H2_SETTINGS, tuple),
        ],
    )


async def slowloris(attack: Attack) -> None:
    args, grpc_address = attack.args, _address(attack.grpc)
    await _holding(
        attack,
        [
            (
                "http slowloris",
                args.slowloris,
                attack.http,
                SLOW_HEAD,
                lambda: itertools.repeat(97),
            ),
            ("grpc slowloris", args.slowloris_grpc, grpc_address, b"", lambda: H2_PREFACE),
        ],
    )


def _score_request(tokens: int, top_k: int = 0) -> pb.ScoreRequest:
    """One sequence of ``tokens`` token ids."""
    ids = np.arange(tokens, dtype=np.int64) % 97
    lengths = encode_array(np.array([tokens], dtype=np.int64))
    options = pb.ScoreOptions(return_logprobs=True, top_k=top_k)
    return pb.ScoreRequest(token_ids=encode_array(ids), lengths=lengths, options=options)


def _channel(target: str, max_bytes: int = 4 << 20) -> grpc.aio.Channel:
    """A channel with a connection of its own."""
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", max_bytes)]
    return grpc.aio.insecure_channel(target, options=options)


async def unread(attack: Attack) -> None:
    # ~50 KB answers (top 16 of 256 positions): a few fill the stream's flow-control window
    request, last_write = _score_request(256, top_k=16), {}

    async def stream(index: int) -> None:
        async with _channel(attack.grpc) as channel:
            call = pb_grpc.ScorerStub(channel).ScoreStream()
            with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
                while not attack.stop.is_set():
                    await call.write(request)
                    attack.counts["unread stream writes"] += 1
                    last_write[index] = time.monotonic()
            call.cancel()

    tasks = [asyncio.ensure_future(stream(i)) for i in range(attack.args.unread)]
    end = time.monotonic() + attack.args.ready_timeout_s
    while time.monotonic() < end:  # ready: every stream has written and stalled
        await asyncio.sleep(0.2)
        now = time.monotonic()
        if len(last_write) == len(tasks) and all(now - t > 1.0 for t in last_write.values()):
            break
    print("ready", flush=True)
    await attack.stop.wait()
    for task in tasks:  # a stalled write waits for the server: no stop without a cancel
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def churn(attack: Attack) -> None:
    addresses = itertools.cycle([attack.http, _address(attack.grpc)])
    tick_s, in_flight, tasks = 0.01, asyncio.Semaphore(512), set()

    async def one(address) -> None:
        try:
            _, writer = await asyncio.open_connection(*address)
        except OSError as exc:
            attack.counts[f"churn connect failed {type(exc).__name__}"] += 1
        else:
            attack.counts["churn opened and dropped"] += 1
            _drop(writer)
        finally:
            in_flight.release()

    print("ready", flush=True)
    start, sent = time.monotonic(), 0
    while not attack.stop.is_set():
        due = int((time.monotonic() - start) * attack.args.churn_rate)
        for _ in range(due - sent):
            await in_flight.acquire()
            task = asyncio.ensure_future(one(next(addresses)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        sent = due
        await asyncio.sleep(tick_s)
    attack.counts["churn seconds"] = round(time.monotonic() - start)


async def _http_exchange(attack: Attack, kind: str, head: bytes, body_parts) -> None:
    """Sends one request (``body_parts``: bytes written after the head) and counts the
    status of its answer (``reset`` when the server closed first)."""
    try:
        reader, writer = await asyncio.open_connection(*attack.http)
    except OSError as exc:
        attack.counts[f"{kind} connect failed {type(exc).__name__}"] += 1
        return
    try:
        writer.write(head)
        for part in body_parts:
            writer.write(part)
            await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 60)
        attack.answer(kind, int(status_line.split()[1]) if status_line else "reset")
    except (OSError, IndexError, ValueError):
        attack.answer(kind, "reset")
    finally:
        _drop(writer)


def _at_limit_body(limit: int) -> bytes:
    """A completion body of exactly ``limit`` bytes: a prompt longer than any model takes."""
    tokens = (limit - 64) // 2
    body = b'{"prompt":[' + b"1," * (tokens - 1) + b'1],"max_tokens":0,"echo":true}'
    return body + b" " * (limit - len(body))


async def bodies(attack: Attack) -> None:
    limit = attack.args.max_body_bytes
    at_limit, over = _at_limit_body(limit), b" " * (limit + 1)
    head = "POST /v1/completions HTTP/1.1\r\nHost: flood\r\nContent-Type: application/json\r\n"
    grpc_at_limit = _score_request((limit - 64) // 8)
    grpc_over = _score_request(limit // 8 + 8)
    chunks = [b"%x\r\n" % len(c) + c + b"\r\n" for c in (over[: limit // 2], over[limit // 2 :])]

    async def grpc_score(stub, kind: str, request) -> None:
        try:
            await stub.Score(request, timeout=60)
            attack.answer(kind, "OK")
        except grpc.RpcError as exc:
            attack.answer(kind, exc.code().name)

    async def client() -> None:
        async with _channel(attack.grpc, 2 * limit) as channel:
            stub = pb_grpc.ScorerStub(channel)
            while not attack.stop.is_set():
                length = f"{head}Content-Length: %d\r\n\r\n"
                await _http_exchange(attack, "http at limit", (length % limit).encode(), [at_limit])
                await _http_exchange(attack, "http over", (length % (limit + 1)).encode(), [over])
                chunked = f"{head}Transfer-Encoding: chunked\r\n\r\n".encode()
                await _http_exchange(attack, "http over chunked", chunked, [*chunks, b"0\r\n\r\n"])
                await grpc_score(stub, "grpc at limit", grpc_at_limit)
                await grpc_score(stub, "grpc over", grpc_over)

    tasks = [asyncio.ensure_future(client()) for _ in range(attack.args.body_clients)]
    print("ready", flush=True)
    await asyncio.gather(*tasks)


ATTACKS = {f.__name__: f for f in (idle, slowloris, unread, churn, bodies)}


SIZES = {
    "idle_http": (3000, "idle HTTP connections"),
    "idle_grpc": (300, "idle gRPC connections (HTTP/2 preface and SETTINGS sent)"),
    "slowloris": (100, "HTTP connections trickling a request head"),
    "slowloris_grpc": (20, "gRPC connections trickling the HTTP/2 preface"),
    "trickle_s": (1.0, "seconds between two trickled bytes"),
    "unread": (20, "ScoreStreams that never read"),
    "churn_rate": (1000, "connections opened and dropped a second"),
    "body_clients": (20, "clients sending bodies at the size limits"),
    "max_body_bytes": (4 << 20, "the server's --max-message-bytes"),
    "ready_timeout_s": (20.0, "longest wait for the unread streams to stall"),
}
"""The sizes of the attacks: flags of this script and of ``scripts/flood.py``."""


def add_size_flags(parser: argparse.ArgumentParser) -> None:
    for dest, (default, text) in SIZES.items():
        flag = "--" + dest.replace("_", "-")
        parser.add_argument(flag, type=type(default), default=default, help=text)


def size_argv(args: argparse.Namespace) -> list[str]:
    """``args``' sizes as flags of this script."""
    return [f"--{dest.replace('_', '-')}={getattr(args, dest)}" for dest in SIZES]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("attack", choices=sorted(ATTACKS))
    parser.add_argument("--http", required=True, help="HOST:PORT of the HTTP front")
    parser.add_argument("--grpc", required=True, help="HOST:PORT of the gRPC server")
    add_size_flags(parser)
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> dict:
    attack = Attack(args)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, attack.stop.set)
    await ATTACKS[args.attack](attack)
    return {"attack": args.attack, "counts": dict(attack.counts), "problems": attack.problems}


def main(argv=None) -> int:
    summary = asyncio.run(run(parse_args(argv)))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
