"""Long hostile-input run against megascore's HTTP front (the sibling of ``fuzz.py``).

Starts ``megascore serve --model tiny --device cpu --http-port P`` with a small
``--max-message-bytes`` (or uses ``--url``, a server of the built-in ``tiny`` model, and
``--target``, its gRPC address), answers a probe on both dialects, then sends
``--cases`` requests, one at a time on a new connection each, of these kinds:

* ``valid``: well-formed ``/v1/completions`` and ``/generate`` bodies (echo, logprobs,
  prompt_logprobs, max_tokens 0 / 1, top_logprobs_num, token_ids_logprob, batches, the
  ``megascore`` key), some sent chunked, and ``GET /v1/models``, ``/health``: 200;
* ``mutated``: those bodies (and ``/tokenize``, ``/detokenize`` ones) with 1-3 fields set
  to hostile values (every JSON type, ints beyond int64, NaN / Infinity literals, ids out
  of range, empty and long prompts, text, lone surrogates, deep nesting, ``stream``,
  ``n: 2``, ``max_tokens`` > 1, huge ``logprobs``), deleted, or unknown keys added,
  sometimes sent to another route;
* ``extras``: every key of the ``megascore`` object (read from ``megascore.api.schema``)
  with values of its own type and of every other, of wrong lengths and ranges;
* ``json``: random JSON values, truncated, corrupted and otherwise malformed JSON, other
  encodings, to every route;
* ``bytes``: raw random bytes;
* ``path``: unknown paths and methods, known paths with the wrong method;
* ``oversize``: bodies over the server's limit, with a ``Content-Length`` or chunked: 413;
* ``timeout``: an ``X-Request-Timeout`` of junk (400) or below a second (504 allowed).

Each case is drawn from its own ``random.Random`` seeded by ``--seed`` and its index, so
``--only I`` sends case I alone (the index is in every problem reported).

Every answer must come within ``--timeout`` s (else a hang) with a status below 500 (504
only for a tiny ``X-Request-Timeout``; never 503: the server is not draining), every
error in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with a
message, every 200 from a scoring route shaped as its body asked. Afterwards the probes
must be answered as before, ``/health`` 200, a gRPC Score through the SDK must agree with
the probe, and a started server's log must hold no traceback and the server must exit 0
on SIGTERM. Counts by status and kind are printed (and written with ``--json``); the last
line is ``fuzz_http: PASS`` or ``fuzz_http: FAIL ...``, exit 1 on failure.

    .venv/bin/python scripts/fuzz_http.py --cases 5000
    .venv/bin/python scripts/fuzz_http.py --url http://127.0.0.1:8000 --target 127.0.0.1:50051 \
        --max-body-bytes 268435456
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import http.client
import json
import math
import random
import sys
import tempfile
import time
import urllib.parse
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from megascore.api import schema
from megascore.model.config import builtin_model
from megascore_client import ScoringClient
from megascore_server.ports import pick_port
from megascore_server.serve_process import CPU_ONE_THREAD, ServeProcess

VOCAB = builtin_model("tiny").vocab_size  # the fuzzed server's model
ATOL = 1e-5  # gRPC vs HTTP logprobs of the same probe (each scored in a step of its own)

KINDS = {
    "valid": 12,
    "mutated": 36,
    "extras": 14,
    "json": 14,
    "bytes": 6,
    "path": 6,
    "oversize": 4,
    "timeout": 8,
}
"""Kind -> percent of the cases."""
SCORING = ("/v1/completions", "/generate")
ROUTES = (*SCORING, "/tokenize", "/detokenize")
GET_ROUTES = ("/v1/models", "/health", "/health_generate", "/ping", "/tokenizer_info")
TINY_TIMEOUT_S = 1.0
"""An ``X-Request-Timeout`` below it may be answered 504."""
FLOOR = -9999.0
"""The lowest logprob an answer carries (JSON has no -inf)."""
PROBE_IDS = [7, 14, 21, 28, 35, 42, 49, 56, 63, 70, 77, 84]
PROBES = {
    "/v1/completions": {
        "prompt": PROBE_IDS,
        "echo": True,
        "logprobs": 2,
        "prompt_logprobs": 2,
        "max_tokens": 1,
    },
    "/generate": {
        "input_ids": [PROBE_IDS, PROBE_IDS[:5]],
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "token_ids_logprob": [1, 2],
        "sampling_params": {"max_new_tokens": 1},
    },
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=5000, help="requests to send")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, help="send only case ONLY (an index of a run)")
    parser.add_argument("--url", help="HTTP front of a running tiny server instead of one started")
    parser.add_argument("--target", help="gRPC address of the --url server (its gRPC check)")
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="the server's --max-message-bytes (passed to the started server)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument("--json", help="write the summary as JSON to this file")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------ values


@dataclasses.dataclass(frozen=True)
class Raw:
    """JSON text put into a body as it is (nesting too deep to build as objects)."""

    text: str


def encode(value, ensure_ascii: bool = True) -> bytes:
    """``value`` as JSON (NaN / Infinity literals, :class:`Raw` text verbatim, lone
    surrogates as escapes or, with ``ensure_ascii=False``, as invalid UTF-8)."""
    fragments: list[str] = []

    def default(obj):
        if isinstance(obj, Raw):
            fragments.append(obj.text)
            return f"\x00raw{len(fragments) - 1}\x00"
        raise TypeError(type(obj).__name__)

    text = json.dumps(value, ensure_ascii=ensure_ascii, default=default)
    for i, fragment in enumerate(fragments):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), fragment, 1)
    return text.encode("utf-8", "surrogatepass")


EDGE_INTS = [
    *[-1, 0, 1, 2, 255, 256, 257, VOCAB - 1, VOCAB, 2**31 - 1, 2**31, 2**63 - 1, 2**63],
    *[-(2**63) - 1, 2**64, 10**6, 10**30, -(10**30), 10**400],
]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.5, 1.0, 1e-300, 1e308, -1.5]
ODD_CHARS = ["\x00", "\n", "\u202e", "\ufeff", "\uffff", "\U0001f600", '"', "\\", "\x7f"]
WORDS = ["", "hello world", "1", "NaN", "token_id:3", "tiny", "null"]
ODD_VALUES = [[], [[]], [[], [1]], {}, [None], "", [""], ["a", "b"], [[1, 2], "x"]]
RAW_NUMBERS = ["1e999", "-1e999", "1E400", "-0", "0.0e0", "9" * 5000, "1" + "0" * 400]
LOSSES = ["nll", "mean_nll", "perplexity"]


class Gen:
    """Seeded draws for one case (``random.Random``: every choice uniform; the case can
    be drawn again alone from the run's seed and its index)."""

    def __init__(self, seed_value: int, index: int):
        self.rng = random.Random(f"{seed_value}:{index}")

    def pick(self, options):
        return self.rng.choice(options)

    def chance(self, p: float = 0.5) -> bool:
        return self.rng.random() < p

    def integer(self) -> int:
        r = self.rng.random()
        if r < 0.4:
            return self.pick(EDGE_INTS)
        if r < 0.7:
            return self.rng.randint(-3, 600)
        bits = self.pick([8, 31, 32, 63, 64, 65, 100, 1400])
        return self.rng.getrandbits(bits) * self.pick([1, -1])

    def number(self) -> float:
        if self.chance():
            return self.pick(EDGE_FLOATS)
        return self.rng.uniform(-1, 1) * 10.0 ** self.rng.randint(-320, 308)

    def char(self) -> str:
        r = self.rng.random()
        if r < 0.4:
            return chr(self.rng.randint(0x20, 0x7E))
        if r < 0.6:
            return chr(self.rng.randint(0x80, 0xFFFF))
        if r < 0.75:
            return chr(self.rng.randint(0xD800, 0xDFFF))  # a lone surrogate
        if r < 0.85:
            return chr(self.rng.randint(0x10000, 0x10FFFF))
        return self.pick(ODD_CHARS)

    def text(self, longest: int = 24) -> str:
        if self.chance(0.2):
            return self.pick(WORDS)
        return "".join(self.char() for _ in range(self.rng.randint(0, longest)))

    def ids(self, longest: int = 16) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, longest))]

    def prompts(self) -> list[list[int]]:
        return [self.ids() for _ in range(self.rng.randint(1, 3))]

    def scalar(self):
        make = self.pick([lambda: None, self.chance, self.integer, self.number, self.text])
        return make()

    def hostile(self, depth: int = 2):
        """A value of any JSON type for any field."""
        r = self.rng.random()
        if depth and r < 0.12:
            return [self.hostile(depth - 1) for _ in range(self.rng.randint(0, 4))]
        if depth and r < 0.2:
            return {self.text(8): self.hostile(depth - 1) for _ in range(self.rng.randint(0, 3))}
        if r < 0.28:
            return copy.deepcopy(self.pick(ODD_VALUES))
        if r < 0.36:
            return [self.integer() for _ in range(self.rng.randint(0, 6))]
        if r < 0.4:
            return [[self.integer() for _ in range(self.rng.randint(0, 4))] for _ in range(2)]
        if r < 0.43:
            return [7] * self.rng.randint(100, 20_000)  # a long prompt
        if r < 0.46:
            n = self.rng.randint(2, 100_000)
            return Raw(self.pick(["[" * n + "]" * n, '{"a":' * n + "1" + "}" * n]))
        if r < 0.48:
            return Raw(self.pick(RAW_NUMBERS))
        return self.scalar()


