"""ScoringClient against a real gRPC server running the fake Scorer."""

from __future__ import annotations

import pickle

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from megascore.v1 import scoring_pb2 as pb
from megascore_client import (
    InvalidInputError,
    RetryPolicy,
    ScoringClient,
    ScoringError,
)
from megascore_client import health as health_codec
from megascore_client.channel import ChannelSettings
from tests.client.fake_server import (
    MAX_TOP_K,
    VOCAB,
    FakeScorer,
    FakeServer,
    check_scores,
    ref_logprobs,
    ref_nll,
)

SEQS = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 300, 400, 500, 7, 11]]


def test_score_all_options_round_trip(server, client):
    masks = [[0, 0, 1, 1, 1], [1, 1, 1], [0, 1, 0, 1, 0, 1, 1]]
    result = client.score(
        SEQS,
        loss_mask=masks,
        top_k=3,
        temperature=2.0,
        losses=("nll", "mean_nll"),
        metrics=("moe", "mtp"),
        request_id="req-1",
    )
    assert result.request_id == "req-1"
    assert len(result) == 3 and result.lengths.tolist() == [5, 3, 7]
    check_scores(result, SEQS, top_k=3, temperature=2.0, masks=masks)
    for i, seq in enumerate(SEQS):
        assert result.logprobs[i].dtype == np.float32
        assert result.top_k_ids[i].shape == (len(seq), 3)
    assert result.loss["nll"].dtype == np.float64
    assert result.num_tokens.tolist() == [3, 2, 4]
    np.testing.assert_allclose(result.loss["mean_nll"], result.loss["nll"] / [3, 2, 4])
    assert result.weights_version == "v0"
    assert result.timings.compute_ms == 2.0 and result.timings.num_requests == 1
    assert result.timings.client_ms > 0
    sent = server.scorer.requests[-1]
    assert sent["request_id"] == "req-1" and sent["has_temperature"]
    assert sent["options"].temperature == 2.0 and sent["options"].top_k == 3
    assert sent["options"].return_moe_metrics and sent["options"].return_mtp_metrics
    assert list(sent["options"].losses) == ["nll", "mean_nll"]
    assert sent["id_dtype"] == pb.DTYPE_INT32
    assert result.mean_nll_per_token() == pytest.approx(result.loss["nll"].sum() / 9)


def test_defaults_and_no_logprobs(server, client):
    result = client.score(SEQS)
    assert result.top_k == 0 and result.top_k_ids is None and result.moe_metrics == {}
    assert set(result.loss) == {"nll"} and len(result.request_id) == 16
    assert server.scorer.requests[-1]["options"].return_logprobs
    result = client.score(SEQS, return_logprobs=False, losses=())
    assert result.logprobs is None and result.loss == {}
    assert not server.scorer.requests[-1]["options"].return_logprobs
    # Results are writable, independent arrays.
    result = client.score(SEQS)
    result.logprobs[0][1] = 5.0
    assert result.logprobs[1][0] == 0.0


class _DuckTensor:
    """Array-like exposing only ``tolist`` (no ``__array__``)."""

    def __init__(self, values):
        self._values = values

    def tolist(self):
        return list(self._values)


class _GpuLikeTensor:
    """Mimics a torch tensor on a device: must be detached and moved to CPU first."""

    def __init__(self, values, on_cpu=False):
        self._values, self.on_cpu = values, on_cpu

    def detach(self):
        return self

    def cpu(self):
        return _GpuLikeTensor(self._values, on_cpu=True)

    def __array__(self, dtype=None, copy=None):
        if not self.on_cpu:
            raise TypeError("can't convert cuda tensor to numpy")
        return np.asarray(self._values, dtype=dtype)


def test_input_forms(client):
    expected = [ref_logprobs(s) for s in SEQS]
    forms = [
        [np.array(s, dtype=np.int64) for s in SEQS],
        [np.array(s, dtype=np.uint16) for s in SEQS],
        [_DuckTensor(s) for s in SEQS],
        [_GpuLikeTensor(s) for s in SEQS],
        tuple(tuple(s) for s in SEQS),
    ]
    for form in forms:
        result = client.score(form)
        for got, want in zip(result.logprobs, expected, strict=True):
            np.testing.assert_array_equal(got, want)
    padded = np.zeros((3, 9), dtype=np.int32)
    mask = np.zeros((3, 9), dtype=bool)
    for i, s in enumerate(SEQS):
        padded[i, : len(s)] = s
        mask[i, 1 : len(s)] = True
    result = client.score(padded, lengths=[5, 3, 7], loss_mask=mask)
    assert result.lengths.tolist() == [5, 3, 7]
    np.testing.assert_array_equal(result.logprobs[2], expected[2])
    np.testing.assert_allclose(result.loss["nll"], [ref_nll(s) for s in SEQS])
    rect = client.score(np.array([[1, 2, 3], [4, 5, 6]]))
    assert rect.lengths.tolist() == [3, 3]


