"""Serve config: defaults, flags, YAML, TOML, environment overrides, precedence, errors."""

from __future__ import annotations

import pytest

from megascore.config import EngineConfig
from megascore_server.config import MIB, GrpcServerConfig, ReplicaConfig
from megascore_server.config_loader import load_serve_config
from megascore_server.main import main


def test_defaults():
    config = load_serve_config([], environ={})
    assert config == ReplicaConfig()
    assert config.server.host == "127.0.0.1" and config.server.port == 50051
    assert config.server.max_message_bytes == 256 * MIB and config.server.metrics_port == 0
    assert config.server.max_sequence_length is None and config.nproc == 1


def test_flags():
    config = load_serve_config(
        [
            "--port",
            "6000",
            "--host",
            "0.0.0.0",
            "--max-tokens-per-batch",
            "8192",
            "--max-batch-wait-ms",
            "1.5",
            "--max-sequence-length",
            "1024",
            "--tp",
            "2",
            "--model",
            "tiny-moe",
            "--sequence-parallel",
            "--nproc",
            "2",
            "--grace-s",
            "3",
            "--auth-token-file",
            "/run/token",
        ],
        environ={},
    )
    assert config.server.port == 6000 and config.server.host == "0.0.0.0"
    assert config.server.max_tokens_per_batch == 8192
    assert config.server.max_batch_wait_ms == 1.5 and config.server.max_sequence_length == 1024
    assert config.server.grace_s == 3.0 and config.server.auth_token_file == "/run/token"
    assert config.engine == EngineConfig(
        model="tiny-moe", tensor_model_parallel_size=2, sequence_parallel=True
    )
    assert config.nproc == 2


YAML = """
nproc: 2
max_queue: 7
server:
  port: 6001
  max_sequence_length: null
  metrics_port: 9100
engine:
  model: "hf:/ckpt"
  context_parallel_size: 2
  seed: 5
"""

TOML = """
nproc = 2
max_queue = 7

[server]
port = 6001
metrics_port = 9100

[engine]
model = "hf:/ckpt"
context_parallel_size = 2
seed = 5
"""


@pytest.mark.parametrize("suffix,text", [(".yaml", YAML), (".toml", TOML)])
def test_config_file(tmp_path, suffix, text):
    path = tmp_path / f"serve{suffix}"
    path.write_text(text)
    config = load_serve_config(["--config", str(path)], environ={})
    assert config.nproc == 2 and config.server.max_queue == 7
    assert config.server.port == 6001 and config.server.metrics_port == 9100
    assert config.engine.model == "hf:/ckpt" and config.engine.context_parallel_size == 2
    assert config.engine.seed == 5