# ------------------------------------------------------------------------------ bodies


def valid_extras(g: Gen, prompts: list[list[int]]) -> dict:
    """A valid ``megascore`` object for ``prompts``."""
    extras = {}
    if g.chance():
        extras["losses"] = g.rng.sample(LOSSES, g.rng.randint(0, len(LOSSES)))
    for name in ("return_entropy", "return_token_ranks"):
        if g.chance(0.3):
            extras[name] = g.chance()
    if g.chance(0.3):
        extras["top_k"] = g.rng.randint(0, 5)
    if g.chance(0.3):
        extras["temperature"] = g.rng.uniform(0.5, 2.0)
    if g.chance(0.3):
        extras["loss_mask"] = [[g.rng.randint(0, 1) for _ in p] for p in prompts]
        if g.chance():
            extras["logprob_positions"] = g.pick(["all", "masked"])
    return extras


def _optional(g: Gen, body: dict, fields: dict) -> dict:
    """``body`` with each of ``fields`` (name -> maker) set or left out, at random."""
    for name, make in fields.items():
        if g.chance():
            body[name] = make()
    return body


def valid_completion(g: Gen) -> dict:
    prompts = g.prompts()
    k = lambda: g.rng.randint(0, 5)  # noqa: E731
    return _optional(
        g,
        {"prompt": prompts if len(prompts) > 1 or g.chance() else prompts[0]},
        {
            "echo": g.chance,
            "logprobs": k,
            "max_tokens": lambda: g.rng.randint(0, 1),
            "prompt_logprobs": k,
            "temperature": lambda: g.pick([0, 0.5, 1.0, 1.7]),
            "return_token_ids": g.chance,
            "return_tokens_as_token_ids": g.chance,
            "model": lambda: "tiny",
            "seed": lambda: g.rng.randint(0, 2**31),
            "top_p": lambda: 1.0,
            "stop": lambda: ["\n"],
            "megascore": lambda: valid_extras(g, prompts),
        },
    )


