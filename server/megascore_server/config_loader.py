"""Builds a :class:`ReplicaConfig` from CLI flags, a YAML / TOML file and the environment.

Precedence, lowest to highest: dataclass defaults < config file (``--config``
or ``MEGASCORE_CONFIG``) < environment variables ``MEGASCORE_<FLAG>`` <
command-line flags. Every field of :class:`GrpcServerConfig` and
:class:`megascore.config.EngineConfig` (and ``nproc``) can be set at every
level under the same name: ``--max-tokens-per-batch 8192``,
``MEGASCORE_MAX_TOKENS_PER_BATCH=8192``, ``max_tokens_per_batch: 8192``.

One rule for the environment: ``MEGASCORE_`` + any flag of ``megascore serve``
without its dashes, upper case, ``-`` as ``_``; short flags too (``--tp 2`` is
``MEGASCORE_TP=2`` as well as ``MEGASCORE_TENSOR_MODEL_PARALLEL_SIZE=2``; both set
to different values is an error). A ``MEGASCORE_*`` variable that is neither a
flag nor one of :data:`OTHER_ENV` is logged as a warning (:func:`unknown_env`).

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

from megascore.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    LM_HEAD_DTYPES,
    ROUTER_DTYPES,
    WEIGHT_SET_POLICIES,
    EngineConfig,
)
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
    "pipeline_model_parallel_size": ["--pp"],
    "adapters": ["--adapter"],
}
_CHOICES = {
    "dtype": DTYPES,
    "device": DEVICES,
    "attention_backend": ATTENTION_BACKENDS,
    "lm_head_dtype": LM_HEAD_DTYPES,
    "moe_router_dtype": ROUTER_DTYPES,
    "weight_sets": WEIGHT_SET_POLICIES,
}
_METAVARS = {"int": "N", "int | None": "N", "float": "NUMBER", "str": "VALUE", "str | None": "PATH"}
_NAMED_METAVARS = {"host": "ADDRESS", "model": "MODEL", "log_level": "LEVEL"}
OTHER_ENV = (
    CONFIG_ENV,
    "MEGASCORE_TARGET",  # the client CLI's default --target
    "MEGASCORE_TOKEN",  # the client CLI's default --token
    "MEGASCORE_ENGINE_FACTORY",  # megascore_server.bootstrap (tests: a fake engine)
    "MEGASCORE_HF_LOADER",  # megascore.checkpoint.hf_bridge
    "MEGASCORE_PYTHON",  # scripts/bootstrap.sh
    "MEGASCORE_VENV",  # scripts/bootstrap.sh
)
"""``MEGASCORE_*`` variables that are not serve flags but are read elsewhere (no warning)."""
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
        if base == "tuple[str, ...]":  # a repeated flag, a list in a file, commas in env
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
                raise ValueError("expected a list of strings")
            return tuple(item.strip() for item in items if item.strip())
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


def _env_names() -> dict[str, str]:
    """``MEGASCORE_<FLAG>`` -> field, for every long and short flag."""
    names = {}
    for name in _ALL_FIELDS:
        for flag in (name, *(alias.lstrip("-") for alias in _ALIASES.get(name, []))):
            names[ENV_PREFIX + flag.upper().replace("-", "_")] = name
    return names


_ENV_NAMES = _env_names()


def read_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Field values from ``MEGASCORE_<FLAG>`` variables (long or short flag names).

    Raises:
        ValueError: two names of one field set to different values.
    """
    values: dict[str, str] = {}
    source: dict[str, str] = {}
    for key, name in _ENV_NAMES.items():
        if key not in environ:
            continue
        if name in values and values[name] != environ[key]:
            raise ValueError(
                f"{source[name]}={values[name]!r} and {key}={environ[key]!r} set the same "
                "option; keep one"
            )
        values[name], source[name] = environ[key], key
    return values


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """A warning for every ``MEGASCORE_*`` variable that no part of megascore reads,
    with the closest known name."""
    import difflib

    known = [*_ENV_NAMES, *OTHER_ENV]
    warnings = []
    for key in sorted(environ):
        if not key.startswith(ENV_PREFIX) or key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.append(
            f"environment variable {key} is not a megascore setting and is ignored{hint}; "
            "serve flags are MEGASCORE_<FLAG>, e.g. MEGASCORE_TP, MEGASCORE_MAX_QUEUE"
        )
    return warnings


def build_parser() -> argparse.ArgumentParser:
    """The ``megascore serve`` argument parser: ``--config`` plus one flag per field."""
    parser = argparse.ArgumentParser(
        prog="megascore serve",
        description="Serve a Megatron-Core model over gRPC (megascore.v1.Scorer).",
        epilog=(
            "Every flag can also be set in the environment as MEGASCORE_<FLAG> (upper case, "
            "'-' as '_', short flags too: MEGASCORE_TP=2, MEGASCORE_MAX_QUEUE=64) or in the "
            "--config file (max_queue: 64); flags win over the environment, which wins over "
            "the file."
        ),
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config", metavar="PATH", help="YAML or TOML config file (env: MEGASCORE_CONFIG)"
    )
    groups = {
        "server": (parser.add_argument_group("server"), _SERVER_FIELDS),
        "engine": (parser.add_argument_group("engine"), _ENGINE_FIELDS),
        "launch": (parser.add_argument_group("launch"), _TOP_FIELDS),
    }
    docs = _field_docs()
    for group, fields in groups.values():
        for name, type_str in fields.items():
            flags = ["--" + name.replace("_", "-"), *_ALIASES.get(name, [])]
            help_text = docs[name].replace("%", "%%")
            if type_str in ("bool", "bool | None"):
                group.add_argument(
                    *flags, dest=name, action=argparse.BooleanOptionalAction, help=help_text
                )
            elif name in _CHOICES:
                group.add_argument(*flags, dest=name, choices=_CHOICES[name], help=help_text)
            elif type_str == "tuple[str, ...]":
                group.add_argument(*flags, dest=name, action="append", help=help_text)
            else:
                metavar = _NAMED_METAVARS.get(name) or _METAVARS.get(type_str, "VALUE")
                group.add_argument(*flags, dest=name, metavar=metavar, help=help_text)
    return parser


def _field_docs() -> dict[str, str]:
    """``--help`` text of every field: the first paragraph of its attribute docstring, in
    flag names (``tls_key`` -> ``--tls-key``), then its default."""
    import ast
    import inspect
    import re

    docs: dict[str, str] = {}
    for cls in (GrpcServerConfig, EngineConfig, ReplicaConfig):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        body = ast.parse(inspect.getsource(cls)).body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id in _ALL_FIELDS
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                name = node.target.id
                paragraph = " ".join(inspect.cleandoc(nxt.value.value).split("\n\n")[0].split())
                text = re.sub(
                    r"``([a-z_]+)``",
                    lambda m: "--" + m[1].replace("_", "-") if m[1] in _ALL_FIELDS else m[1],
                    paragraph,
                ).replace("``", "")
                default = defaults[name]
                shown = (
                    "unset"
                    if default is None
                    else str(default).lower()
                    if isinstance(default, bool)
                    else default
                )
                docs[name] = f"{text} (default: {shown})"
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
