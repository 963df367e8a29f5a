"""Issue 4: health lifecycle, reflection and the Prometheus endpoint of the real server."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from prometheus_client.parser import text_string_to_metric_families

from megascore_client import ScoringClient, ScoringError
from tests.e2e.serve import SERVING

SCORER = "megascore.v1.Scorer"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["tp1", "tp2"])
def test_health_goes_not_serving_then_serving(request, name):
    server = request.getfixturevalue(name)
    seen = server.health_seen
    # The port answers while the ranks import torch and build the model (a 2 s check
    # may time out while rank 0's imports hold the GIL on a busy machine).
    assert "NOT_SERVING" in seen and seen[-1] == "SERVING", seen
    assert seen.index("NOT_SERVING") < seen.index("SERVING"), seen
    assert set(seen) <= {"unreachable", "NOT_SERVING", "DEADLINE_EXCEEDED", "SERVING"}, seen
    code, details = server.startup_probe
    assert code == grpc.StatusCode.UNAVAILABLE and "starting" in details, server.startup_probe
    assert server.health() == SERVING
    assert server.health(SCORER) == SERVING
    with pytest.raises(grpc.RpcError) as info:
        server.health("no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with ScoringClient(server.target, timeout=30) as client:
        assert client.health().serving and client.health(SCORER).serving


@pytest.mark.timeout(600)
def test_reflection_describes_every_service(tp1):
    with grpc.insecure_channel(tp1.target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {SCORER, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= (
            services
        )
        scorer = DescriptorPool(database).FindServiceByName(SCORER)
        methods = {m.name: m for m in scorer.methods}
        assert set(methods) == {
            "Score",
            "ScoreStream",
            "GetModelInfo",
            "LoadWeights",
            "UpdateWeights",
            "FinishWeightUpdate",
            "Tokenize",
            "Detokenize",
        }
        assert methods["Score"].input_type.full_name == "megascore.v1.ScoreRequest"
        assert methods["ScoreStream"].client_streaming and methods["ScoreStream"].server_streaming


def scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample of the metrics endpoint: (name, sorted labels) -> value."""
    samples = {}
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.mark.timeout(600)
def test_metrics_counters_move_with_requests(tp2):
    batches = [[[1, 2, 3, 4], [5, 6]], [[7] * 30], [[9, 8, 7, 6, 5, 4, 3]]]
    tokens = sum(len(s) for batch in batches for s in batch)
    with ScoringClient(tp2.target, timeout=60, retries=None) as client:
        client.model_info()  # resolves the request size limit before the first scrape
        before = scrape(tp2)
        for batch in batches:
            client.score(batch, top_k=2)
        with client.stream(timeout=60) as stream:
            results = [stream.submit(batch).result(timeout=60) for batch in batches]
        assert [len(r) for r in results] == [len(b) for b in batches]
        with pytest.raises(ScoringError):
            client.score([[1, 2, 10**6]])
        after = scrape(tp2)
    assert (
        delta(before, after, "megascore_requests_total", front="grpc", rpc="Score", code="OK") == 3
    )
    assert (
        delta(before, after, "megascore_requests_total", front="grpc", rpc="ScoreStream", code="OK")
        == 3
    )
    invalid = delta(
        before,
        after,
        "megascore_requests_total",
        front="grpc",
        rpc="Score",
        code="INVALID_ARGUMENT",
    )
    assert invalid == 1
    assert delta(before, after, "megascore_tokens_scored_total") == 2 * tokens
    assert (
        delta(before, after, "megascore_request_latency_seconds_count", front="grpc", rpc="Score")
        == 4
    )
    assert 1 <= delta(before, after, "megascore_steps_total") <= 6
    assert delta(before, after, "megascore_step_latency_seconds_count") >= 1
    assert after[("megascore_queue_depth", ())] == 0


THIRD_PARTY_NOISE = ("warnings.warn(", "UserWarning", "IS DEPRECATED", "Apex is not installed",
                     "No CUDA runtime is found", "Megatron-FSDP")  # fmt: skip


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["tp1", "tp2"])
def test_startup_log_summarises_third_party_notices(request, name):
    """The ~13 Megatron / torch start-up notices per rank are one summary line each (the
    whole log: the shared server may have served the session's other tests first)."""
    lines = request.getfixturevalue(name).log_path.read_text(errors="replace").splitlines()
    summaries = [line for line in lines if "start-up notices of Megatron" in line]
    rest = "\n".join(line for line in lines if line not in summaries)
    assert not [n for n in THIRD_PARTY_NOISE if n in rest], rest[:3000]
    ranks = 1 if name == "tp1" else 2
    assert len(summaries) == ranks and all("--log-level DEBUG shows them" in s for s in summaries)
