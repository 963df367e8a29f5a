"""``megascore serve``: entry point of the server (``main(argv)``).

Three ways to run:

* ``megascore serve [flags]`` — one rank in this process (world size 1).
* ``megascore serve --nproc N`` — this process launches and supervises N local
  ranks (:class:`~megascore_server.launcher.LocalLauncher`); rank 0 serves gRPC.
* ``torchrun --nproc-per-node N -m megascore_server.main [flags]`` — detected by
  RANK / WORLD_SIZE in the environment; each process runs its rank
  (``--nproc`` is then ignored). Multi-node replicas use torchrun's rendezvous.

``python -m megascore_server.main torchrun ARGS`` is ``torchrun ARGS`` (:func:`torchrun`)
that exits 0 when a SIGTERM / SIGINT drained every local rank (torchrun itself
re-raises the signal as a ``SignalException`` traceback, exit 1, however cleanly its
workers stopped).

Exit codes: 0 after a clean SIGTERM / SIGINT drain, 1 when a rank was lost or
the engine failed, 2 for an invalid configuration (a layout that does not fit the
ranks, an unknown model, ``--device cuda`` without CUDA: found before any rank
starts, :mod:`megascore_server.preflight`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from megascore_server.bootstrap import EXIT_DIR_ENV, ensure_dist_env, run_rank
from megascore_server.config import ReplicaConfig
from megascore_server.config_loader import load_serve_config, unknown_env
from megascore_server.connection_limits import raise_open_files_limit
from megascore_server.cuda_defaults import apply_cuda_defaults
from megascore_server.launcher import LAUNCHED_ENV, RESOLVED_CONFIG_ENV, LocalLauncher
from megascore_server.preflight import check_before_launch, cuda_device_count
from megascore_server.startup_logs import hide_third_party_notices

logger = logging.getLogger(__name__)


def setup_logging(level: str) -> None:
    """Structured-ish log lines tagged with the rank (a no-op when logging is configured);
    third-party start-up notices summarised (:mod:`megascore_server.startup_logs`)."""
    rank = os.environ.get("RANK", "-")
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s rank={rank} %(levelname)s %(name)s: %(message)s",
    )
    hide_third_party_notices(level)  # summarised once the engine is built


def resolve_config(argv: Sequence[str]) -> ReplicaConfig:
    """The config passed down by the launcher, or the one resolved from flags / file / env."""
    resolved = os.environ.get(RESOLVED_CONFIG_ENV)
    if resolved:
        return ReplicaConfig.from_dict(json.loads(resolved))
    return load_serve_config(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``megascore serve``.

    Args:
        argv: arguments after ``serve`` (None = ``sys.argv[1:]``).

    Returns:
        The process exit code.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        config = resolve_config(argv)
        if not os.environ.get(LAUNCHED_ENV):  # the launcher checked before starting us
            world = int(os.environ["WORLD_SIZE"]) if distributed else config.nproc
            check_before_launch(config, world, torchrun=distributed)
    except (ValueError, OSError) as exc:
        print(f"megascore serve: error: {exc}", file=sys.stderr)
        return 2
    if not distributed and config.nproc == 1:
        ensure_dist_env()  # this process is rank 0 of a world of 1
    setup_logging(config.server.log_level)
    raise_open_files_limit()  # before any rank or connection: the ranks inherit it
    cuda_warnings = apply_cuda_defaults(config.engine, os.environ, cuda_device_count())
    if not os.environ.get(LAUNCHED_ENV) and os.environ.get("RANK", "0") == "0":
        for warning in unknown_env(os.environ) + cuda_warnings:
            logger.warning("%s", warning)
        config.log_resolved()
    if distributed:
        world = int(os.environ["WORLD_SIZE"])
        if config.nproc > 1 and not os.environ.get(LAUNCHED_ENV):
            logger.warning("started by a launcher (WORLD_SIZE=%d): --nproc ignored", world)
        return run_rank(config)
    if config.nproc > 1:
        return LocalLauncher(config).run()
    return run_rank(config)


def torchrun(argv: Sequence[str]) -> int:
    """``torchrun ARGS`` that ends quietly after a drain.

    On SIGTERM / SIGINT torchrun's agent forwards the signal to its workers, waits for
    them, then re-raises it (a ``SignalException`` traceback, exit 1) whatever their
    exit codes. Here each rank records its exit code in a directory
    (``MEGASCORE_EXIT_DIR``, :func:`megascore_server.bootstrap.run_rank`), and after a
    signal this returns 0 when every local rank exited 0, else 1 naming the codes.
    Without a signal, torchrun's own behaviour and exit code.
    """
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    args = torch_run.parse_args(list(argv))
    nproc = torch_run.determine_local_world_size(args.nproc_per_node)
    with tempfile.TemporaryDirectory(prefix="megascore-exit-") as exit_dir:
        os.environ[EXIT_DIR_ENV] = exit_dir
        try:
            torch_run.run(args)
            return 0
        except SignalException as exc:
            name = exc.sigval.name
            files = sorted(Path(exit_dir).glob("rank-*"))
            codes = {f.name.removeprefix("rank-"): f.read_text().strip() for f in files}
    if len(codes) == nproc and set(codes.values()) == {"0"}:
        print(f"megascore: torchrun: {name}: {nproc} local ranks drained, exit 0", file=sys.stderr)
        return 0
    print(f"megascore: torchrun: {name}: local rank exit codes {codes} of {nproc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["torchrun"]:
        sys.exit(torchrun(sys.argv[2:]))
    sys.exit(main())
