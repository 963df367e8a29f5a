"""The HTTP front keeps gRPC's guarantees (issue 32, item 5), on the fake engine.

Bad bodies are 4xx in OpenAI's error shape naming the field (and the prompt), and the
gRPC side keeps serving; the bearer token and TLS / mTLS hold on the HTTP port as on
gRPC's; a full queue is a 429 with ``Retry-After``; loading and draining are 503;
``X-Request-Timeout`` ends a call with 504; a client that disconnects takes its queued
work with it; calls are counted by front and route. The real clients (lm-eval, TRL,
openai, slime) run in ``tests/http``. Only the standard library speaks HTTP here (the
floors venv runs these tests too).
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time

import numpy as np
import pytest

from megascore.api import schema
from megascore.api.errors import InvalidRequestError
from megascore_server.config import GrpcServerConfig
from megascore_server.http import extras
from megascore_server.ports import pick_port
from tests.pki import make_pki
from tests.service.fake_engine import VOCAB, FakeEngine, compute
from tests.service.harness import Req, ServerThread, check_response, wait_for

TOKEN = "http-s3cret"
LIMIT = 64 * 1024
PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]


def serve(engine: FakeEngine | None, **config) -> ServerThread:
    """A server (no engine: loading) with its HTTP front on a free port (``srv.http_port``)."""
    config.setdefault("max_message_bytes", LIMIT)
    srv = ServerThread(engine, GrpcServerConfig(port=0, http_port=pick_port(), **config))
    srv.http_port = srv.handles.http.port
    return srv


def call(srv, method, path, body=None, *, headers=None, raw=None, context=None, timeout=30):
    """``(status, headers, json body)`` of one request to ``srv``'s HTTP front."""
    if context is None:
        conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=timeout)
    else:
        conn = http.client.HTTPSConnection(
            "localhost", srv.http_port, timeout=timeout, context=context
        )
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers=headers or {})
        response = conn.getresponse()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return response.status, headers, json.loads(response.read() or b"null")
    finally:
        conn.close()


def completion(prompt=PROMPTS, **fields):
    return {"model": "fake", "prompt": prompt, "echo": True, "max_tokens": 0, **fields}


def assert_error(answer, status: int, *words: str, param: str | None = None):
    """An OpenAI-shaped error with ``status``, every word in its message, and ``param``."""
    got, headers, body = answer
    assert got == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert error["code"] == status and error["message"], body
    for word in words:
        assert word in error["message"], (word, body)
    if param is not None:
        assert error["param"] == param, body
    return headers


def expected_logprobs(prompt: list[int]) -> list:
    """What ``/v1/completions`` echo answers for ``prompt`` alone (the fake forward)."""
    req = Req([prompt])
    return [None, *compute(req.batch()).logprobs[1:].tolist()]


@pytest.fixture(scope="module")
def server():
    srv = serve(FakeEngine())
    try:
        yield srv
    finally:
        srv.stop()