def test_torch_tensors_without_torch_in_the_client(client):
    torch = pytest.importorskip("torch")
    batch = [torch.tensor(s) for s in SEQS]
    masks = [torch.ones(len(s), dtype=torch.bool) for s in SEQS]
    result = client.score(batch, loss_mask=masks)
    np.testing.assert_array_equal(result.logprobs[2], ref_logprobs(SEQS[2]))
    padded = torch.zeros(2, 4, dtype=torch.long)
    padded[0, :3] = torch.tensor([1, 2, 3])
    padded[1] = torch.tensor([4, 5, 6, 7])
    result = client.score(padded, lengths=torch.tensor([3, 4]))
    np.testing.assert_array_equal(result.logprobs[0], ref_logprobs([1, 2, 3]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(sequences=[]), "at least one"),
        (dict(sequences=[[1, 2], []]), "sequences[1]: empty"),
        (dict(sequences=[[1.5, 2.0]]), "integers"),
        (dict(sequences=[[1, 2], [3, -4]]), "sequences[1]: negative"),
        (dict(sequences=[1, 2, 3]), "1-D sequence"),
        (dict(sequences=np.arange(3)), "wrap a single sequence"),
        (dict(sequences="hello"), "token sequences"),
        (dict(sequences=[[1, 2]], loss_mask=[[1]]), "loss_mask[0]: length 1"),
        (dict(sequences=[[1, 2]], loss_mask=[[1, 2]]), "0/1"),
        (dict(sequences=[[1, 2]], lengths=[2]), "2-D array"),
        (dict(sequences=np.ones((2, 3), dtype=int), lengths=[2, 4]), "exceeds"),
        (dict(sequences=[[1, 2]], temperature=0.0), "temperature"),
        (dict(sequences=[[1, 2]], top_k=-1), "top_k"),
        (dict(sequences=[[1, 2]], metrics=("moe", "bogus")), "bogus"),
        (dict(sequences=[[1, 2]], routing=np.zeros((2, 3, 2))), "one [length, num_moe_layers"),
        (dict(sequences=[[1, 2]], routing=[]), "0 routings for 1 sequences"),
        (dict(sequences=[[1, 2]], routing=[np.zeros((3, 3, 2), int)]), "routing[0]: 3 rows"),
        (dict(sequences=[[1], [2]], routing=[[[[0, 1]]], [[[0, 1, 2]]]]), "routing[1]: (num_moe"),
        (dict(sequences=[[1, 2]], routing=[np.full((2, 3, 2), -1)]), "integers >= 0"),
        (dict(sequences=[[1, 2]], routing=[np.zeros((2, 3, 2))]), "integers >= 0"),
    ],
)
def test_invalid_input_rejected_before_sending(server, client, kwargs, message):
    sequences = kwargs.pop("sequences")
    with pytest.raises(InvalidInputError) as info:
        client.score(sequences, **kwargs)
    assert message in info.value.details
    assert isinstance(info.value, ValueError) and isinstance(info.value, ScoringError)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert server.scorer.calls["Score"] == 0


