"""Third-party start-up notices are counted and summarised, not printed; errors and
megascore's own warnings pass; DEBUG shows everything."""

from __future__ import annotations

import logging
import warnings

import pytest

from megascore_server import startup_logs


@pytest.fixture
def notices(monkeypatch):
    monkeypatch.setattr(startup_logs, "_NOTICES", None)
    for name in startup_logs._TORCH_OWN_HANDLER_LOGGERS:
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    # the loggers as a new process has them, their ancestors too: what ran before in this
    # one (a model build, gpu_check's parity row: "megatron" at ERROR) may have set a
    # level or disabled one; setLevel also drops the effective levels logging cached.
    # Not torch's: torch sets "torch" to WARNING at import, which a new process has too.
    saved = {}
    for name in ("megatron.core.models.gpt", "megascore.engine"):
        while name:
            logger = logging.getLogger(name)
            saved.setdefault(logger, (logger.level, logger.disabled))
            logger.setLevel(logging.NOTSET)
            logger.disabled = False
            name = name.rpartition(".")[0]
    shown_warnings: list[str] = []
    monkeypatch.setattr(warnings, "showwarning", lambda m, *a, **k: shown_warnings.append(str(m)))
    monkeypatch.setattr(startup_logs, "shown_warnings", shown_warnings, raising=False)
    root = logging.getLogger()
    handler = logging.Handler()
    records: list[logging.LogRecord] = []
    handler.emit = records.append
    root.addHandler(handler)
    monkeypatch.setattr(root, "level", logging.INFO)
    yield records
    root.removeHandler(handler)
    for logger, (level, disabled) in saved.items():
        logger.setLevel(level)
        logger.disabled = disabled
    for other in root.handlers:  # pytest's own handlers outlive the test
        other.filters = [f for f in other.filters if f is not startup_logs._NOTICES]


def test_third_party_notices_are_summarised(notices):
    startup_logs.hide_third_party_notices("INFO")
    site = "/venv/lib/python3.12/site-packages"
    warnings.showwarning("Apex is not installed", UserWarning, f"{site}/megatron/core/x.py", 3)
    warnings.showwarning("mine", UserWarning, "/work/megascore/thing.py", 3)
    logging.getLogger("megatron.core.models.gpt").warning("GPTModel IS DEPRECATED")
    logging.getLogger("megatron.core").error("a real megatron error")
    logging.getLogger("megascore.engine").warning("our own warning")
    logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found")
    logging.getLogger("torch.__trace").warning("")  # an empty message counts too
    shown = [r.getMessage() for r in notices]
    assert shown == ["a real megatron error", "our own warning"]
    assert startup_logs.shown_warnings == ["mine"]  # megascore's own warnings are shown
    startup_logs.summarise()
    summary = notices[-1].getMessage()
    assert summary.startswith("4 start-up notices of Megatron") and "Apex" in summary
    notices.clear()
    startup_logs.summarise()  # once: nothing new hidden, nothing logged
    assert notices == []


def test_debug_level_shows_everything(notices):
    startup_logs.hide_third_party_notices("DEBUG")
    logging.getLogger("megatron.core").warning("GPTModel IS DEPRECATED")
    assert [r.getMessage() for r in notices] == ["GPTModel IS DEPRECATED"]