def test_scores_equal_the_fake_forward_and_grpc(server):
    status, _, body = call(server, "POST", "/v1/completions", completion(logprobs=0))
    assert status == 200, body
    for choice, prompt in zip(body["choices"], PROMPTS, strict=True):
        got = choice["logprobs"]["token_logprobs"]
        want = expected_logprobs(prompt)
        assert got[0] is None and np.allclose(got[1:], want[1:], rtol=0, atol=1e-6)
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in prompt]
    assert body["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
    req = Req(PROMPTS, request_id="grpc")
    check_response(server.stub().Score(req.proto(), timeout=10), req)


BAD_BODIES = [
    # (why, body or raw bytes, status, words in the message, param)
    ("malformed JSON", b'{"prompt": [1, 2', 400, ("not valid JSON",), None),
    ("prompt of the wrong type", completion(prompt=5), 400, ("prompt",), "prompt"),
    ("a string inside ids", completion(prompt=[[1, "x"]]), 400, ("prompt",), None),
    ("echo not a boolean", completion(echo="yes"), 400, ("echo",), "echo"),
    ("an id out of range", completion(prompt=[[1, 2], [3, VOCAB + 7]]), 400, ("1",), "prompt"),
    ("a negative id", completion(prompt=[[1, -2]]), 400, ("-2",), "prompt"),
    ("an id beyond int64", completion(prompt=[[1, 2**70]]), 400, ("int64",), "prompt"),
    ("no prompt", completion(prompt=[]), 400, ("at least one prompt",), "prompt"),
    ("an empty prompt", completion(prompt=[[1], []]), 400, ("prompt[1]", "empty"), "prompt[1]"),
    ("k above the limit", completion(logprobs=10**6), 400, ("top_k",), "logprobs"),
    ("negative logprobs", completion(logprobs=-1), 400, ("logprobs",), "logprobs"),
    ("generation asked for", completion(max_tokens=16), 400, ("does not generate",), None),
    ("a stream asked for", completion(stream=True), 400, ("does not generate",), "stream"),
    ("n > 1", completion(n=2), 400, ("n=1",), "n"),
    ("text without a tokenizer", completion(prompt="hello"), 400, ("--tokenizer",), None),
    ("a bad temperature", completion(temperature=-1.0), 400, ("temperature",), None),
    ("an unknown extra", completion(megascore={"nope": 1}), 400, ("known:",), "megascore.nope"),
    (
        "a loss mask of the wrong length",
        completion(megascore={"loss_mask": [[1, 1], [1, 1, 1]]}),
        400,
        ("megascore.loss_mask[0]",),
        "megascore.loss_mask[0]",
    ),
]


@pytest.mark.parametrize(
    "why,body,status,words,param", BAD_BODIES, ids=[case[0] for case in BAD_BODIES]
)
def test_a_bad_completion_body_is_a_4xx_naming_the_field(server, why, body, status, words, param):
    raw = body if isinstance(body, bytes) else None
    answer = call(server, "POST", "/v1/completions", None if raw else body, raw=raw)
    assert_error(answer, status, *words, param=param)


def test_bad_generate_and_tokenizer_bodies_and_routes(server):
    assert_error(call(server, "POST", "/generate", {"input_ids": "x"}), 400, "input_ids")
    bad_id = {"input_ids": [[1, 2], [3, VOCAB]], "return_logprob": True}
    assert_error(call(server, "POST", "/generate", bad_id), 400, str(VOCAB))
    late = {"input_ids": [[1, 2, 3], [4]], "return_logprob": True, "logprob_start_len": 2}
    assert_error(call(server, "POST", "/generate", late), 400, "input 1's length 1")
    rids = {"input_ids": [[1, 2], [3]], "rid": ["a"]}
    assert_error(call(server, "POST", "/generate", rids), 400, "rid", param="rid")
    generate = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8}}
    assert_error(call(server, "POST", "/generate", generate), 400, "does not generate")
    assert_error(call(server, "POST", "/tokenize", {"prompt": "hi"}), 412, "--tokenizer")
    assert_error(call(server, "GET", "/tokenizer_info"), 412, "--tokenizer")
    assert_error(call(server, "POST", "/detokenize", {"tokens": ["a"]}), 400, "tokens")
    assert_error(call(server, "GET", "/v2/nothing"), 404, "/v2/nothing")
    assert_error(call(server, "GET", "/v1/completions"), 405)


def test_a_body_over_the_limit_is_a_413_with_or_without_its_length(server):
    big = json.dumps(completion(prompt=[list(range(1, 200))] * 200)).encode()
    assert len(big) > LIMIT
    assert_error(call(server, "POST", "/v1/completions", raw=big), 413, str(LIMIT))
    # Chunked: no Content-Length, the guard counts the bytes as they arrive.
    chunks = (big[i : i + 4096] for i in range(0, len(big), 4096))
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=chunks, encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 413, response.read()
        assert json.loads(response.read())["error"]["code"] == 413
    finally:
        conn.close()


