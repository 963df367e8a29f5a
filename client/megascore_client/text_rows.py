"""The tokenizer of ``megascore score``: which one turns ``{"text": ...}`` rows into ids
and, with ``--echo-tokens``, ids into token strings.

``--tokenizer DIR`` (a local Hugging Face tokenizer directory: ``transformers`` when
installed, else ``tokenizers`` with ``DIR/tokenizer.json``) wins; without it, the
server's own tokenizer (``ModelInfo.has_tokenizer``: ``megascore serve --tokenizer
DIR`` or an ``hf:DIR`` checkpoint's) through ``Scorer.Tokenize`` / ``Detokenize``. The
run says on stderr which one it used, the first time it needs one.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["RowTokenizer", "choose_tokenizer"]


def _load_local(path: str, add_special_tokens: bool):
    """``(encode(text) -> ids, token(id) -> str)`` of a local tokenizer directory."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        AutoTokenizer = None  # noqa: N806
    if AutoTokenizer is not None:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return (
            lambda text: tok(text, add_special_tokens=add_special_tokens)["input_ids"],
            lambda i: tok.decode([i], skip_special_tokens=False),
        )
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SystemExit("--tokenizer needs 'transformers' or 'tokenizers' installed") from None
    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    return (
        lambda text: tok.encode(text, add_special_tokens=add_special_tokens).ids,
        lambda i: tok.decode([i], skip_special_tokens=False),
    )


class RowTokenizer:
    """Tokenizes rows and names tokens with one tokenizer, loaded at its first use.

    Args:
        source: ``"local"`` (``--tokenizer DIR``), ``"server"`` or ``"none"``.
        describe: how the stderr note names it.
        load: returns ``(encode, token_strings)`` for local / server.
        note: where the "which tokenizer" note goes (``print`` to stderr by default).
    """

    def __init__(self, source: str, describe: str, load=None, note: Callable | None = None):
        self.source = source
        self.describe = describe
        self._load = load
        self._loaded = None
        self._lock = threading.Lock()  # rows are read here, tokens named in scoring threads
        self._note = note or (lambda text: print(text, file=sys.stderr, flush=True))

    def _get(self):
        with self._lock:
            if self._loaded is None:
                self._loaded = self._load()
                self._note(f"megascore score: tokenizer: {self.describe}")
            return self._loaded

    @property
    def available(self) -> bool:
        return self.source != "none"

    def encode(self, text: str) -> list[int]:
        """The ids of one ``text`` row."""
        return list(self._get()[0](text))

    def token_strings(self, rows: list[list[int]]) -> list[list[str]] | None:
        """Each id's string, per row (None without a tokenizer)."""
        if not self.available:
            return None
        return self._get()[1](rows)


def choose_tokenizer(args, client, info) -> RowTokenizer:
    """The tokenizer of a ``megascore score`` run: ``--tokenizer DIR``, else the
    server's when ``info.has_tokenizer``, else none (``text`` rows are then bad rows)."""
    add = args.add_special_tokens
    if args.tokenizer:

        def local():
            encode, token = _load_local(args.tokenizer, add)
            return encode, lambda rows: [[token(int(i)) for i in row] for row in rows]

        return RowTokenizer("local", f"local, from {args.tokenizer} (--tokenizer)", local)
    if info.has_tokenizer:

        def server():
            def encode(text: str) -> list[int]:
                return client.tokenize([text], add_special_tokens=add)[0].tolist()

            return encode, lambda rows: client.detokenize(rows).tokens

        where = f"the server's, at {client.target} (model {info.name})"
        return RowTokenizer("server", where, server)
    return RowTokenizer("none", "none")