def test_precedence_file_env_flags(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(YAML)
    env = {
        "MEGASCORE_CONFIG": str(path),
        "MEGASCORE_PORT": "7000",
        "MEGASCORE_MAX_QUEUE": "9",
        "MEGASCORE_SEQUENCE_PARALLEL": "false",
        "MEGASCORE_MAX_SEQUENCE_LENGTH": "none",
        "MEGASCORE_SEED": "11",
        "MEGASCORE_UNRELATED": "ignored",
    }
    config = load_serve_config(["--max-queue", "12"], environ=env)
    assert config.server.port == 7000  # env over file
    assert config.server.max_queue == 12  # flag over env
    assert config.server.metrics_port == 9100  # file over default
    assert config.engine.seed == 11 and config.server.max_sequence_length is None
    assert not config.engine.sequence_parallel


@pytest.mark.parametrize(
    "argv,environ,file_text,message",
    [
        (["--port", "abc"], {}, None, "port: invalid value 'abc'"),
        (["--port", "70000"], {}, None, "port must be in"),
        ([], {"MEGASCORE_SEQUENCE_PARALLEL": "maybe"}, None, "sequence_parallel"),
        ([], {"MEGASCORE_MAX_TOKENS_PER_BATCH": "0"}, None, "max_tokens_per_batch must be >= 1"),
        (["--nproc", "0"], {}, None, "nproc must be >= 1"),
        (["--max-batch-wait-ms", "-1"], {}, None, "max_batch_wait_ms"),
        (["--tp", "0"], {}, None, "tensor_model_parallel_size must be >= 1"),
        ([], {"MEGASCORE_DTYPE": "int8"}, None, "dtype must be one of"),  # a flag: argparse
        (["--tls-cert", "c.pem"], {}, None, "given together"),
        (["--max-queue-tokens", "10"], {}, None, "max_queue_tokens"),
        (["--log-level", "LOUD"], {}, None, "log_level"),
        ([], {}, "bogus_key: 1\n", "unknown key 'bogus_key'"),
        ([], {}, "server:\n  model: x\n", "unknown key server.model"),
        ([], {}, "port: [1, 2]\n", "port: invalid value"),
        ([], {}, "- 1\n- 2\n", "must be a mapping"),
        ([], {}, "host: 5\n", "host: invalid value 5"),
    ],
)
def test_invalid_values(tmp_path, argv, environ, file_text, message):
    if file_text is not None:
        path = tmp_path / "bad.yaml"
        path.write_text(file_text)
        argv = [*argv, "--config", str(path)]
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        load_serve_config(argv, environ=environ)


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "serve.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match=r"expected \.yaml"):
        load_serve_config(["--config", str(path)], environ={})


def test_round_trip_dict():
    config = ReplicaConfig(
        server=GrpcServerConfig(port=0, max_sequence_length=128),
        engine=EngineConfig(model="tiny", seed=3),
        nproc=3,
    )
    assert ReplicaConfig.from_dict(config.to_dict()) == config


def test_main_reports_invalid_config(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["--port", "nope"]) == 2
    assert "port: invalid value 'nope'" in capsys.readouterr().err


def test_help_lists_fields(capsys):
    with pytest.raises(SystemExit) as info:
        load_serve_config(["--help"], environ={})
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--max-tokens-per-batch",
        "--tensor-model-parallel-size",
        "--tp",
        "--nproc",
        "--config",
        "--no-sequence-parallel",
    ):
        assert flag in out
    assert "Budget of one engine step: its padded rows" in out


@pytest.mark.parametrize(
    "kw,expected",
    [
        ({}, 1),
        ({"pad_to_multiple_of": 8}, 8),
        ({"context_parallel_size": 2}, 4),
        ({"context_parallel_size": 2, "pad_to_multiple_of": 3}, 12),
        ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, 2),
        (
            {
                "tensor_model_parallel_size": 2,
                "context_parallel_size": 2,
                "sequence_parallel": True,
            },
            4,
        ),
    ],
)
def test_pad_multiple_follows_the_engine_layout(kw, expected):
    from megascore_server.bootstrap import pad_multiple

    assert pad_multiple(object(), EngineConfig(**kw)) == expected

    class Exposed:
        pad_multiple = 16

    assert pad_multiple(Exposed(), EngineConfig(**kw)) == 16


@pytest.mark.parametrize(
    "argv,environ,expected",
    [
        ([], {}, None),  # unset: the engine decides (on for MoE at TP > 1)
        (["--sequence-parallel"], {}, True),
        (["--no-sequence-parallel"], {}, False),
        ([], {"MEGASCORE_SEQUENCE_PARALLEL": "false"}, False),
        ([], {"MEGASCORE_SEQUENCE_PARALLEL": "none"}, None),
    ],
)
def test_sequence_parallel_is_tri_state(argv, environ, expected):
    config = load_serve_config(["--tp", "2", *argv], environ=environ)
    assert config.engine.sequence_parallel is expected


