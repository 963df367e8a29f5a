"""Third-party start-up notices, summarised in one line instead of ~18.

Importing Megatron-Core, torch and friends prints warnings that say nothing about
the user's configuration ("Apex is not installed", "GPTModel IS DEPRECATED",
"No CUDA runtime is found" on a CPU host...). :func:`hide_third_party_notices`
keeps them out of the log: Python warnings raised in those packages and their log
records below ERROR are counted instead, and :func:`summarise` logs how many were
hidden, with the first one. Errors always pass; ``--log-level DEBUG`` shows
everything (nothing is installed then).
"""

from __future__ import annotations

import collections
import logging
import os
import warnings

logger = logging.getLogger(__name__)

THIRD_PARTY = ("megatron", "transformer_engine", "apex", "torch", "absl", "modelopt")
"""Top-level packages whose start-up notices are summarised (logger names and the
directories their warnings come from)."""
_TORCH_OWN_HANDLER_LOGGERS = ("torch.utils.cpp_extension",)
"""torch loggers that write through torch's own handler (not the root's)."""


def _first_line(text: str) -> str:
    return text.strip().partition("\n")[0]


class ThirdPartyNotices(logging.Filter):
    """Counts and drops third-party warnings and log records below ERROR."""

    def __init__(self):
        super().__init__()
        self.hidden: collections.Counter[str] = collections.Counter()
        self._show = warnings.showwarning

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or record.name.split(".")[0] not in THIRD_PARTY:
            return True
        if not getattr(record, "megascore_hidden", False):  # counted once, whatever the
            record.megascore_hidden = True  # number of handlers it goes through
            self.hidden[_first_line(record.getMessage())] += 1
        return False

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        parts = os.path.normpath(str(filename)).split(os.sep)
        if any(package in parts for package in THIRD_PARTY) and "site-packages" in parts:
            self.hidden[_first_line(str(message))] += 1
            return
        self._show(message, category, filename, lineno, file, line)


_NOTICES: ThirdPartyNotices | None = None


def hide_third_party_notices(level: str) -> None:
    """Installs the filter on the root handlers and the warnings hook (once; not at DEBUG).

    Args:
        level: the server's log level name.
    """
    global _NOTICES
    if _NOTICES is not None or logging.getLevelName(level.upper()) == logging.DEBUG:
        return
    _NOTICES = ThirdPartyNotices()
    for handler in logging.getLogger().handlers:
        handler.addFilter(_NOTICES)
    for name in _TORCH_OWN_HANDLER_LOGGERS:
        logging.getLogger(name).addFilter(_NOTICES)
    warnings.showwarning = _NOTICES.showwarning


def summarise() -> None:
    """Logs, once, how many notices were hidden so far (nothing when none were)."""
    if _NOTICES is None or not _NOTICES.hidden:
        return
    total = sum(_NOTICES.hidden.values())
    first = next(iter(_NOTICES.hidden))
    logger.info(
        "%d start-up notices of Megatron / torch / TransformerEngine hidden (optional "
        "packages missing, deprecations), e.g. %r; "
        "--log-level DEBUG shows them",
        total,
        first[:100],
    )
    _NOTICES.hidden.clear()