def test_server_errors_become_scoring_errors(server, client):
    with pytest.raises(ScoringError) as info:
        client.score([[1, 2], [3, VOCAB + 5]])
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "sequence 1" in info.value.details and not info.value.retryable
    with pytest.raises(ScoringError) as info:
        client.score([[1, 2]], top_k=MAX_TOP_K + 1)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    server.scorer.fail_next.append((grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"))
    with pytest.raises(ScoringError) as info:
        client.score([[1, 2]])
    assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        info.value.details == "queue full" and str(info.value) == "RESOURCE_EXHAUSTED: queue full"
    )
    err = pickle.loads(pickle.dumps(info.value))
    assert err.code is grpc.StatusCode.RESOURCE_EXHAUSTED and err.details == "queue full"
    server.scorer.delay_s = 1.0
    with pytest.raises(ScoringError) as info:
        client.score([[1, 2]], timeout=0.2)
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED


def test_bearer_token_metadata():
    with FakeServer(FakeScorer(token="s3cret")) as srv:
        with ScoringClient(srv.target, timeout=5) as anonymous:
            with pytest.raises(ScoringError) as info:
                anonymous.score(SEQS)
            assert info.value.code is grpc.StatusCode.UNAUTHENTICATED
        with ScoringClient(srv.target, token="s3cret", timeout=5) as authed:
            assert authed.score(SEQS).lengths.tolist() == [5, 3, 7]
            authed.model_info()
        assert srv.scorer.metadata[-1]["authorization"] == "Bearer s3cret"
        assert srv.scorer.metadata[-1]["user-agent"].startswith("megascore-client/")


def test_health_model_info_load_weights(server, client):
    assert client.health().serving and client.health("megascore.v1.Scorer").status == "SERVING"
    assert client.health("no.such.Service").status == "SERVICE_UNKNOWN"
    server.set_serving(False)
    status = client.health()
    assert not status.serving and status.status == "NOT_SERVING"
    server.set_serving(True)
    assert client.wait_until_serving(timeout=5).serving
    info = client.model_info()
    assert info.vocab_size == VOCAB and info.max_top_k == MAX_TOP_K
    assert info.parallel.tensor_model_parallel_size == 2 and info.loss_names == ("nll", "mean_nll")
    assert info.to_dict()["parallel"]["world_size"] == 2
    loaded = client.load_weights("hf:/ckpt/step-2", weights_version="step-2")
    assert (loaded.weights_version, loaded.previous_weights_version) == ("step-2", "v0")
    assert client.score(SEQS).weights_version == "step-2"
    with pytest.raises(ScoringError) as info:
        client.load_weights("nonsense")
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_health_of_a_stopped_server(server):
    target = server.target
    server.stop()
    with ScoringClient(target, retries=None, timeout=2) as c:
        with pytest.raises(ScoringError) as info:
            c.health()
        assert info.value.code is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(ScoringError) as info:
            c.wait_until_serving(timeout=0.6, interval=0.2)
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED


def test_health_codec_matches_grpc_health():
    for service in ("", "megascore.v1.Scorer", "x" * 300):
        expected = health_pb2.HealthCheckRequest(service=service).SerializeToString()
        assert health_codec.encode_request(service) == expected
    for name, value in health_pb2.HealthCheckResponse.ServingStatus.items():
        data = health_pb2.HealthCheckResponse(status=value).SerializeToString()
        assert health_codec.decode_response(data).status == name
    assert health_codec.decode_response(b"\x12\x02hi\x08\x01").serving  # unknown field skipped
    with pytest.raises(ScoringError):
        health_codec.decode_response(b"\x08")


def test_round_robin_spreads_calls_over_addresses():
    with FakeServer() as a, FakeServer() as b:
        target = f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}"
        with ScoringClient(target, load_balancing="round_robin", max_request_tokens=None) as c:
            for _ in range(10):
                c.score(SEQS)
        assert a.scorer.calls["Score"] >= 3 and b.scorer.calls["Score"] >= 3


def test_channel_settings():
    settings = ChannelSettings.build(
        "h:1", tls=None, retries=RetryPolicy(max_attempts=3), load_balancing="round_robin"
    )
    options = dict(settings.options())
    assert options["grpc.max_receive_message_length"] == 256 * 1024 * 1024
    assert options["grpc.enable_retries"] == 1 and options["grpc.keepalive_time_ms"] == 300000
    assert options["grpc.per_rpc_retry_buffer_size"] > 256 * 1024 * 1024
    config = settings.service_config()
    retry = config["methodConfig"][0]["retryPolicy"]
    assert retry["retryableStatusCodes"] == ["UNAVAILABLE", "CANCELLED"]
    assert retry["maxAttempts"] == 3
    retried = {n.get("method", "*") for n in config["methodConfig"][0]["name"]}
    assert retried == {"Score", "GetModelInfo", "*"}  # "*": all of Health; not ScoreStream
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    off = dict(ChannelSettings.build("h:1", tls=None, retries=0, keepalive_time_s=None).options())
    assert off["grpc.enable_retries"] == 0 and "grpc.keepalive_time_ms" not in off
    assert "grpc.service_config" not in off
    assert ChannelSettings.build("h:1", tls=None, retries=2).retries.max_attempts == 3
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=9)
    with pytest.raises(ValueError):
        ChannelSettings.build("h:1", tls=None, retries=True, load_balancing="random")


def test_no_groups_to_a_server_that_does_not_take_them(server, client):
    """A server whose ModelInfo lacks ``accepts_sequence_groups`` (this fake, a server
    from before groups) gets every sequence whole, shared prompt or not."""
    prompt = list(range(1, 41))
    seqs = [prompt + [5, 6], prompt + [7], prompt + [8, 9, 10]]
    result = client.score(seqs, top_k=2)
    check_scores(result, seqs, top_k=2, metrics=False)
    assert not client.model_info().accepts_sequence_groups
    sent = server.scorer.requests[-1]
    assert sent["num_tokens"] == sum(len(s) for s in seqs)


def test_only_reading_calls_are_retried(server, client):
    """gRPC retries a Score that got UNAVAILABLE; a LoadWeights that got it is not re-sent
    (it changes the served weights: the caller decides)."""
    client.score([[1, 2]])  # the client's first call also asks for the model info
    server.scorer.fail_next.append((grpc.StatusCode.UNAVAILABLE, "restarting"))
    before = server.scorer.calls["Score"]
    assert client.score([[1, 2, 3]]).lengths.tolist() == [3]
    assert server.scorer.calls["Score"] == before + 2
    server.scorer.fail_next.append((grpc.StatusCode.UNAVAILABLE, "restarting"))
    before = server.scorer.calls["LoadWeights"]
    with pytest.raises(ScoringError) as info:
        client.load_weights("hf:/ckpt")
    assert info.value.code is grpc.StatusCode.UNAVAILABLE
    assert server.scorer.calls["LoadWeights"] == before + 1
