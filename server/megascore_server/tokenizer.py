"""The server's tokenizer: text in and token strings out, for every front.

``megascore serve --tokenizer DIR`` names a local Hugging Face tokenizer directory;
without it, an ``hf:DIR`` checkpoint's own tokenizer is used when the directory holds
one (built-in models have none). ``transformers.AutoTokenizer`` loads it when
installed (it knows the special tokens and the chat template), else ``tokenizers``
reads ``DIR/tokenizer.json`` (special tokens from ``tokenizer_config.json``).
Nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from megascore.api.errors import InvalidRequestError

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
NO_TOKENIZER = (
    "the server has no tokenizer: send token ids, or start `megascore serve` with "
    "--tokenizer DIR (an hf:DIR checkpoint's own tokenizer is used when it has one)"
)


def default_tokenizer_dir(model: str) -> str | None:
    """The tokenizer directory of an ``hf:DIR`` model when DIR holds one, else None."""
    if not model.startswith("hf:"):
        return None
    directory = Path(model[3:]).expanduser()
    if any((directory / name).is_file() for name in TOKENIZER_FILES):
        return str(directory)
    return None


def _special(config: dict, key: str) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class ServerTokenizer:
    """A loaded tokenizer.

    Args:
        path: a local tokenizer directory.

    Raises:
        ValueError: the directory holds no tokenizer that loads.
    """

    def __init__(self, path: str):
        self.path = str(Path(path).expanduser())
        self._strings: dict[int, str] = {}
        try:
            from transformers import AutoTokenizer
        except ImportError:
            AutoTokenizer = None  # noqa: N806
        try:
            if AutoTokenizer is not None:
                self._hf = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
                self._fast = None
                self.info = {
                    "tokenizer_class": type(self._hf).__name__,
                    "bos_token": self._hf.bos_token,
                    "eos_token": self._hf.eos_token,
                    "pad_token": self._hf.pad_token,
                    "unk_token": self._hf.unk_token,
                    "chat_template": getattr(self._hf, "chat_template", None),
                    "model_max_length": int(min(self._hf.model_max_length, 2**62)),
                }
            else:
                from tokenizers import Tokenizer

                self._hf = None
                self._fast = Tokenizer.from_file(str(Path(self.path) / "tokenizer.json"))
                config_file = Path(self.path) / "tokenizer_config.json"
                config = json.loads(config_file.read_text()) if config_file.is_file() else {}
                self.info = {
                    "tokenizer_class": "tokenizers.Tokenizer",
                    **{k: _special(config, k) for k in ("bos_token", "eos_token", "pad_token")},
                    "unk_token": _special(config, "unk_token"),
                    "chat_template": config.get("chat_template"),
                }
        except Exception as exc:  # OSError, ValueError, json errors: the reason says it
            raise ValueError(f"tokenizer {self.path}: cannot load it ({exc})") from exc
        logger.info("tokenizer %s (%s)", self.path, self.info["tokenizer_class"])

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``."""
        if self._hf is not None:
            return list(self._hf(text, add_special_tokens=add_special_tokens)["input_ids"])
        return self._fast.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``."""
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_string(self, token_id: int) -> str:
        """What ``token_id`` decodes to on its own (vLLM's token strings), cached."""
        text = self._strings.get(token_id)
        if text is None:
            text = self._strings[token_id] = self.decode([token_id])
        return text


def require(tokenizer: ServerTokenizer | None, field: str) -> ServerTokenizer:
    """``tokenizer``, or the error saying how to get one (text sent in ``field``).

    Raises:
        InvalidRequestError: the server has no tokenizer.
    """
    if tokenizer is None:
        raise InvalidRequestError(f"{field}: text given, but {NO_TOKENIZER}")
    return tokenizer
