"""Hot reload (LoadWeights) through the real engine and servicer, one gloo rank, CPU.

* A checkpoint of another architecture is refused from its ``config.json`` alone:
  FAILED_PRECONDITION naming the differing field, no checkpoint resolved, no weight file
  opened (the checkpoint here has none), the served model untouched.
* Expected load failures (bad path, other architecture, a checkpoint without its
  weights) are logged as one line without a traceback; an unexpected exception
  keeps its traceback in the log.
"""

from __future__ import annotations

import json
import logging

import grpc
import pytest

from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine
from megascore.engine.weights import served_model
from megascore.v1 import scoring_pb2 as pb
from tests.one_rank import one_rank_world
from tests.service.harness import serving


def _llama_config(intermediate_size: int) -> dict:
    """config.json of a llama with ``tiny``'s shape but for the MLP width."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": intermediate_size,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": 512,
    }


@pytest.fixture(scope="module")
def server():
    with one_rank_world():
        engine = DistributedEngine.create(
            EngineConfig(model="tiny", device="cpu", collective_timeout_s=60)
        )
        yield from serving(engine, max_batch_wait_ms=1)  # stopping shuts the engine down


def _load(server, model: str) -> grpc.RpcError | pb.LoadWeightsResponse:
    try:
        return server.stub().LoadWeights(pb.LoadWeightsRequest(model=model), timeout=120)
    except grpc.RpcError as exc:
        return exc


def _load_failure_logs(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_other_architecture_refused_from_its_config_alone(server, tmp_path, monkeypatch, caplog):
    other = tmp_path / "other-llama"
    other.mkdir()  # config.json only: refusing it must not need any weight file
    (other / "config.json").write_text(json.dumps(_llama_config(intermediate_size=96)))
    served = server.engine.loaded

    def no_resolve(*args, **kwargs):
        raise AssertionError("a checkpoint of another architecture was resolved")

    monkeypatch.setattr(served_model, "resolve_model", no_resolve)
    with caplog.at_level(logging.INFO):
        error = _load(server, f"hf:{other}")
    assert isinstance(error, grpc.RpcError), error
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    details = error.details()
    assert "architecture differs from the served model" in details, details
    assert "ffn_hidden_size: 96 != 128" in details, details
    assert "still serving weights 'builtin:tiny@1234'" in details, details
    assert server.engine.loaded is served  # the served model untouched
    warnings = _load_failure_logs(caplog)
    assert len(warnings) == 1 and warnings[0].exc_info is None, warnings
    assert "ffn_hidden_size: 96 != 128" in warnings[0].getMessage()


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda tmp_path: tmp_path / "missing", "is not a directory"),
        # Right architecture, no weights: fails on the RELOAD path of every rank.
        (lambda tmp_path: _config_only(tmp_path / "no-weights", 128), "no safetensors weights"),
    ],
    ids=["bad-path", "no-weights"],
)
def test_expected_load_errors_are_one_line_without_traceback(
    server, tmp_path, caplog, make, reason
):
    served = server.engine.loaded
    with caplog.at_level(logging.INFO):
        error = _load(server, f"hf:{make(tmp_path)}")
    assert isinstance(error, grpc.RpcError), error
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert reason in error.details()
    assert server.engine.loaded is served
    warnings = _load_failure_logs(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].exc_info is None and reason in warnings[0].getMessage()


def test_unexpected_load_error_keeps_its_traceback(server, monkeypatch, caplog):
    def broken_resolve(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(served_model, "resolve_model", broken_resolve)
    with caplog.at_level(logging.INFO):
        error = _load(server, "builtin:tiny@7")
    assert isinstance(error, grpc.RpcError), error
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "disk on fire" in error.details()
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert tracebacks and "disk on fire" in str(tracebacks[0].exc_info[1])


def test_same_architecture_reloads(server):
    response = _load(server, "builtin:tiny@7")
    assert isinstance(response, pb.LoadWeightsResponse), response
    assert response.weights_version == "builtin:tiny@7"
    back = _load(server, "tiny@1234")
    assert isinstance(back, pb.LoadWeightsResponse), back
    assert back.weights_version == "builtin:tiny@1234"


def _config_only(directory, intermediate_size: int):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(_llama_config(intermediate_size)))
    return directory


def test_other_max_length_refused(server, tmp_path):
    # The server's request limits come from the served max length: a reload must keep it.
    longer = tmp_path / "longer-llama"
    longer.mkdir()
    cfg = _llama_config(intermediate_size=128) | {"max_position_embeddings": 2048}
    (longer / "config.json").write_text(json.dumps(cfg))
    served = server.engine.loaded
    error = _load(server, f"hf:{longer}")
    assert isinstance(error, grpc.RpcError), error
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "max_position_embeddings: 2048 != 1024" in error.details(), error.details()
    assert server.engine.loaded is served