def test_grpc_and_http_serve_after_every_bad_body(server):
    for _, body, *_ in BAD_BODIES:
        raw = body if isinstance(body, bytes) else None
        call(server, "POST", "/v1/completions", None if raw else body, raw=raw)
    req = Req([[9, 8, 7]], request_id="after")
    check_response(server.stub().Score(req.proto(), timeout=10), req)
    status, _, body = call(server, "POST", "/v1/completions", completion(prompt=[9, 8, 7]))
    assert status == 200 and body["choices"][0]["logprobs"] is None
    assert call(server, "GET", "/health")[0] == 200


def counter(srv, route: str, code: str) -> float:
    return srv.handles.metrics.requests.labels(front="http", rpc=route, code=code)._value.get()


def test_calls_are_counted_by_front_and_route(server):
    ok, bad = counter(server, "/v1/completions", "200"), counter(server, "/v1/completions", "400")
    missing = counter(server, "other", "404")
    grpc_ok = server.handles.metrics.requests.labels(front="grpc", rpc="Score", code="OK")
    grpc_before = grpc_ok._value.get()
    call(server, "POST", "/v1/completions", completion())
    call(server, "POST", "/v1/completions", completion(n=3))
    call(server, "GET", "/not/a/route/abc")
    req = Req([[9, 8, 7]], request_id="counted")
    check_response(server.stub().Score(req.proto(), timeout=10), req)
    assert counter(server, "/v1/completions", "200") == ok + 1
    assert counter(server, "/v1/completions", "400") == bad + 1
    assert counter(server, "other", "404") == missing + 1
    assert grpc_ok._value.get() == grpc_before + 1  # under its own front, not HTTP's