def valid_generate(g: Gen) -> dict:
    prompts = g.prompts()
    shortest = min(map(len, prompts))
    rid = lambda: "".join(g.pick("abcxyz0123") for _ in range(8))  # noqa: E731
    params = _optional(
        g,
        {},
        {
            "max_new_tokens": lambda: g.rng.randint(0, 1),
            "temperature": lambda: g.pick([0, 0.7, 1.0]),
        },
    )
    return _optional(
        g,
        {"input_ids": prompts if len(prompts) > 1 or g.chance() else prompts[0]},
        {
            "return_logprob": g.chance,
            "logprob_start_len": lambda: g.rng.randint(-1, shortest - 1),
            "top_logprobs_num": lambda: g.rng.randint(0, 5),
            "token_ids_logprob": lambda: g.ids(3),
            "return_text_in_logprobs": g.chance,
            "sampling_params": lambda: params,
            "rid": lambda: rid() if len(prompts) == 1 else [rid() for _ in prompts],
            "megascore": lambda: valid_extras(g, prompts),
        },
    )


VALID = {"/v1/completions": valid_completion, "/generate": valid_generate}
OTHER_BODIES = {
    "/tokenize": lambda g: _optional(
        g, {"prompt": g.pick(WORDS[1:])}, {"add_special_tokens": g.chance}
    ),
    "/detokenize": lambda g: {"tokens": g.ids()},
}
FIELDS = {
    "/v1/completions": [
        *["model", "prompt", "echo", "logprobs", "max_tokens", "prompt_logprobs"],
        *["temperature", "seed", "n", "stream", "add_special_tokens", "return_token_ids"],
        *["return_tokens_as_token_ids", "megascore"],
    ],
    "/generate": [
        *["text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len"],
        *["top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "rid"],
        *["stream", "megascore"],
    ],
    "/tokenize": ["prompt", "add_special_tokens"],
    "/detokenize": ["tokens"],
}
"""Every field a route reads, set to hostile values whether the body has it or not."""
TARGETED = {
    "stream": lambda g: True,
    "n": lambda g: g.pick([0, 2, -1, 2**63]),
    "max_tokens": lambda g: g.pick([2, 16, -1, 2**40]),
    "logprobs": lambda g: g.pick([256, 257, 10**9, -1]),
    "prompt_logprobs": lambda g: g.pick([256, 257, 10**9, -1]),
    "top_logprobs_num": lambda g: g.pick([256, 257, 10**9, -1, -(2**63) - 1]),
    "logprob_start_len": lambda g: g.pick([-5, 16, 10**9, 2**64]),
    "sampling_params": lambda g: {"max_new_tokens": g.hostile()},
    "max_new_tokens": lambda g: g.pick([2, -1, 1.0, 0.0, True, "1", 2**64]),
    "prompt": lambda g: g.text() if g.chance() else [g.text() for _ in range(3)],
    "text": lambda g: g.text() if g.chance() else [g.text() for _ in range(3)],
    "model": lambda g: g.text(),
    "rid": lambda g: g.text() if g.chance() else [g.text() for _ in range(2)],
    "token_ids_logprob": lambda g: list(range(g.rng.randint(200, 600))),
    "megascore": lambda g: {g.text(8): g.hostile() for _ in range(2)},
    "tokens": lambda g: [g.integer() for _ in range(4)],
}
"""Values aimed at a field's own checks: half of the values a field is set to."""


def hostile_value(g: Gen, name) -> object:
    """A value for the field ``name``: one of :data:`TARGETED`'s or any."""
    if name in TARGETED and g.chance():
        return TARGETED[name](g)
    return g.hostile()


def paths_of(value, prefix=(), depth: int = 3) -> list[tuple]:
    """Every path (keys and indexes) into ``value``'s dicts and lists, ``depth`` deep."""
    if depth == 0:
        return []
    items = value.items() if isinstance(value, dict) else enumerate(value)
    out = []
    for key, child in items:
        out.append((*prefix, key))
        if isinstance(child, (dict, list)):
            out += paths_of(child, (*prefix, key), depth - 1)
    return out


def _parent(body, path: tuple):
    for key in path[:-1]:
        body = body[key]
    return body


def mutate(g: Gen, body: dict, route: str):
    """``body`` with 1-3 fields set to hostile values, deleted, or unknown ones added."""
    for _ in range(g.rng.randint(1, 3)):
        if not isinstance(body, dict):
            break
        paths = paths_of(body)
        op = g.rng.choices(["set", "field", "delete", "add", "wrap"], [3, 3, 1, 1, 0.3])[0]
        if op == "set" and paths:
            path = g.pick(paths)
            _parent(body, path)[path[-1]] = hostile_value(g, path[-1])
        elif op == "field":
            name = g.pick(FIELDS[route])
            body[name] = hostile_value(g, name)
        elif op == "delete" and paths:
            path = g.pick(paths)
            del _parent(body, path)[path[-1]]
        elif op == "add":
            where = body.get("megascore") if isinstance(body.get("megascore"), dict) else body
            where[g.text(12)] = g.hostile()
        elif op == "wrap":
            body = g.pick([[body], {"body": body}, [body, body]])
    return body


def wrong_rows(g: Gen, prompts: list[list[int]]) -> list:
    """A per-token input of the wrong shape or with wrong values (or right ones)."""
    element = g.pick(
        [lambda: g.rng.randint(0, 1), g.integer, g.number, lambda: [g.integer()], g.text]
    )
    rows = [[element() for _ in range(max(0, len(p) + g.pick([0, 0, -1, 1])))] for p in prompts]
    if g.chance(0.2):
        rows = rows[:-1] if g.chance() else [*rows, rows[0]]
    return rows


def right_type(g: Gen, name: str, prompts: list[list[int]]):
    """A value of the type the ``megascore`` key ``name`` takes (its checks still apply)."""
    option = {opt.name: opt for opt in schema.OPTIONS}.get(name)
    if option is None:  # an input
        spec = {spec.name: spec for spec in schema.INPUTS}[name]
        if spec.per == schema.TOKEN:
            return wrong_rows(g, prompts)
        return g.number() if g.chance() else [g.number() for _ in prompts]
    if option.names is not None:
        return g.pick(sorted(option.names))
    kind = type(option.default)
    if kind is tuple:
        return [g.pick([*LOSSES, "x"]) for _ in range(g.rng.randint(0, 3))]
    return {bool: g.chance, int: g.integer, str: g.text}[kind]()


def extras_body(g: Gen) -> tuple[str, dict]:
    """A valid body whose ``megascore`` object has 1-3 keys of the table set to values of
    their own type or any other, maybe an unknown key, or is not an object."""
    route = g.pick(SCORING)
    body = VALID[route](g)
    prompts = _prompts(body.get("prompt", body.get("input_ids")))
    extras = valid_extras(g, prompts) if g.chance() else {}
    names = [spec.name for spec in (*schema.OPTIONS, *schema.INPUTS)]
    for name in g.rng.sample(names, g.rng.randint(1, 3)):
        extras[name] = right_type(g, name, prompts) if g.chance() else g.hostile()
    if g.chance(0.2):
        extras[g.text(12)] = g.hostile()  # an unknown key
    body["megascore"] = extras if g.chance(0.9) else g.hostile()
    return route, body


def malformed_json(g: Gen) -> bytes:
    data = encode(VALID[g.pick(SCORING)](g))
    form = g.pick(["truncate", "flip", "insert", "trailing", "bom", "utf16", "fixed"])
    if form == "truncate":
        return data[: g.rng.randrange(len(data))]
    if form in ("flip", "insert"):
        out = bytearray(data)
        for _ in range(g.rng.randint(1, 4)):
            at = g.rng.randrange(len(out))
            out[at : at + (form == "flip")] = bytes([g.rng.randrange(256)])
        return bytes(out)
    if form == "trailing":
        return data + g.pick([b",", b"}", b"{}", b"\x00", b" garbage", b"\n\n[1]"])
    if form == "bom":
        return b"\xef\xbb\xbf" + data
    if form == "utf16":
        return data.decode().encode(g.pick(["utf-16", "utf-16-le", "utf-32"]))
    return g.pick(
        [b"", b"null", b"[]", b"{", b"{'prompt': [1]}", b"NaN", b'{"prompt": [1, 2,]}']
        + [b'{"prompt": [1] "echo": true}', b'{"prompt": [01, 2]}', b'{"prompt": [1, 2]}' * 2]
    )


# ------------------------------------------------------------------------------ cases


@dataclasses.dataclass
class Case:
    """One HTTP request and what its answer may be."""

    kind: str
    path: str
    body: bytes | None = None
    method: str = "POST"
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    chunk: int = 0
    """> 0: the body goes chunked (no Content-Length), in chunks of this many bytes."""
    expect: frozenset[int] | None = None
    """The only statuses accepted; None: any below 500."""
    tiny_timeout: bool = False

    def describe(self) -> str:
        """The request in a line (a long body as its first 400 and last 200 bytes)."""
        body, size = self.body, 0 if self.body is None else len(self.body)
        if size > 600:
            body = self.body[:400] + b" ... " + self.body[-200:]
        extra = f" chunked({self.chunk})" if self.chunk else ""
        return f"{self.method} {self.path[:200]} {self.headers}{extra} [{size} B] {body!r}"


def _valid(g: Gen, limit: int) -> Case:
    if g.chance(0.1):
        path = g.pick(["/v1/models", "/health"])
        return Case("valid", path, method="GET", expect=frozenset({200}))
    route = g.pick(SCORING)
    chunk = g.pick([0] * 6 + [1, 7, 4096])
    return Case("valid", route, encode(VALID[route](g)), chunk=chunk, expect=frozenset({200}))


def _mutated(g: Gen, limit: int) -> Case:
    route = g.pick([*SCORING, *SCORING, *SCORING, "/tokenize", "/detokenize"])
    body = mutate(g, VALID[route](g) if route in VALID else OTHER_BODIES[route](g), route)
    if g.chance(0.1):
        route = g.pick(ROUTES)
    chunk = 64 if g.chance(0.1) else 0
    return Case("mutated", route, encode(body, ensure_ascii=g.chance()), chunk=chunk)


def _extras(g: Gen, limit: int) -> Case:
    route, body = extras_body(g)
    return Case("extras", route, encode(body, ensure_ascii=g.chance()))


def _json(g: Gen, limit: int) -> Case:
    data = malformed_json(g) if g.chance() else encode(g.hostile(3))
    headers = {}
    if g.chance():
        headers["Content-Type"] = g.pick(
            ["application/json", "application/x-www-form-urlencoded", "text/plain"]
            + ["multipart/form-data; boundary=x", "application/json; charset=utf-16", "\xff"]
        )
    return Case("json", g.pick(ROUTES), data, headers=headers)


def _bytes(g: Gen, limit: int) -> Case:
    data = g.rng.randbytes(g.pick([0, 1, 7, 64, 1024, 65536]))
    return Case("bytes", g.pick([*ROUTES, "/nope"]), data, method=g.pick(["POST", "PUT"]))


def _path(g: Gen, limit: int) -> Case:
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO"]
    known = [*ROUTES, *GET_ROUTES, "/docs", "/openapi.json", "/", "/v1", "/v1/chat/completions"]
    path = g.pick(known)
    form = g.pick(["known", "slash", "upper", "query", "odd", "garbage", "long"])
    if form == "slash":
        path += "/"
    elif form == "upper":
        path = path.upper()
    elif form == "query":
        path += "?x=1&y=%ff&stream=true"
    elif form == "odd":
        path = g.pick(["//", "/..%2f..%2fetc/passwd", "/v1/completions%00", "/%ED%A0%80"])
    elif form == "garbage":
        path = "/" + urllib.parse.quote(g.text(), safe="", errors="surrogatepass")
    elif form == "long":
        path = "/" + "a" * g.rng.randint(100, 4000)
    body = encode(valid_completion(g)) if g.chance() else None
    return Case("path", path, body, method=g.pick(methods))


def _oversize(g: Gen, limit: int) -> Case:
    size = limit + g.rng.randint(1, limit)
    fill = g.pick(["prompt", "text", "bytes"])
    if fill == "prompt":
        data = (b'{"prompt": [' + b"1, " * (size // 3) + b"1]}")[:size]
    elif fill == "text":
        data = (b'{"prompt": "' + b"a" * size + b'"}')[:size]
    else:
        data = g.rng.randbytes(size)
    chunk = g.pick([0, 0, 1024, 65536, 1 << 20])
    route, method = g.pick([*ROUTES, "/nope"]), g.pick(["POST", "PUT", "PATCH"])
    return Case("oversize", route, data, method=method, chunk=chunk, expect=frozenset({413}))


def _timeout(g: Gen, limit: int) -> Case:
    route = g.pick(SCORING)
    body = VALID[route](g)
    mutated = g.chance(0.25)
    if mutated:
        body = mutate(g, body, route)
    if g.chance():
        seconds = 10 ** g.rng.uniform(-9, -1.5)
        value = g.pick([repr(seconds), f"{seconds:.9f}", "1e-9"])
    else:
        latin = [*range(0x20, 0x7F), *range(0x80, 0x100)]  # what a header value may hold
        junk = ["", "abc", "-1", "0", "-0.0", "nan", "inf", "-inf", "1e999", "0x10", "1,5"]
        junk += ["1_0", "10s", "\xff", "\xb2", "".join(chr(g.pick(latin)) for _ in "abcd")]
        value = g.pick(junk).strip()
    case = Case("timeout", route, encode(body), headers={"X-Request-Timeout": value})
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    positive = math.isfinite(seconds) and seconds > 0
    case.tiny_timeout = positive and seconds < TINY_TIMEOUT_S
    if not mutated:
        case.expect = frozenset({200, 504} if case.tiny_timeout else {200} if positive else {400})
    return case


CASES = {
    "valid": _valid,
    "mutated": _mutated,
    "extras": _extras,
    "json": _json,
    "bytes": _bytes,
    "path": _path,
    "oversize": _oversize,
    "timeout": _timeout,
}


def draw_case(seed_value: int, index: int, limit: int) -> Case:
    """Case ``index`` of the run with ``seed_value`` (its kind by :data:`KINDS`' shares)."""
    g = Gen(seed_value, index)
    return CASES[g.rng.choices(list(KINDS), list(KINDS.values()))[0]](g, limit)


# ------------------------------------------------------------------------------ client


def send(base: urllib.parse.SplitResult, case: Case, timeout: float):
    """``(status, body, None)``, or ``(None, b"", why)`` when no answer came."""
    conn = http.client.HTTPConnection(base.hostname, base.port, timeout=timeout)
    try:
        conn.putrequest(case.method, case.path, skip_accept_encoding=True)
        for name, value in case.headers.items():
            conn.putheader(name, value.encode("latin-1"))
        if case.body is None:
            conn.endheaders()
        elif case.chunk:
            conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            for at in range(0, len(case.body), case.chunk):
                part = case.body[at : at + case.chunk]
                conn.send(b"%x\r\n%s\r\n" % (len(part), part))
            conn.send(b"0\r\n\r\n")
        else:
            conn.putheader("Content-Length", str(len(case.body)))
            conn.endheaders(case.body)
        response = conn.getresponse()
        return response.status, response.read(), None
    except TimeoutError:
        return None, b"", f"hang: no answer within {timeout} s"
    except (OSError, http.client.HTTPException) as exc:
        return None, b"", f"no answer: {exc!r}"
    finally:
        conn.close()


def error_shape(status: int, data: bytes) -> str | None:
    """Why ``data`` is not OpenAI's error shape for ``status`` (None: it is)."""
    try:
        error = json.loads(data)["error"]
        message, kind = error["message"], error["type"]
        keys_ok = set(error) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        return f"not OpenAI's error shape: {data[:300]!r}"
    if not (isinstance(message, str) and message.strip() and isinstance(kind, str) and kind):
        return f"empty message or type: {data[:300]!r}"
    if not keys_ok or error["code"] != status:
        return f"error keys or code differ from {status}: {data[:300]!r}"
    return None


def _logprob(value) -> None:
    assert isinstance(value, float) and FLOOR <= value <= 1e-6, value


def _token_id(value) -> None:
    """A token of an answer is a vocabulary id (``N``, ``"N"`` or ``"token_id:N"``: the
    tiny model has no tokenizer), never a fill such as -1."""
    text = str(value).removeprefix("token_id:")
    assert text.isdigit() and int(text) < VOCAB, value


def _unscored(body: dict, i: int, prompt: list[int]) -> set[int]:
    """Positions of prompt ``i`` an answer leaves None: 0 (no prediction), and with
    ``logprob_positions: "masked"`` those outside its loss mask."""
    extras = body.get("megascore") or {}
    if extras.get("logprob_positions") != "masked" or extras.get("loss_mask") is None:
        return {0}
    mask = extras["loss_mask"][i]
    return {0} | {t for t in range(1, len(prompt)) if not mask[t]}


def _echoed(text: str) -> str:
    """A string as an answer echoes it: valid UTF-8 (a lone surrogate becomes ``?``)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _prompts(value) -> list[list[int]]:
    """The prompts of a body's ``prompt`` / ``input_ids`` (one list of ids, or a batch)."""
    return [value] if value and all(isinstance(v, int) for v in value) else value


def check_completion(body: dict, answer: dict) -> None:
    """A 200 answer of ``/v1/completions`` has what ``body`` asked for (raises
    AssertionError otherwise)."""
    prompts = _prompts(body["prompt"])
    choices, new = answer["choices"], body.get("max_tokens") or 0
    assert answer["object"] == "text_completion" and len(choices) == len(prompts)
    assert answer["usage"]["prompt_tokens"] == sum(map(len, prompts)), answer["usage"]
    assert answer["megascore"]["weights_version"], answer["megascore"]
    for i, (prompt, choice) in enumerate(zip(prompts, choices, strict=True)):
        assert choice["index"] == i and choice["finish_reason"] == "length"
        k, echo = body.get("logprobs"), body.get("echo", False)
        none_at = _unscored(body, i, prompt)
        if k is None:
            assert choice["logprobs"] is None
        else:
            lp = choice["logprobs"]
            n = (len(prompt) if echo else 0) + new
            assert all(len(lp[key]) == n for key in lp), (n, lp)
            if echo:
                assert lp["tokens"][: len(prompt)] == [f"token_id:{t}" for t in prompt]
                for t in none_at:
                    assert lp["token_logprobs"][t] is None and lp["top_logprobs"][t] is None
            skipped = none_at if echo else set()
            for t, (value, top) in enumerate(
                zip(lp["token_logprobs"], lp["top_logprobs"], strict=True)
            ):
                if t in skipped:
                    continue
                _logprob(value)
                assert 1 <= len(top) <= k + 1, (k, top)
                for token, top_value in top.items():
                    _token_id(token)
                    _logprob(top_value)
        pk = body.get("prompt_logprobs")
        if pk is not None:
            rows = choice["prompt_logprobs"]
            assert len(rows) == len(prompt), rows
            for t, row in enumerate(rows):
                assert (row is None) == (t in none_at), (t, row)
                if row is None:
                    continue
                assert str(prompt[t]) in row and len(row) <= pk + 1, (t, row)
                for token, entry in row.items():
                    _token_id(token)
                    _logprob(entry["logprob"])
                    assert isinstance(entry["rank"], int) and entry["rank"] >= 1, entry
        if body.get("return_token_ids"):
            assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == new
        if body.get("megascore") is not None:
            assert isinstance(choice["megascore"], dict)


def check_generate(body: dict, answer) -> None:
    """A 200 answer of ``/generate`` has what ``body`` asked for."""
    if body.get("input_ids") is None:
        return  # text: a server with a tokenizer (the tiny one has none)
    prompts = _prompts(body["input_ids"])
    answers = [answer] if prompts is not body["input_ids"] else answer
    assert isinstance(answers, list) and len(answers) == len(prompts), answer
    new = (body.get("sampling_params") or {}).get("max_new_tokens", 0)
    rid = body.get("rid")
    for i, (prompt, one) in enumerate(zip(prompts, answers, strict=True)):
        meta = one["meta_info"]
        assert len(one["output_ids"]) == new and meta["prompt_tokens"] == len(prompt), one
        assert meta["weights_version"], meta
        if rid is not None:
            want = rid[i] if isinstance(rid, list) else rid
            assert meta["id"] == _echoed(want), (rid, meta["id"])
        if not body.get("return_logprob"):
            continue
        start = body.get("logprob_start_len", -1)
        positions = range(len(prompt) - 1 if start < 0 else start, len(prompt))
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == [prompt[t] for t in positions], entries
        none_at = _unscored(body, i, prompt)
        for t, (value, _, _) in zip(positions, entries, strict=True):
            assert (value is None) == (t in none_at), (t, value)
            if value is not None:
                _logprob(value)
        assert len(meta["output_token_logprobs"]) == new
        k = body.get("top_logprobs_num", 0)
        if k > 0:
            tops = meta["input_top_logprobs"]
            assert len(tops) == len(positions), tops
            for t, top in zip(positions, tops, strict=True):
                assert (top is None) if t in none_at else 1 <= len(top) <= k, (t, top)
                for value, token, _ in top or []:
                    _token_id(token)
                    _logprob(value)
        wanted = body.get("token_ids_logprob")
        if wanted:
            rows = meta["input_token_ids_logprobs"]
            for t, row in zip(positions, rows, strict=True):
                assert (row is None) if t in none_at else [e[1] for e in row] == wanted, (t, row)


CHECKS = {"/v1/completions": check_completion, "/generate": check_generate}


class Fuzzer:
    """Sends the cases and tallies the outcomes by kind and status."""

    def __init__(self, url: str, timeout: float):
        self.base = urllib.parse.urlsplit(url)
        self.timeout = timeout
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.seconds: Counter = Counter()
        self.problems: list[dict] = []

    def run(self, index: int, case: Case) -> None:
        start = time.monotonic()
        status, data, failure = send(self.base, case, self.timeout)
        self.seconds[case.kind] += time.monotonic() - start
        self.counts[case.kind][str(status) if status is not None else failure.split(":")[0]] += 1
        why = failure or self.judge(case, status, data)
        if why:
            self.problems.append(
                {
                    "case": index,
                    "kind": case.kind,
                    "status": status,
                    "why": why[:600],
                    "request": case.describe(),
                }
            )

    @staticmethod
    def judge(case: Case, status: int, data: bytes) -> str | None:
        """What is wrong with answering ``case`` ``status`` ``data`` (None: nothing)."""
        if status >= 500 and not (status == 504 and case.tiny_timeout):
            return f"{status}: {data[:300]!r}"
        if case.expect is not None and status not in case.expect:
            return f"{status}, expected {sorted(case.expect)}: {data[:300]!r}"
        if status >= 400 and case.method != "HEAD":
            return error_shape(status, data)
        check = CHECKS.get(case.path) if case.method == "POST" else None
        if status == 200 and check is not None:
            try:
                check(json.loads(case.body), json.loads(data))
            except (AssertionError, KeyError, TypeError, ValueError, IndexError) as exc:
                return f"wrong 200 answer ({type(exc).__name__} {exc}): {data[:300]!r}"
        return None


def run_cases(fuzzer: Fuzzer, args) -> None:
    """Sends the run's cases (or only case ``args.only``), one at a time."""
    indexes = range(args.cases) if args.only is None else [args.only]
    for index in indexes:
        fuzzer.run(index, draw_case(args.seed, index, args.max_body_bytes))


# ------------------------------------------------------------------------------ verdict


def probe_answers(base: urllib.parse.SplitResult, timeout: float) -> dict:
    """The probes' answers without their per-call fields (id, created, timings)."""
    out = {}
    for route, body in PROBES.items():
        status, data, failure = send(base, Case("probe", route, encode(body)), timeout)
        assert status == 200, f"probe {route}: {status} {failure or data[:300]!r}"
        answer = json.loads(data)
        CHECKS[route](body, answer)
        for part in answer if isinstance(answer, list) else [answer]:
            part.pop("created", None)
            part.pop("id", None)
            part.get("meta_info", {}).pop("id", None)
            part.get("megascore", {}).pop("timings", None)
        out[route] = answer
    return out


def grpc_agrees(target: str, probes: dict) -> str | None:
    """Why a gRPC Score of the probe through the SDK fails or differs (None: it agrees)."""
    try:
        with ScoringClient(target, timeout=30) as client:
            result = client.score([PROBE_IDS])
    except Exception as exc:  # noqa: BLE001 - any failure is the verdict's
        return f"gRPC Score failed: {exc!r}"
    http = probes["/v1/completions"]["choices"][0]["logprobs"]["token_logprobs"][1 : len(PROBE_IDS)]
    if not np.allclose(result.logprobs[0][1:], http, atol=ATOL, rtol=0):
        return f"gRPC logprobs {result.logprobs[0][1:]} differ from HTTP's {http}"
    return None


def summarize(fuzzer: Fuzzer, args, elapsed: float, problems: list[str]) -> dict:
    counts = {kind: dict(sorted(c.items())) for kind, c in sorted(fuzzer.counts.items())}
    totals = sum((Counter(c) for c in counts.values()), Counter())
    return {
        "cases": sum(totals.values()),
        "seed": args.seed,
        "seconds": round(elapsed, 1),
        "by_status": dict(sorted(totals.items())),
        "by_kind": counts,
        "seconds_by_kind": {kind: round(t, 1) for kind, t in sorted(fuzzer.seconds.items())},
        "problems": problems[:20],
        "requests": fuzzer.problems[:50],
        "problem_requests": len(fuzzer.problems),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    server = None
    url, target = args.url, args.target
    if url is None:
        log = Path(tempfile.mkdtemp(prefix="megascore-fuzz-http-")) / "serve.log"
        http_port = pick_port()
        flags = ["--model", "tiny", "--device", "cpu", "--http-port", str(http_port)]
        flags += ["--max-message-bytes", str(args.max_body_bytes), "--grace-s", "30"]
        print(f"fuzz_http: starting megascore serve {' '.join(flags)} (log {log})", flush=True)
        server = ServeProcess(log, *flags, env=CPU_ONE_THREAD)
        url = f"http://127.0.0.1:{http_port}"
    problems: list[str] = []
    exit_code = None
    try:
        if server is not None:
            server.wait_serving()
            target = server.target
        fuzzer = Fuzzer(url, args.timeout)
        before = probe_answers(fuzzer.base, args.timeout)
        start = time.monotonic()
        run_cases(fuzzer, args)
        elapsed = time.monotonic() - start
        problems += [f"{p['kind']}: {p['why']} <- {p['request']}" for p in fuzzer.problems]
        if probe_answers(fuzzer.base, args.timeout) != before:
            problems.append("the probes are answered differently after the run")
        health, data, _ = send(fuzzer.base, Case("probe", "/health", method="GET"), args.timeout)
        if health != 200:
            problems.append(f"/health answers {health} after the run: {data[:200]!r}")
        if target is not None and (why := grpc_agrees(target, before)):
            problems.append(why)
        if server is not None:
            exit_code, ended = server.end_cleanly()
            problems += ended
    finally:
        if server is not None:
            server.close()
    summary = summarize(fuzzer, args, elapsed, problems)
    summary.update(url=url, target=target, server_exit_code=exit_code)
    print(json.dumps({k: v for k, v in summary.items() if k != "requests"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    statuses = ", ".join(f"{k}: {v}" for k, v in summary["by_status"].items())
    verdict = "PASS" if not problems else f"FAIL: {len(problems)} problem(s)"
    print(f"fuzz_http: {verdict}; {summary['cases']} cases in {summary['seconds']} s; {statuses}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
