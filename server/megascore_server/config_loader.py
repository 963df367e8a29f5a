"""Builds a :class:`ReplicaConfig` from CLI flags, a YAML / TOML file and the environment.

Precedence, lowest to highest: dataclass defaults < config file (``--config``
or ``MEGASCORE_CONFIG``) < environment variables ``MEGASCORE_<FIELD>`` <
command-line flags. Every field of :class:`GrpcServerConfig` and
:class:`megascore.config.EngineConfig` (and ``nproc``) can be set at every
level under the same name: ``--max-tokens-per-batch 8192``,
``MEGASCORE_MAX_TOKENS_PER_BATCH=8192``, ``max_tokens_per_batch: 8192``.

A config file is a mapping; fields go either at the top level or under a
``server:`` / ``engine:`` section (``[server]`` / ``[engine]`` tables in TOML):

.. code-block:: yaml

    nproc: 2
    server: {port: 50051, max_tokens_per_batch: 8192}
    engine: {model: tiny, tensor_model_parallel_size: 2}

Unknown keys and values of the wrong type raise ``ValueError`` naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megascore.config import EngineConfig
from megascore_server.config import GrpcServerConfig, ReplicaConfig

logger = logging.getLogger(__name__)

ENV_PREFIX = "MEGASCORE_"
CONFIG_ENV = "MEGASCORE_CONFIG"

_SERVER_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(GrpcServerConfig)}
_ENGINE_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
_TOP_FIELDS = {"nproc": "int"}
_ALL_FIELDS = {**_SERVER_FIELDS, **_ENGINE_FIELDS, **_TOP_FIELDS}
_ALIASES = {
    "tensor_model_parallel_size": ["--tp"],
    "context_parallel_size": ["--cp"],
    "expert_model_parallel_size": ["--ep"],
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(name: str, value: Any, type_str: str) -> Any:
    """Converts ``value`` (str from flags / env, or a YAML / TOML scalar) to the field type."""
    optional = "None" in type_str
    base = type_str.replace("| None", "").replace("None |", "").strip()
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
        if optional:
            return None
        raise ValueError(f"{name}: a value is required (got {value!r})")
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
                return value.strip().lower() in _TRUE
            raise ValueError("expected a boolean")
        if base == "int":
            if isinstance(value, bool) or isinstance(value, float):
                raise ValueError("expected an integer")
            return int(value)
        if base == "float":
            if isinstance(value, bool):
                raise ValueError("expected a number")
            return float(value)
        if base == "str":
            if not isinstance(value, str):
                raise ValueError("expected a string")
            return value
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: invalid value {value!r} ({exc})") from None
    raise ValueError(f"{name}: unsupported field type {type_str}")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Reads a YAML (``.yaml`` / ``.yml``) or TOML (``.toml``) file into flat field values.

    Args:
        path: the file.

    Returns:
        Field name -> value (not yet coerced).

    Raises:
        ValueError: unknown extension, not a mapping, unknown key or section.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".toml":
        with path.open("rb") as f:
            data = tomllib.load(f)
    elif suffix in (".yaml", ".yml"):
        import yaml

        with path.open() as f:
            data = yaml.safe_load(f) or {}
    else:
        raise ValueError(f"config file {path}: expected .yaml, .yml or .toml")
    if not isinstance(data, Mapping):
        raise ValueError(f"config file {path}: top level must be a mapping")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("server", "engine"):
            if not isinstance(value, Mapping):
                raise ValueError(f"config file {path}: section {key!r} must be a mapping")
            allowed = _SERVER_FIELDS if key == "server" else _ENGINE_FIELDS
            for sub, sub_value in value.items():
                if sub not in allowed:
                    raise ValueError(f"config file {path}: unknown key {key}.{sub}")
                flat[sub] = sub_value
        elif key in _ALL_FIELDS:
            flat[key] = value
        else:
            raise ValueError(f"config file {path}: unknown key {key!r}")
    return flat


def read_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Field values from ``MEGASCORE_<FIELD>`` variables (other variables are ignored)."""
    values = {}
    for name in _ALL_FIELDS:
        key = ENV_PREFIX + name.upper()
        if key in environ:
            values[name] = environ[key]
    return values


def build_parser() -> argparse.ArgumentParser:
    """The ``megascore serve`` argument parser: ``--config`` plus one flag per field."""
    parser = argparse.ArgumentParser(
        prog="megascore serve",
        description="Serve a Megatron-Core model over gRPC (megascore.v1.Scorer).",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="YAML or TOML config file (env: MEGASCORE_CONFIG)")
    groups = {
        "server": (parser.add_argument_group("server"), _SERVER_FIELDS),
        "engine": (parser.add_argument_group("engine"), _ENGINE_FIELDS),
        "launch": (parser.add_argument_group("launch"), _TOP_FIELDS),
    }
    docs = _field_docs()
    for group, fields in groups.values():
        for name, type_str in fields.items():
            flags = ["--" + name.replace("_", "-"), *_ALIASES.get(name, [])]
            help_text = docs.get(name, "")
            if type_str in ("bool", "bool | None"):
                group.add_argument(
                    *flags, dest=name, action=argparse.BooleanOptionalAction, help=help_text
                )
            else:
                group.add_argument(*flags, dest=name, metavar=name.upper(), help=help_text)
    return parser


def _field_docs() -> dict[str, str]:
    """First line of each field's attribute docstring, for ``--help``."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    for cls in (GrpcServerConfig, EngineConfig):
        try:
            tree = ast.parse(inspect.getsource(cls))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = nxt.value.value.strip().splitlines()[0].replace("%", "%%")
    return docs


def load_serve_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ReplicaConfig:
    """Resolves the serve configuration from flags, config file and environment.

    Args:
        argv: command-line arguments after ``serve`` (None = none).
        environ: environment (None = ``os.environ``).

    Returns:
        The validated :class:`ReplicaConfig`.

    Raises:
        ValueError: an unknown key, a value of the wrong type or a failed validation.
        SystemExit: on ``--help`` or unparseable flags (argparse).
    """
    environ = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(list(argv or [])))
    config_path = args.pop("config", None) or environ.get(CONFIG_ENV)

    values: dict[str, Any] = {}
    if config_path:
        values.update(read_config_file(config_path))
    values.update(read_env(environ))
    values.update(args)
    coerced = {name: _coerce(name, value, _ALL_FIELDS[name]) for name, value in values.items()}

    server = {k: v for k, v in coerced.items() if k in _SERVER_FIELDS}
    engine = {k: v for k, v in coerced.items() if k in _ENGINE_FIELDS}
    return ReplicaConfig(
        server=GrpcServerConfig(**server),
        engine=EngineConfig(**engine),
        nproc=coerced.get("nproc", 1),
    )
