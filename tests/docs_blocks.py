"""The code blocks of README.md, server/README.md and docs/*.md, and what is checked of each.

A block is a fenced ```bash / ```sh / ```console / ```shell / ```python block. Every
block is run by ``tests/e2e/test_docs_runnable.py`` unless it is marked not runnable,
and ``tests/unit/test_docs.py`` checks that each parses. A doc added to ``docs/`` is
picked up as it is: its blocks run, or carry the marker.

* **Not runnable**: the block's first line is ``# not run by the docs test: REASON``
  (visible to the reader; the reason says why: a GPU, Kubernetes, another host, hours).
  The docs test counts these and prints the count with the reasons.
* **Options**: an HTML comment on the line before the fence,
  ``<!-- docs-test: OPTION ... -->``:

  - ``server=tiny`` (default), ``server=tiny-moe``, ``server=hf`` (a tiny
    transformers-saved Llama with its own tokenizer, served with ``--http-port``: the
    default of a block naming an address of :data:`HTTP_TARGETS`), ``server=none``.
  - ``recipe=NAME``: the blocks of one recipe run as one test, in doc order, in one
    temporary directory, against no fixture server (they start their own); the port
    ``50051`` in them becomes a free port; background jobs are killed after it.
  - ``run``: the defaults, said explicitly.

* **Placeholders**, filled by the test: :data:`DEFAULT_TARGET` (``127.0.0.1:50051``)
  becomes the served address, :data:`HTTP_TARGETS` (``127.0.0.1:8000``,
``localhost:8000``) its HTTP front, :data:`HF_DIR`
  (``/ckpt/tiny-llama``) the served ``hf:`` checkpoint directory.

Shell blocks run under ``bash -euo pipefail``, Python blocks as a script (a top-level
``await`` runs in an event loop, as in the asyncio REPL), each in a temporary
directory holding a link to ``examples/``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "server" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "console", "shell")
DEFAULT_TARGET = "127.0.0.1:50051"
HTTP_TARGET = "127.0.0.1:8000"
HTTP_TARGETS = (HTTP_TARGET, "localhost:8000")
HF_DIR = "/ckpt/tiny-llama"
SERVERS = ("tiny", "tiny-moe", "hf", "none")
_FENCE = re.compile(r"^```(\w*)\s*$")
_OPTIONS = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->$")
_NOT_RUN = re.compile(r"^#\s*not run by the docs test:\s*(\S.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    options: tuple[tuple[str, str], ...] = ()

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def not_run(self) -> str | None:
        """The reason of a block marked not runnable (its first line), else None."""
        first = next((line.strip() for line in self.text.splitlines() if line.strip()), "")
        match = _NOT_RUN.match(first)
        return match[1].strip() if match else None

    @property
    def runnable(self) -> bool:
        return self.not_run is None

    def option(self, name: str, default: str = "") -> str:
        return dict(self.options).get(name, default)

    @property
    def server(self) -> str:
        """The fixture server the block runs against (``none`` for a recipe)."""
        if self.option("recipe"):
            return "none"
        return self.option("server", "hf" if self.uses_http else "tiny")

    @property
    def uses_http(self) -> bool:
        """Whether the block talks to the HTTP front (an address of :data:`HTTP_TARGETS`)."""
        return any(target in self.text for target in HTTP_TARGETS)


def parse_options(text: str) -> tuple[tuple[str, str], ...]:
    """``server=hf recipe=tls run`` -> ``(("server", "hf"), ("recipe", "tls"), ("run", ""))``.

    Raises:
        ValueError: an unknown option or server.
    """
    out = []
    for word in text.split():
        name, _, value = word.partition("=")
        if name not in ("server", "recipe", "run") or (name == "server" and value not in SERVERS):
            raise ValueError(f"unknown docs-test option {word!r}")
        out.append((name, value))
    return tuple(out)


def blocks(paths=DOCS) -> list[Block]:
    """Every shell and Python block of ``paths``."""
    out = []
    for path in paths:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            match = _FENCE.match(lines[i])
            if not match:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            lang = match[1].lower()
            marker = _OPTIONS.match(lines[i - 1].strip()) if i > 0 else None
            options = parse_options(marker[1]) if marker else ()
            if lang in SHELL or lang == "python":
                kind = "python" if lang == "python" else "shell"
                text = "\n".join(lines[i + 1 : end]) + "\n"
                out.append(Block(path, i + 1, kind, text, options))
            i = end + 1
    return out


def broken_continuations(text: str) -> list[str]:
    """Lines where a ``\\`` continuation is cut: a comment or blank line right after a
    ``\\``, a ``\\`` followed by a comment, or a line that starts with a flag while the
    line before it did not continue (the flag then starts a new command)."""
    problems = []
    lines = text.splitlines()
    for n, line in enumerate(lines):
        stripped = line.strip()
        previous = lines[n - 1].rstrip() if n else ""
        if re.search(r"\\\s+#", line):
            problems.append(f"line {n + 1}: comment after a '\\' ends the command: {line!r}")
        if previous.endswith("\\") and (not stripped or stripped.startswith("#")):
            problems.append(f"line {n + 1}: the '\\' above continues into a comment or blank line")
        if stripped.startswith("-") and line[:1].isspace() and not previous.endswith("\\"):
            problems.append(f"line {n + 1}: flags on a line the one above does not continue")
    return problems


def commands(text: str) -> list[list[str]]:
    """The shell commands of a block as argv lists (continuations joined, comments,
    pipes and ``&&`` split, redirections dropped, ``[...]`` optional groups opened)."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        argv: list[str] = []
        redirect = False  # the token after a ``>`` is its file
        for token in tokens + [";"]:
            if redirect:
                redirect = False
            elif token in (";", "|", "&&", "||", "&"):
                if argv:
                    out.append(argv)
                argv = []
            elif re.fullmatch(r"\d*(>>?|<)", token) or token == "&>":
                redirect = True
            elif not re.fullmatch(r"\d*>&\d+", token):
                argv.append(token.strip("[]"))
    return out


