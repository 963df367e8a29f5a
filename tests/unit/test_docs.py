"""Every shell and Python block of README.md and docs/*.md parses as written.

Shell blocks: ``bash -n`` accepts them, no ``\\`` continuation is cut by a comment
(the TLS + token snippet once started the server with authentication off), and every
``megascore`` subcommand and flag they use exists in the CLI's parsers. Python
blocks compile, and the keywords they pass to SDK methods exist on those methods.
Every block not marked ``# not run by the docs test: REASON`` runs against served
models in ``tests/e2e/test_docs_runnable.py``. Each doc says once that its commands assume the
activated virtual environment, and each example says which extra it needs.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import tomllib

import pytest

from megascore_client import cli
from megascore_server.config_loader import build_parser as serve_parser
from tests.docs_blocks import (
    DOCS,
    ROOT,
    blocks,
    broken_continuations,
    commands,
    megascore_args,
    parse_python,
    sdk_signatures,
    unknown_flags,
    unknown_keywords,
)

BLOCKS = blocks()
SHELL_BLOCKS = [b for b in BLOCKS if b.lang == "shell"]
PYTHON_BLOCKS = [b for b in BLOCKS if b.lang == "python"]
VENV_SENTENCE = "assume the virtual environment is active"


def _subparsers():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return {**sub.choices, "serve": serve_parser()}


def test_blocks_were_found():
    assert len(SHELL_BLOCKS) > 10 and len(PYTHON_BLOCKS) > 10
    assert any(b.runnable for b in BLOCKS)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.where)
def test_shell_block_parses_as_complete_commands(block):
    proc = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
    assert proc.returncode == 0, f"{block.where}: {proc.stderr}"
    assert broken_continuations(block.text) == [], block.where


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.where)
def test_shell_block_uses_existing_megascore_commands_and_flags(block):
    parsers = _subparsers()
    for argv in commands(block.text):
        found = megascore_args(argv)
        if found is None:
            continue
        command, args = found
        assert command in parsers, f"{block.where}: no subcommand megascore {command}"
        assert unknown_flags(parsers[command], args) == [], f"{block.where}: {' '.join(argv)}"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.where)
def test_python_block_compiles_and_passes_existing_keywords(block):
    try:
        parse_python(block.text)
    except SyntaxError as exc:
        pytest.fail(f"{block.where}: {exc}")
    assert unknown_keywords(block.text, sdk_signatures()) == [], block.where


@pytest.mark.parametrize(
    "text",
    [
        "megascore serve --tls-cert a \\\n  --x y   # comment\n  --auth-token-file t\n",
        "megascore serve --tls-cert a \\\n  # comment\n  --auth-token-file t\n",
        "megascore serve --tls-cert a \\  # comment\n  --auth-token-file t\n",
    ],
)
def test_a_comment_that_cuts_a_continuation_is_caught(text):
    assert broken_continuations(text)


def test_unknown_flags_and_keywords_are_caught():
    parsers = _subparsers()
    command, args = megascore_args(["megascore", "serve", "--modle", "tiny", "--tp", "2"])
    assert unknown_flags(parsers[command], args) == ["--modle"]
    code = "client.score_padded(ids, lengths, top_k=3)\nScoringClient('x', tokn='t')\n"
    assert len(unknown_keywords(code, sdk_signatures())) == 2


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_each_doc_with_commands_states_the_venv_convention(doc):
    """One convention: commands assume the activated venv, said once per doc; no
    ``.venv/bin/`` prefixes in its blocks."""
    mine = [b for b in SHELL_BLOCKS + PYTHON_BLOCKS if b.path == doc]
    runs = [
        b
        for b in mine
        if b.lang == "shell"
        and re.search(r"^\s*(\S*/)?(megascore|python|torchrun)\b", b.text, re.M)
    ]
    if not runs:
        return
    text = " ".join(doc.read_text().split())
    assert text.count(VENV_SENTENCE) == 1, f"{doc.name}: say once that {VENV_SENTENCE}"
    assert not [b.where for b in mine if ".venv/bin/" in b.text]


def test_each_example_names_the_extra_it_needs():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for example in sorted((ROOT / "examples").glob("*.py")):
        doc = ast.get_docstring(ast.parse(example.read_text())) or ""
        match = re.search(r"Needs: pip install 'megascore(?:\[([\w,]+)\])?'", doc)
        assert match, f"{example.name}: its docstring must say 'Needs: pip install ...'"
        assert set((match[1] or "").split(",")) - {""} <= set(extras), example.name
        assert VENV_SENTENCE in " ".join(doc.split()), example.name


def torchrun_world_size(argv: list[str]) -> int:
    """The ranks of a one-node ``torchrun`` command line (``--nproc-per-node N``)."""
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name.replace("_", "-") == "--nproc-per-node":
            return int(value or argv[i + 1])
    return 1


def test_documented_serve_layouts_pass_the_preflight_checks():
    """Every documented ``megascore serve`` (or ``torchrun ... -m megascore_server.main``)
    of a built-in model names a layout that fits its ranks and the model (the device
    check aside: docs show GPU commands)."""
    import dataclasses

    from megascore.model.config import BUILTIN_MODELS
    from megascore_server.config_loader import load_serve_config
    from megascore_server.preflight import check_before_launch

    checked = 0
    for block in SHELL_BLOCKS:
        for argv in commands(block.text):
            found = megascore_args(argv)
            if found is None or found[0] != "serve" or argv[0] == "...":
                continue
            config = load_serve_config(found[1], environ={})
            if config.engine.model.split("@")[0] not in BUILTIN_MODELS:
                continue
            config = dataclasses.replace(
                config, engine=dataclasses.replace(config.engine, device="cpu")
            )
            under_torchrun = any(a.rsplit("/", 1)[-1] == "torchrun" for a in argv)
            world = torchrun_world_size(argv) if under_torchrun else config.nproc
            check_before_launch(config, world, torchrun=under_torchrun)
            checked += 1
    assert checked >= 4