def test_bearer_token_on_both_ports(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    srv = serve(FakeEngine(), auth_token_file=str(token_file))
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            answer = call(srv, "POST", "/v1/completions", completion(), headers=headers)
            assert_error(answer, 401, "bearer token")
            assert_error(call(srv, "GET", "/v1/models", headers=headers), 401)
        assert call(srv, "GET", "/health")[0] == 200  # probes stay open, as gRPC health
        good = {"Authorization": f"Bearer {TOKEN}"}
        assert call(srv, "POST", "/v1/completions", completion(), headers=good)[0] == 200
        assert call(srv, "GET", "/v1/models", headers=good)[2]["data"][0]["id"] == "fake"
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def client_context(files, paths, cert: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=files["server_ca"].decode())
    if cert is not None:
        context.load_cert_chain(paths[f"{cert}_cert"], paths[f"{cert}_key"])
    return context


def test_tls_and_mtls_on_the_http_port(pki):
    files, paths = pki
    srv = serve(
        FakeEngine(),
        tls_cert=paths["server_cert"],
        tls_key=paths["server_key"],
        tls_client_ca=paths["client_ca"],
    )
    try:
        ok = client_context(files, paths, "client")
        assert call(srv, "POST", "/v1/completions", completion(), context=ok)[0] == 200
        for context in (client_context(files, paths), client_context(files, paths, "rogue")):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                call(srv, "GET", "/v1/models", context=context)
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            call(srv, "GET", "/v1/models")  # plaintext to a TLS port
        foreign = ssl.create_default_context(cadata=files["rogue_ca"].decode())
        with pytest.raises(ssl.SSLError):
            call(srv, "GET", "/v1/models", context=foreign)
    finally:
        srv.stop()


def background(srv, body, headers=None):
    """Sends ``body`` from a thread; ``result()`` is its ``call`` answer."""
    box: dict = {}

    def run():
        try:
            box["answer"] = call(srv, "POST", "/v1/completions", body, headers=headers)
        except Exception as exc:  # noqa: BLE001 - reported by result()
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result(timeout=30):
        thread.join(timeout)
        assert not thread.is_alive(), "no answer"
        if "error" in box:
            raise box["error"]
        return box["answer"]

    return result


def held(srv):
    """Closes the fake engine's gate: steps wait until it opens."""
    srv.engine.gate = threading.Event()
    srv.engine.started.clear()
    return srv.engine.gate


def test_a_full_queue_is_a_429_with_retry_after():
    srv = serve(FakeEngine(), max_queue=1, max_batch_wait_ms=1)
    gate = held(srv)
    try:
        running = background(srv, completion(prompt=[[1, 2, 3]]))
        assert srv.engine.started.wait(10)
        waiting = background(srv, completion(prompt=[[4, 5]]))
        wait_for(lambda: srv.handles.batcher.queue_depth == 1, what="one request queued")
        headers = assert_error(call(srv, "POST", "/v1/completions", completion()), 429, "queue")
        assert headers["retry-after"] == "1"
        gate.set()
        assert running()[0] == 200 and waiting()[0] == 200
    finally:
        gate.set()
        srv.stop()


def test_loading_and_draining_are_503():
    srv = serve(None)  # no engine yet: loading
    try:
        assert_error(call(srv, "GET", "/health"), 503, "loading")
        headers = assert_error(call(srv, "POST", "/v1/completions", completion()), 503)
        assert headers["retry-after"] == "1"
        srv.call(srv.handles.attach_engine(FakeEngine()))
        assert call(srv, "GET", "/health")[0] == 200
        assert call(srv, "POST", "/v1/completions", completion())[0] == 200
        srv.call(srv.handles.gate.drain("test"))
        assert_error(call(srv, "GET", "/health"), 503, "shutting down")
        assert_error(call(srv, "POST", "/v1/completions", completion()), 503, "shutting down")
    finally:
        srv.stop()


def test_requests_racing_the_stop_get_503_never_a_reset():
    """Keep-alive clients call in a loop while the server stops: each request is answered
    200 or 503 (``Retry-After``, ``Connection: close``), or its connection is refused
    once the listener is closed; no request dies on a connection the server dropped.
    The clients wait as ``Retry-After`` says: one that reconnects at once can land in the
    listener's backlog at its close, which the kernel resets before any byte is read."""
    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    for _ in range(2):
        srv = serve(FakeEngine())
        srv.call(srv.handles.gate.open())
        stop = threading.Event()

        def hammer(port=srv.http_port, stop=stop):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            body = json.dumps(completion()).encode()
            while not stop.is_set():
                try:
                    conn.request("POST", "/v1/completions", body=body)
                    response = conn.getresponse()
                    response.read()
                    outcome = str(response.status)
                    if response.status == 503:
                        closing = response.getheader("Connection") == "close"
                        retry = response.getheader("Retry-After") == "1"
                        outcome += "" if closing and retry else " without close / Retry-After"
                        time.sleep(1.0)
                except ConnectionRefusedError:
                    outcome = "refused"
                    conn.close()
                    time.sleep(0.01)
                except (http.client.HTTPException, OSError) as exc:
                    outcome = f"dropped: {type(exc).__name__}"
                    conn.close()
                with lock:
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
            conn.close()

        threads = [threading.Thread(target=hammer) for _ in range(6)]
        try:
            for thread in threads:
                thread.start()
            wait_for(lambda: outcomes.get("200", 0) > 20, what="answers")
            assert srv.call(srv.handles.stop(grace=5), timeout=60) is True
            time.sleep(1.2)  # clients keep calling the stopped server
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
            srv.stop()
    assert set(outcomes) <= {"200", "503", "refused"}, repr(outcomes)
    assert outcomes.get("503", 0) > 0 and outcomes.get("refused", 0) > 0, outcomes


def test_x_request_timeout_ends_the_call_with_504(server):
    gate = held(server)
    try:
        start = time.monotonic()
        headers = {"X-Request-Timeout": "0.5"}
        answer = call(server, "POST", "/v1/completions", completion(), headers=headers)
        assert_error(answer, 504, "X-Request-Timeout")
        assert time.monotonic() - start < 10
        for junk in ("abc", "-1", "nan", "0"):
            answer = call(
                server, "POST", "/v1/completions", completion(), headers={"X-Request-Timeout": junk}
            )
            assert_error(answer, 400, "X-Request-Timeout")
    finally:
        gate.set()
        server.engine.gate = None


def test_a_client_that_disconnects_takes_its_queued_work_with_it():
    srv = serve(FakeEngine(), max_batch_wait_ms=1)
    gate = held(srv)
    try:
        running = background(srv, completion(prompt=[[1, 2, 3]]))
        assert srv.engine.started.wait(10)
        body = json.dumps(completion(prompt=[[7] * 11])).encode()
        with socket.create_connection(("127.0.0.1", srv.http_port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            wait_for(lambda: srv.handles.batcher.queue_depth == 1, what="queued")
        # The socket is closed: the front cancels the call, the batcher drops it.
        wait_for(lambda: srv.handles.batcher.queue_depth == 0, what="the queued work dropped")
        wait_for(lambda: counter(srv, "/v1/completions", "499") == 1, what="counted as 499")
        gate.set()
        assert running()[0] == 200
        assert [batch.lengths.tolist() for batch, _ in srv.engine.steps] == [[3]]
    finally:
        gate.set()
        srv.stop()


# ---------------------------------------------------------------------------- extras


def valid_extra(name: str, lengths: list[int]):
    """A value of table entry ``name`` as an HTTP body writes it, or None for options
    whose value is not a plain one (enums are read by name)."""
    for opt in schema.OPTIONS:
        if opt.name == name:
            if opt.names is not None:
                return next(iter(opt.names))
            return {bool: True, int: 2, str: "v7", tuple: ["nll"]}[type(opt.default)]
    spec = next(s for s in schema.INPUTS if s.name == name)
    if spec.per == schema.SEQUENCE:  # an integer input (score_from) refuses a fraction
        return [1 if np.dtype(spec.dtype).kind in "iu" else 1.5] * len(lengths)
    shape = (1,) * spec.ndim
    return [np.ones((n, *shape), dtype=spec.dtype).tolist() for n in lengths]


NAMES = [opt.name for opt in schema.OPTIONS] + [s.name for s in schema.INPUTS if s.wire]


@pytest.mark.parametrize("name", NAMES)
def test_every_table_entry_is_reachable_through_the_megascore_key(name):
    """Read from the table: every option and input is accepted by its name and reaches the
    batch's keyword arguments; a value of the wrong type is refused naming the key."""
    lengths = np.array([3, 2])
    value = valid_extra(name, lengths.tolist())
    kwargs = extras.read({name: value}, lengths)
    assert set(kwargs) == {name}
    spec = next((s for s in schema.INPUTS if s.name == name), None)
    if spec is not None:  # concatenated over the prompts: one row per token or sequence
        rows = lengths.sum() if spec.per == schema.TOKEN else lengths.size
        assert kwargs[name].shape == (rows, *(1,) * spec.ndim)
        assert kwargs[name].dtype == np.dtype(spec.dtype)
    else:
        opt = schema.option(name)
        want = value if opt.names is None else opt.names[value]
        assert kwargs[name] == opt.convert(tuple(want) if isinstance(want, list) else want)
    with pytest.raises(InvalidRequestError, match=f"megascore.{name}"):
        extras.read({name: {"not": "a value"}}, lengths)


# ---------------------------------------------------------------------------- score_from, cache


def test_cached_tokens_are_in_the_usage_and_the_meta_info(server, monkeypatch):
    """``usage.prompt_tokens_details.cached_tokens`` is the sum of the engine's
    ``cached_tokens`` over the prompts, ``meta_info.cached_tokens`` each prompt's (0 from
    an engine without a prefix cache; here a fake cache that held all but the last token)."""
    from tests.service import fake_engine

    status, _, plain = call(server, "POST", "/v1/completions", completion(logprobs=0))
    assert status == 200 and plain["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    status, _, items = call(server, "POST", "/generate", {"input_ids": PROMPTS})
    assert status == 200 and [item["meta_info"]["cached_tokens"] for item in items] == [0, 0]

    def cached(batch, *args):
        out = compute(batch, *args)
        out.values["cached_tokens"] = batch.lengths - 1
        return out

    monkeypatch.setattr(fake_engine, "compute", cached)
    status, _, body = call(server, "POST", "/v1/completions", completion(logprobs=0))
    assert status == 200, body
    total = sum(map(len, PROMPTS))
    assert body["usage"] == {
        "prompt_tokens": total,
        "completion_tokens": 0,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": total - len(PROMPTS)},
    }
    assert body["choices"] == plain["choices"]  # nothing else moves
    status, _, items = call(server, "POST", "/generate", {"input_ids": PROMPTS})
    assert status == 200, items
    assert [item["meta_info"]["cached_tokens"] for item in items] == [len(p) - 1 for p in PROMPTS]


def test_logprob_start_len_goes_to_the_engine_as_score_from(server):
    """/generate sends ``logprob_start_len`` (-1: the last token) as ``score_from``, and
    answers as the same body did when it sliced the full answer: the body with a
    ``megascore`` key (which keeps every position) answers the same."""
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    for start, want in ((2, [2, 2]), (0, [0, 0]), (-1, [4, 2])):
        body = {
            "input_ids": prompts,
            "return_logprob": True,
            "logprob_start_len": start,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 0},
        }
        status, _, got = call(server, "POST", "/generate", body)
        assert status == 200, got
        batch, _ = server.engine.steps[-1]
        assert batch.score_from.tolist() == want
        status, _, full = call(server, "POST", "/generate", {**body, "megascore": {}})
        assert status == 200, full
        assert server.engine.steps[-1][0].score_from is None
        for item, whole in zip(got, full, strict=True):
            meta, whole_meta = dict(item["meta_info"]), dict(whole["meta_info"])
            for key in ("megascore", "id"):  # the extras asked for; each call's own id
                meta.pop(key, None), whole_meta.pop(key, None)
            assert meta == whole_meta and item["output_ids"] == whole["output_ids"]
        entries = got[0]["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == prompts[0][want[0] :]


def test_megascore_score_from_answers_the_positions_before_it_as_none(server):
    extra = {"score_from": [2, 0], "losses": ["nll"]}
    status, _, body = call(
        server, "POST", "/v1/completions", completion(logprobs=0, megascore=extra)
    )
    assert status == 200, body
    lps = [choice["logprobs"]["token_logprobs"] for choice in body["choices"]]
    assert lps[0][:2] == [None, None] and lps[1][0] is None
    assert np.allclose(lps[0][2:], expected_logprobs(PROMPTS[0])[2:], rtol=0, atol=1e-6)
    assert np.allclose(lps[1][1:], expected_logprobs(PROMPTS[1])[1:], rtol=0, atol=1e-6)
    nll = [choice["megascore"]["loss"]["nll"] for choice in body["choices"]]
    assert np.isclose(nll[0], -sum(lps[0][2:]), atol=1e-5)
    assert np.isclose(nll[1], -sum(lps[1][1:]), atol=1e-5)


@pytest.mark.parametrize(
    "value,words",
    [
        ([0, 1.5], ("megascore.score_from", "sequence 1", "not an integer")),
        ([0, -1], ("score_from", "sequence 1", "outside [0, 3]")),
        (5, ("score_from", "sequence 0", "outside [0, 4]")),
        ([1, 2, 3], ("megascore.score_from", "one number per prompt")),
    ],
)
def test_a_bad_score_from_is_a_400_naming_the_sequence(server, value, words):
    extra = {"score_from": value}
    answer = call(server, "POST", "/v1/completions", completion(logprobs=0, megascore=extra))
    assert_error(answer, 400, *words, param="megascore.score_from")
    body = {"input_ids": PROMPTS, "return_logprob": True, "megascore": extra}
    assert_error(call(server, "POST", "/generate", body), 400, *words)
    assert call(server, "POST", "/v1/completions", completion(logprobs=0))[0] == 200


# ---------------------------------------------------------------------------- fuzz finds
# Each body below once answered 500 or a wrong 200 (scripts/fuzz_http.py, 2026-12-05).


def test_a_lone_surrogate_the_answer_echoes_is_replaced_not_a_500(server):
    answer = call(server, "POST", "/v1/completions", completion(megascore={"\ud800": 1}))
    assert_error(answer, 400, "unknown key")
    status, _, body = call(server, "POST", "/generate", {"input_ids": [1, 2], "rid": "a\ud800"})
    assert status == 200 and body["meta_info"]["id"] == "a?", body
    status, _, body = call(server, "POST", "/v1/completions", completion(model="m\udfff"))
    assert status == 404 and "does not exist" in body["error"]["message"], body  # a set name


def test_a_timeout_that_passes_while_queued_is_a_504(server):
    # Idle engine: the batcher drops the request whose deadline passed (a cancel) before
    # the front's own timer fires -- both must be a 504.
    for _ in range(10):
        headers = {"X-Request-Timeout": "0.0001"}
        answer = call(server, "POST", "/v1/completions", completion(), headers=headers)
        assert_error(answer, 504, "X-Request-Timeout")
    gate = held(server)
    try:
        running = background(server, completion(prompt=[[1, 2, 3]]))
        assert server.engine.started.wait(10)
        for timeout in ("0.0001", "0.001", "0.05"):
            headers = {"X-Request-Timeout": timeout}
            answer = call(server, "POST", "/v1/completions", completion(), headers=headers)
            assert_error(answer, 504, "X-Request-Timeout")
        gate.set()
        assert running()[0] == 200
    finally:
        gate.set()
        server.engine.gate = None


def test_return_logprobs_false_is_refused_where_the_answer_needs_them(server):
    no_lp = {"return_logprobs": False}
    answer = call(server, "POST", "/v1/completions", completion(logprobs=0, megascore=no_lp))
    assert_error(answer, 400, "megascore.return_logprobs", param="megascore.return_logprobs")
    body = {"input_ids": [1, 2], "return_logprob": True, "megascore": no_lp}
    assert_error(call(server, "POST", "/generate", body), 400, "megascore.return_logprobs")
    status, _, body = call(server, "POST", "/v1/completions", completion(megascore=no_lp))
    assert status == 200 and body["choices"][0]["logprobs"] is None  # none asked for


def test_negative_top_logprobs_num_and_target_ids_given_twice_are_400(server):
    body = {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": -1}
    assert_error(call(server, "POST", "/generate", body), 400, "top_logprobs_num")
    extra = {"target_ids": [[[1], [2]]]}
    twice = {"input_ids": [1, 2], "token_ids_logprob": [3], "megascore": extra}
    assert_error(call(server, "POST", "/generate", twice), 400, "megascore.target_ids", "also")


def test_a_per_sequence_extra_beyond_float32_is_400(server):
    for value in (10**400, 1e300, [1.0, 1e39]):
        extra = {"temperature": value}
        answer = call(server, "POST", "/v1/completions", completion(megascore=extra))
        assert_error(answer, 400, "megascore.temperature", param="megascore.temperature")


def test_masked_positions_left_unscored_are_none_in_both_dialects(server):
    mask = {"loss_mask": [[0, 0, 1, 1]], "logprob_positions": "masked"}
    prompt = [[4, 5, 6, 7]]
    want = expected_logprobs(prompt[0])
    status, _, body = call(
        server, "POST", "/v1/completions", completion(prompt=prompt, logprobs=0, megascore=mask)
    )
    assert status == 200, body
    got = body["choices"][0]["logprobs"]
    assert got["token_logprobs"][:2] == [None, None] and got["top_logprobs"][:2] == [None, None]
    assert np.allclose(got["token_logprobs"][2:], want[2:], rtol=0, atol=1e-6)
    generate = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0}
    status, _, body = call(server, "POST", "/generate", {**generate, "megascore": mask})
    assert status == 200, body
    entries = body[0]["meta_info"]["input_token_logprobs"]
    assert [e[0] for e in entries[:2]] == [None, None] and [e[1] for e in entries] == prompt[0]
    assert np.allclose([e[0] for e in entries[2:]], want[2:], rtol=0, atol=1e-6)
