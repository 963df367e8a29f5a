"""Issue 43, item 4: what keeps unread streams and large bodies harmless, on the fake
engine (the whole attacks against a real server: ``reliability/test_flood.py``).

A ScoreStream whose answers are not taken holds at most ``max_stream_inflight``
requests, answered or not, and reads no further; an HTTP body is parsed by pydantic's
JSON parser (the stdlib's for what it refuses), a large one in a worker thread, with the
same answers and errors as a small one (its token ids come back as arrays).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.exceptions import RequestValidationError

from megascore_server.config import GrpcServerConfig
from megascore_server.http.bodies import INLINE_BYTES, decode
from megascore_server.http.completions import CompletionRequest
from megascore_server.http.generate import GenerateRequest
from megascore_server.ports import pick_port
from megascore_server.servicer import ScorerServicer
from tests.service.fake_engine import FakeEngine
from tests.service.harness import Req, ServerThread
from tests.service.test_http_front import call, completion


class _Context:
    def time_remaining(self):
        return None


def test_a_stream_whose_answers_are_not_taken_stops_reading_at_its_inflight_bound():
    server = ServerThread(FakeEngine())
    taken = 0

    async def requests():
        nonlocal taken
        for i in range(50):
            taken += 1
            yield Req([[1, 2, 3]], request_id=f"r{i}").proto()

    memory = _Memory()

    async def take_one_answer() -> int:
        servicer = ScorerServicer(server.handles.service, max_stream_inflight=3, memory=memory)
        stream = servicer.ScoreStream(requests(), _Context())
        assert (await anext(stream)).request_id == "r0"
        await asyncio.sleep(1.0)  # its write waits: the stream is not pulled again
        await stream.aclose()
        return taken

    try:
        # r0 (answered, not yet written), r1 and r2 submitted, r3 read and waiting for a
        # slot; a slot freed when an answer is computed instead of written read one more
        assert server.call(take_one_answer()) == 3 + 1
        assert memory.asked == 1  # what its client sent meanwhile is given back at its end
    finally:
        server.stop()


class _Memory:
    """Counts the trims a servicer asks for (``MemoryTrim.soon``)."""

    def __init__(self):
        self.asked = 0

    def soon(self) -> None:
        self.asked += 1


def test_a_stream_whose_reads_never_waited_for_a_slot_asks_for_no_trim():
    server = ServerThread(FakeEngine())
    memory = _Memory()

    async def requests():  # no more than its in-flight bound: grpc buffers nothing
        for i in range(3):
            yield Req([[1, 2, 3]], request_id=f"r{i}").proto()

    async def read_all() -> list[str]:
        servicer = ScorerServicer(server.handles.service, max_stream_inflight=3, memory=memory)
        return [answer.request_id async for answer in servicer.ScoreStream(requests(), _Context())]

    try:
        assert server.call(read_all()) == ["r0", "r1", "r2"]
        assert memory.asked == 0
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("model", "body", "want"),
    [
        (CompletionRequest, {"prompt": [1, 2]}, [1, 2]),
        (CompletionRequest, {"prompt": [[1], [2, 3]]}, [[1], [2, 3]]),
        (CompletionRequest, {"prompt": "a b"}, "a b"),
        (CompletionRequest, {"prompt": ["a", "b"]}, ["a", "b"]),
        (CompletionRequest, {"prompt": [[1, 2**70]]}, [[1, 2**70]]),  # int64 checked later
        (GenerateRequest, {"input_ids": [[7, 8]], "rid": "a\ud800"}, [[7, 8]]),
    ],
)
def test_bodies_decode_to_the_prompts_sent(model, body, want):
    decoded = decode(model, json.dumps(body).encode())
    assert (decoded.prompt if model is CompletionRequest else decoded.input_ids) == want
    assert type(decoded.model_dump(exclude_none=True)) is dict


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b'{"prompt": [1, true]}', ("body", "prompt")),
        (b'{"prompt": [[1], [2, "x"]]}', ("body", "prompt")),
        (b'{"prompt": 1.5}', ("body", "prompt")),
        (b"[1, 2]", ("body",)),
        (b'{"prompt": [1, 2', ("body", 0)),
        (b'\xff{"prompt": [1]}', ("body", 0)),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", ("body", 0)),
    ],
)
def test_bad_bodies_are_fastapis_validation_errors(raw, where):
    with pytest.raises(RequestValidationError) as info:
        decode(CompletionRequest, raw)
    assert all(error["loc"][: len(where)] == where for error in info.value.errors())


def test_a_large_body_is_parsed_apart_with_the_same_answers():
    srv = ServerThread(
        FakeEngine(),
        GrpcServerConfig(port=0, http_port=pick_port(), max_message_bytes=4 << 20),
    )
    srv.http_port = srv.handles.http.port
    prompts = [[100 + i % 800] * 99 + [i % 1000] for i in range(700)]
    body = completion(prompt=prompts, logprobs=0)
    try:
        assert len(json.dumps(body)) > INLINE_BYTES
        status, _, answer = call(srv, "POST", "/v1/completions", body)
        assert status == 200 and answer["usage"]["prompt_tokens"] == 70_000, answer
        small = call(srv, "POST", "/v1/completions", completion(prompt=prompts[-3:], logprobs=0))
        assert answer["choices"][-3:] == [
            {**c, "index": 697 + i} for i, c in enumerate(small[2]["choices"])
        ]
        generate = {"input_ids": prompts, "return_logprob": True}
        status, _, answers = call(srv, "POST", "/generate", generate)
        assert status == 200 and [a["meta_info"]["prompt_tokens"] for a in answers] == [100] * 700
        prompts[-1][-1] = True  # a boolean is not an id: refused naming where it is
        status, _, answer = call(srv, "POST", "/v1/completions", body)
        assert status == 400 and "prompt[699][99]" in answer["error"]["message"], answer
        prompts[-1] = []
        status, _, answer = call(srv, "POST", "/v1/completions", body)
        assert status == 400 and "prompt[699]: empty prompt" in answer["error"]["message"]
    finally:
        srv.stop()