def megascore_args(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(subcommand, args)`` of a ``megascore ...`` / ``python -m megascore_server.main``
    / ``torchrun ... -m megascore_server.main`` command, of ``docker run ... megascore:TAG
    ARGS`` (the image's entry point is ``megascore serve``) and of a ``... ARGS`` line
    (more flags for the server of the line before), else None."""
    argv = [a for a in argv if "=" not in a or a.startswith("-")]  # drop VAR=value prefixes
    if not argv:
        return None
    if Path(argv[0]).name == "megascore" and len(argv) > 1:
        return argv[1], argv[2:]
    if argv[0] == "...":
        return "serve", argv[1:]
    if argv[0] == "docker" and "run" in argv:
        image = next((i for i, a in enumerate(argv) if re.fullmatch(r"megascore:[\w.-]+", a)), None)
        if image is not None:
            return "serve", argv[image + 1 :]
    if "-m" in argv:
        at = len(argv) - 1 - argv[::-1].index("-m")  # the last: ``main torchrun ... -m main``
        if at + 1 < len(argv) and argv[at + 1] == "megascore_server.main":
            return "serve", argv[at + 2 :]
    return None


def unknown_flags(parser, args: list[str]) -> list[str]:
    """The ``--flags`` of ``args`` that ``parser`` does not define."""
    known = {s for action in parser._actions for s in action.option_strings}
    flags = (a.split("=", 1)[0] for a in args if a.startswith("--"))
    return [f for f in flags if f not in known and f != "--"]


def sdk_signatures() -> dict[str, list[inspect.Signature]]:
    """Public callables of the SDK by name: the client classes' methods and the
    constructors ``megascore_client`` exports."""
    import megascore_client
    from megascore_client.stream import AsyncScoreStream, ScoreStream

    out: dict[str, list[inspect.Signature]] = {}
    classes = [megascore_client.ScoringClient, megascore_client.AsyncScoringClient]
    for cls in [*classes, ScoreStream, AsyncScoreStream]:
        for name, member in inspect.getmembers(cls, callable):
            if not name.startswith("_"):
                out.setdefault(name, []).append(inspect.signature(member))
    for name in megascore_client.__all__:
        obj = getattr(megascore_client, name)
        if inspect.isclass(obj):
            out.setdefault(name, []).append(inspect.signature(obj))
    return out


def unknown_keywords(text: str, signatures: dict[str, list[inspect.Signature]]) -> list[str]:
    """``name(kw=...)`` calls of SDK callables whose keyword no signature of that name has."""
    problems = []
    for node in ast.walk(parse_python(text)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name not in signatures:
            continue
        for keyword in node.keywords:
            if keyword.arg is None:
                continue
            if not any(_accepts(sig, keyword.arg) for sig in signatures[name]):
                problems.append(f"line {node.lineno}: {name}() has no keyword {keyword.arg!r}")
    return problems


def _accepts(signature: inspect.Signature, keyword: str) -> bool:
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    param = params.get(keyword)
    return param is not None and param.kind is not inspect.Parameter.POSITIONAL_ONLY


def parse_python(text: str) -> ast.Module:
    """Compiles a Python block (top-level ``await`` allowed, as in an asyncio REPL)."""
    flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    return compile(text, "<doc block>", "exec", flags=flags, dont_inherit=True)