def test_pipeline_flags_env_and_file(tmp_path):
    config = load_serve_config(["--pp", "2", "--pipeline-microbatches", "6"], environ={})
    assert config.engine.pipeline_model_parallel_size == 2
    assert config.engine.microbatches == 6
    env = {"MEGASCORE_PIPELINE_MODEL_PARALLEL_SIZE": "4"}
    config = load_serve_config([], environ=env)
    assert config.engine.pipeline_model_parallel_size == 4
    assert config.engine.microbatches == 8  # default: 2 x PP
    assert config.engine.model_parallel_size == 4
    path = tmp_path / "serve.yaml"
    path.write_text("engine: {pipeline_model_parallel_size: 2, tensor_model_parallel_size: 2}\n")
    config = load_serve_config(["--config", str(path)], environ={})
    assert config.engine.model_parallel_size == 4 and config.engine.microbatches == 4
    assert load_serve_config([], environ={}).engine.microbatches == 1  # PP = 1: one step
    for argv, message in (
        (["--pp", "0"], "pipeline_model_parallel_size must be >= 1"),
        (["--pipeline-microbatches", "0"], "pipeline_microbatches must be >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            load_serve_config(argv, environ={})


def test_env_short_flag_names_follow_the_flag_rule():
    """``MEGASCORE_<FLAG>`` for long and short flags alike."""
    env = {"MEGASCORE_TP": "2", "MEGASCORE_EP": "2", "MEGASCORE_CP": "1", "MEGASCORE_PP": "1"}
    config = load_serve_config(["--nproc", "4"], environ=env)
    assert config.engine.tensor_model_parallel_size == 2
    assert config.engine.expert_model_parallel_size == 2
    long_names = {"MEGASCORE_TENSOR_MODEL_PARALLEL_SIZE": "2", "MEGASCORE_TP": "2"}
    assert load_serve_config([], environ=long_names).engine.tensor_model_parallel_size == 2
    assert load_serve_config(["--tp", "4"], environ=env).engine.tensor_model_parallel_size == 4
    with pytest.raises(ValueError, match="MEGASCORE_TENSOR_MODEL_PARALLEL_SIZE='4' and "
                       "MEGASCORE_TP='2' set the same option"):  # fmt: skip
        load_serve_config([], environ={**env, "MEGASCORE_TENSOR_MODEL_PARALLEL_SIZE": "4"})


def test_every_flag_is_an_environment_variable():
    """Each flag of ``megascore serve --help`` (long and short) sets its field from
    ``MEGASCORE_<FLAG>``."""
    from megascore_server.config_loader import build_parser, read_env

    for action in build_parser()._actions:
        for flag in action.option_strings:
            if flag in ("-h", "--help", "--config") or flag.startswith("--no-"):
                continue
            key = "MEGASCORE_" + flag.lstrip("-").upper().replace("-", "_")
            assert read_env({key: "7"}) == {action.dest: "7"}, key


def test_unknown_megascore_variables_warn(caplog):
    from megascore_server.config_loader import OTHER_ENV, unknown_env

    env = {"MEGASCORE_TPP": "2", "MEGASCORE_TP": "2", "MEGASCORE_MAX_QUEUE": "3", "HOME": "/"}
    env.update(dict.fromkeys(OTHER_ENV, "x"))
    (warning,) = unknown_env(env)
    assert "MEGASCORE_TPP" in warning and "did you mean MEGASCORE_TP?" in warning


def test_serve_help_explains_every_flag():
    """Every flag has help text ending in its default, whole sentences (the docstring's
    first paragraph), no internal names; --model lists every built-in."""
    from megascore.model.config import BUILTIN_MODELS
    from megascore_server.config_loader import _ALL_FIELDS, build_parser

    parser = build_parser()
    for action in parser._actions:
        if action.dest in ("help", "config"):
            continue
        assert action.help, action.option_strings
        text, _, default = action.help.rpartition(" (default: ")
        assert default.endswith(")") and default != ")", action.help
        assert text.endswith((".", ")")), f"cut sentence: {action.help!r}"
        assert "``" not in text and "None" not in text and "build_server" not in text
        leaked = [name for name in _ALL_FIELDS if "_" in name and name in text]
        assert not leaked, (action.option_strings, leaked)
    model_help = next(a.help for a in parser._actions if a.dest == "model")
    assert all(name in model_help for name in BUILTIN_MODELS), model_help
    for dest in ("nproc", "dtype", "tensor_model_parallel_size", "max_top_k"):
        assert next(a.help for a in parser._actions if a.dest == dest)
