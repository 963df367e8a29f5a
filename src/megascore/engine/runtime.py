"""The distributed engine: one model replica across the ranks of a torch.distributed job.

Every rank calls :meth:`DistributedEngine.create`; then rank 0 serves
:meth:`~DistributedEngine.score` / :meth:`~DistributedEngine.load_weights` /
:meth:`~DistributedEngine.shutdown` (the :class:`~megascore.api.types.Engine`
protocol) and every other rank runs :meth:`~DistributedEngine.worker_loop`
until rank 0 shuts down::

    engine = DistributedEngine.create(EngineConfig(model="tiny"))
    if engine.rank != 0:
        engine.worker_loop()  # returns after SHUTDOWN
    else:
        ...  # serve engine.score(batch); finally engine.shutdown()

Process groups (all explicit):

* the default group: the rendezvous, group creation and checkpoint I/O, no step
  collective; its timeout is at least ``_STARTUP_TIMEOUT_S`` (ranks may start
  minutes apart).
* ``command``: every rank, gloo, a very long timeout on the workers: idle workers
  wait in it for rank 0's next message (``megascore.engine.protocol``). Rank 0's
  side times out after ``collective_timeout_s``: gloo's broadcast root blocks until
  every receiver took the message, so a hung worker fails the send instead of
  hanging rank 0 (and every request) forever.
* ``status``: every rank, gloo, ``3 x collective_timeout_s``: the per-step
  failure flags and the start-up barrier. It outlasts the step collectives so
  that a rank that failed early still hears from the ranks that first had to
  time out waiting for it.
* Megatron's TP / CP / EP / PP groups from ``megascore.model.parallel`` (timeout
  ``collective_timeout_s``). Under NCCL the timeout is enforced by NCCL's watchdog,
  which aborts the communicators and ends the process
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, set here when unset): a rank left in a
  collective by a peer that raised (out of memory) or died fails within the timeout.
  Under PP, rank 0 is on the first stage; its peer on the last stage
  (:func:`result_rank`) sends the step's results back over rank 0's PP group
  (:mod:`megascore.engine.step`).

Failure: when any rank fails a step, every rank learns it through the status
all-reduce (:func:`megascore.engine.step.run_step`, which first waits for the
step's CUDA work so that asynchronous CUDA errors count); the engine is then
*broken*: rank 0 raises :class:`~megascore.api.errors.WorkerLostError` for that and
every later call, and the workers leave their loop with the same error (exit
non-zero so that the launcher tears the replica down).

Weights: ``EngineConfig.model`` and ``load_weights`` take the model strings of
:func:`megascore.checkpoint.parse_model_string` (built-in ``tiny``, ``builtin:tiny@7``
for weight seed 7, ``hf:DIR``, ``megatron:DIR``), loaded by
:func:`megascore.engine.served_model.load_served_model` at start-up (a checkpoint's
model drawing no random weights) and :func:`~megascore.engine.served_model.reload_served_model`
on reload. ``load_weights`` first reads the new model's architecture from its config
alone on rank 0 and refuses another one (or a bad path) before any weight file is
opened; then it runs on every rank (RELOAD): each checks the checkpoint against its
model, the ranks agree, and only then does each overwrite its parameters in place (no
second model in memory). A failed check anywhere leaves the old weights serving; a
failure while writing (a file damaged past its headers or removed midway) breaks the
replica, which never serves a mix of two checkpoints.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from megascore.api.errors import (
    LOAD_FAILURES,
    CheckpointError,
    InvalidRequestError,
    WorkerLostError,
)
from megascore.api.limits import Limits, check_pinned_version
from megascore.api.types import ModelInfo, ParallelLayout, ScoreBatch, ScoreOutput, WeightTarget
from megascore.checkpoint import check_same_architecture, parse_model_string, read_model_config
from megascore.config import EngineConfig
from megascore.engine import protocol
from megascore.engine.data_parallel import DataParallelGroup
from megascore.engine.forward import moe_metric_names, mtp_metric_names
from megascore.engine.losses import loss_names
from megascore.engine.push.apply import (
    WeightStaging,
    gather_needs,
    gather_targets,
    weight_targets,
)
from megascore.engine.rendezvous import init_default_group
from megascore.engine.routing import routing_shape
from megascore.engine.segment_packing import check_prefix_sharing_device, min_shared_prefix
from megascore.engine.served_model import LoadedModel, load_served_model, reload_served_model
from megascore.engine.step import StepConfig, StepGroups, agree_on_status
from megascore.model.parallel import destroy_parallel, initialize_parallel, resolve_device

logger = logging.getLogger(__name__)

_COMMAND_TIMEOUT = datetime.timedelta(days=365)
_STARTUP_TIMEOUT_S = 600.0
_SRC = 0


def _init_distributed(engine_cfg: EngineConfig, device: torch.device) -> bool:
    """Initialises the default process group from the environment (torchrun / launcher).

    Returns:
        True when this call initialised it (the engine then destroys it on shutdown),
        False when the caller had (the caller keeps owning it).
    """
    if device.type == "cuda":
        # NCCL enforces a group's timeout in its watchdog thread: a collective that
        # outlives it (a peer raised, hung or died mid-step) aborts the communicators
        # and ends this process, so the launcher tears the replica down instead of
        # leaving the peers in the collective. torchrun sets this too; a bare
        # RANK / WORLD_SIZE start (Kubernetes) does not.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The default group carries the rendezvous, where ranks may arrive minutes apart
    # (imports, checkpoint reads): a short collective_timeout_s must not fail start-up.
    # Steps use the explicit groups, with the collective timeout.
    timeout = max(engine_cfg.collective_timeout_s, _STARTUP_TIMEOUT_S)
    init_default_group(
        backend,
        datetime.timedelta(seconds=timeout),
        # NCCL: bind this rank's GPU (its barriers would otherwise guess one)
        device if device.type == "cuda" else None,
    )
    logger.info("rank %d/%d: %s initialised", dist.get_rank(), dist.get_world_size(), backend)
    return True


def _load_agreeing(
    load: Callable[[Callable[[], None]], LoadedModel],
    agree: Callable[[BaseException | None], None],
    what: str,
) -> tuple[LoadedModel | None, BaseException | None]:
    """Every rank: ``load(before_write)`` (start-up or reload), the ranks agreeing once
    every check passed, before anything is written.

    ``agree(problem)`` is a status all-reduce that raises when any rank has a problem.
    The loader calls ``before_write`` after its checks: there this rank agrees with
    none; a rank that fails before (a bad checkpoint, a check) agrees with its error
    instead, so every rank raises at that one agreement and nothing is written anywhere.
    A load with nothing to check (a built-in at start-up) may never call it.

    Returns:
        ``(loaded, None)``; or ``(None, error)`` for a failure once writing may have begun
        (the caller's next agreement decides what follows).

    Raises:
        What ``agree`` raises.
    """
    phase = "check"  # -> "agree" (in the first agreement) -> "write" (every rank agreed)

    def before_write() -> None:
        nonlocal phase
        phase = "agree"
        agree(None)
        phase = "write"

    try:
        return load(before_write), None
    except WorkerLostError:  # an agreement itself failed
        raise
    except Exception as e:  # noqa: BLE001 - reported to every rank by the agreements
        if phase == "agree":
            raise  # the agreement found a failed rank: nothing was written
        if not isinstance(e, LOAD_FAILURES):  # a bug or an I/O surprise: its traceback
            logger.exception("rank %d: %s failed", dist.get_rank(), what)
        if phase == "check":
            agree(e)  # raises: this rank has a problem
        return None, e


def _teardown_groups(groups: list[dist.ProcessGroup], destroy_default: bool) -> None:
    """Destroys Megatron's parallel state, ``groups`` and, if asked, the default group."""
    try:
        destroy_parallel()
        for group in groups:
            dist.destroy_process_group(group)
    finally:
        if destroy_default and dist.is_initialized():
            dist.destroy_process_group()


def result_rank(world_size: int, pp: int, output_rank: int = _SRC) -> int:
    """``output_rank``'s peer on the last pipeline stage (Megatron's rank order puts PP
    outermost: stage ``s`` holds ranks ``[s * world / pp, (s + 1) * world / pp)``)."""
    return output_rank + (pp - 1) * (world_size // pp)


@contextlib.contextmanager
def _one_thread():
    """Torch ops on this thread run single-threaded inside.

    For a pushed tensor's staging (slicing and copying shards: memory-bound). Run on the
    intra-op pool, each copy left the pool's threads spinning for more work after it,
    taking the cores the gRPC stream and the client need: measured on 2 cores, the
    server's CPU per push halved (fp32 0.72 -> 0.45 s, bf16 0.47 -> 0.23 s) and bf16
    push / loopback went from 0.73 to 0.87 (bench/weight_push.py).
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class DistributedEngine:
    """A model replica; implements :class:`megascore.api.types.Engine` on rank 0."""

    def __init__(
        self,
        engine_cfg: EngineConfig,
        loaded: LoadedModel,
        pg_collection,
        groups: StepGroups,
        command_group: dist.ProcessGroup,
        data_parallel: DataParallelGroup,
    ):
        """Use :meth:`create`; this only stores what it built."""
        self.engine_cfg = engine_cfg
        self.loaded = loaded
        self.pg_collection = pg_collection
        self.groups = groups
        self.command_group = command_group
        self.data_parallel = data_parallel
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = resolve_device(engine_cfg)
        is_moe = loaded.config.is_moe  # reloads keep the architecture, hence the layout
        self.sequence_parallel = engine_cfg.sequence_parallel_for(is_moe)
        self.step_cfg = StepConfig(
            pad_multiple=engine_cfg.pad_multiple(is_moe),
            chunk_tokens=engine_cfg.logprob_chunk_tokens,
            vocab_size=loaded.config.vocab_size,
            device=self.device,
            microbatches=engine_cfg.microbatches,
            output_rank=data_parallel.output_rank(),
            lm_head_dtype=engine_cfg.lm_head_dtype,
            metrics_reduction=engine_cfg.metrics_reduction,
            min_shared_prefix=min_shared_prefix(engine_cfg, self.device, loaded.model),
            result_rank=result_rank(
                self.world_size,
                engine_cfg.pipeline_model_parallel_size,
                data_parallel.output_rank(),
            ),
        )
        self.limits = Limits(
            vocab_size=loaded.config.vocab_size,
            max_sequence_length=loaded.config.max_position_embeddings,
            max_top_k=engine_cfg.max_top_k,
            max_target_ids=engine_cfg.max_target_ids,
            loss_names=loss_names(),
            metrics_supported=engine_cfg.metrics_supported(is_moe),
            routing=routing_shape(loaded.model),
            mtp_not_served=loaded.config.mtp_not_served,
            metric_groups=tuple(
                group
                for group, names in (
                    ("moe", moe_metric_names(loaded.config)),
                    ("mtp", mtp_metric_names(loaded.config)),
                )
                if names
            ),
        )
        self._step = 0
        self._push: WeightStaging | None = None  # the open weight push's staged shards
        # host tensors the next push stages into (WeightStaging.buffers), from the last one
        self._staging_buffers: dict[str, torch.Tensor] = {}
        self._push_of: LoadedModel | None = None  # what was served when it began
        self._broken: str | None = None
        self._closed = False
        self._owns_default_group = False

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def create(cls, engine_cfg: EngineConfig) -> DistributedEngine:
        """Builds the replica; call on every rank (collective).

        Reads ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` from the
        environment unless ``torch.distributed`` is already initialised.

        Args:
            engine_cfg: the engine config, identical on every rank.

        Returns:
            The engine, after every rank has built the model.

        Raises:
            ValueError: an unsupported model spec (on every rank, before any collective).
            WorkerLostError: some rank failed to build the model.
        """
        parse_model_string(engine_cfg.model)  # bad strings fail alike everywhere, early
        device = resolve_device(engine_cfg)
        check_prefix_sharing_device(engine_cfg, device)
        if device.type == "cuda" and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            device = resolve_device(engine_cfg)
        owns_default_group = _init_distributed(engine_cfg, device)
        own_groups: list[dist.ProcessGroup] = []
        try:
            pg_collection = initialize_parallel(engine_cfg)
            pp = pg_collection.pp.size()
            expected = result_rank(dist.get_world_size(), pp)
            if _SRC in dist.get_process_group_ranks(pg_collection.pp):
                last = dist.get_global_rank(pg_collection.pp, pp - 1)
                if last != expected:
                    raise RuntimeError(f"last pipeline stage of rank 0 is {last}, not {expected}")
            world = list(range(dist.get_world_size()))
            status_timeout = datetime.timedelta(seconds=3 * engine_cfg.collective_timeout_s)
            own_groups.append(dist.new_group(world, backend="gloo", timeout=status_timeout))
            command_timeout = _COMMAND_TIMEOUT  # gloo timeouts are per process: see above
            if dist.get_rank() == _SRC:
                command_timeout = datetime.timedelta(seconds=engine_cfg.collective_timeout_s)
            own_groups.append(dist.new_group(world, backend="gloo", timeout=command_timeout))
            status, command = own_groups
            groups = StepGroups(
                tp=pg_collection.tp, cp=pg_collection.cp, pp=pg_collection.pp, status=status
            )
            data_parallel = DataParallelGroup.create(pg_collection, engine_cfg.collective_timeout_s)
            if data_parallel.results is not None:
                own_groups.append(data_parallel.results)

            def agree(problem: BaseException | None) -> None:
                failed = agree_on_status(problem is not None, status)
                if failed and isinstance(problem, LOAD_FAILURES) and len(failed) == len(world):
                    raise problem  # a config / checkpoint error, the same everywhere
                if failed:
                    raise WorkerLostError(f"building the model failed on ranks {failed}: {problem}")

            start = time.perf_counter()
            loaded, error = _load_agreeing(
                lambda before_write: load_served_model(
                    engine_cfg.model, engine_cfg, pg_collection, before_write=before_write
                ),
                agree,
                "building the model",
            )
            agree(error)  # every rank has built it
        except BaseException:
            _teardown_groups(own_groups, owns_default_group)
            raise
        logger.info(
            "rank %d: every rank has built %s; built and loaded in %.2f s",
            dist.get_rank(),
            loaded.weights_version,
            time.perf_counter() - start,
        )
        engine = cls(engine_cfg, loaded, pg_collection, groups, command, data_parallel)
        auto_sp = engine.sequence_parallel and engine_cfg.sequence_parallel is None
        if auto_sp and engine.rank == _SRC:
            logger.info(
                "sequence parallelism turned on for MoE model %s at TP=%d (Megatron's "
                "training-mode MoE forward needs it for the metrics; set sequence_parallel "
                "to override); per-sequence pad multiple %d",
                loaded.spec.name,
                engine_cfg.tensor_model_parallel_size,
                engine.pad_multiple,
            )
        engine._owns_default_group = owns_default_group
        return engine

    @property
    def pad_multiple(self) -> int:
        """Per-sequence pad multiple of every step (the server's batcher budgets with it)."""
        return self.step_cfg.pad_multiple

    # ---- Engine protocol (rank 0) -------------------------------------------------------------

    def info(self) -> ModelInfo:
        """Describes the served model (any rank; no collective)."""
        cfg, e = self.loaded.config, self.engine_cfg
        return ModelInfo(
            name=self.loaded.spec.name,
            architecture=cfg.architecture,
            num_parameters=self.loaded.num_parameters,
            dtype=e.dtype,
            parallel=ParallelLayout(
                world_size=self.world_size,
                tensor_model_parallel_size=e.tensor_model_parallel_size,
                context_parallel_size=e.context_parallel_size,
                expert_model_parallel_size=e.expert_model_parallel_size,
                pipeline_model_parallel_size=e.pipeline_model_parallel_size,
            ),
            attention_backend=self.loaded.model.megascore_attention_backend,
            limits=self.limits,
            checkpoint_path=self.loaded.spec.path,
            weights_version=self.loaded.weights_version,
            has_tokenizer=self.loaded.has_tokenizer,
            moe_metric_names=tuple(moe_metric_names(cfg)),
            mtp_metric_names=tuple(mtp_metric_names(cfg)),
        )

    def check(self, batch: ScoreBatch) -> None:
        """Checks a batch against the served model (any rank; no collective).

        Raises:
            InvalidRequestError: naming the field and sequence that do not fit.
        """
        batch.check(self.limits)

    def score(self, batch: ScoreBatch) -> ScoreOutput:
        """Rank 0: scores one batch on every rank of the replica.

        Args:
            batch: the batch (:meth:`check` runs first, before any collective).

        Returns:
            The batch's :class:`ScoreOutput` (flat token layout, ``weights_version`` set).

        Raises:
            InvalidRequestError: the batch does not fit the model (no collective issued).
            WrongVersionError: the batch is pinned to weights other than those served.
            WorkerLostError: a rank failed or a collective timed out; the replica
                must be restarted.
        """
        self._require_driver("score")
        if self._broken is not None:
            raise WorkerLostError(f"replica is broken: {self._broken}")
        check_pinned_version(batch.weights_version, self.loaded.weights_version)
        self.check(batch)
        self._step += 1
        try:
            protocol.send_batch(
                batch, self.command_group, _SRC, loss_names(), device="cpu", step=self._step
            )
        except (RuntimeError, OSError) as e:
            raise self._mark_broken(f"broadcasting step {self._step} failed: {e}") from e
        out = self._run_step(batch)
        out.weights_version = self.loaded.weights_version
        return out

    def load_weights(self, model: str, weights_version: str) -> str:
        """Rank 0: loads new weights on every rank; the old ones stay on failure.

        Args:
            model: ``builtin:NAME@SEED`` of the served built-in architecture, or
                ``hf:DIR`` / ``megatron:DIR`` of a checkpoint with the served architecture.
            weights_version: label of the new weights ("" derives one: the seed, or the
                checkpoint's label / file hash).

        Returns:
            The new weights version.

        Raises:
            InvalidRequestError: unsupported spec or another built-in (no collective issued).
            CheckpointError: a missing directory, unreadable config or another
                architecture, read from the config alone (no collective issued, nothing
                built); or some rank failed to load (old weights kept everywhere).
            WorkerLostError: the replica is broken or a collective failed.
        """
        self._require_driver("load_weights")
        try:
            spec = parse_model_string(model)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        served = self.loaded.spec
        if spec.kind == "builtin" and spec.name != served.name:
            raise InvalidRequestError(f"model {model!r}: the served model is {served.name!r}")
        # The architecture first, from the checkpoint's config (and, for its optional
        # parts, the weight files' headers): a mismatch (or a bad path) is refused before
        # any rank builds a model or reads a tensor.
        ignore_mtp = self.engine_cfg.ignore_mtp_layers
        check_same_architecture(
            read_model_config(model, ignore_mtp_layers=ignore_mtp), self.loaded.config, model
        )
        version = weights_version  # "" lets the loader derive one (seed, checkpoint hash)
        self._step += 1
        try:
            protocol.send_command(
                protocol.Command.RELOAD,
                self.command_group,
                _SRC,
                device="cpu",
                path=model,
                version=version,
                step=self._step,
            )
        except (RuntimeError, OSError) as e:
            raise self._mark_broken(f"broadcasting RELOAD failed: {e}") from e
        self._reload(model, version)
        return self.loaded.weights_version

    # ---- weight pushes (megascore.engine.push.apply; rank 0) -------------------------------

    def begin_weight_update(self, names: int) -> dict[str, WeightTarget]:
        """Opens a push on every rank (dropping an unfinished one); returns its targets."""
        self._require_driver("begin_weight_update")
        message = protocol.WeightsMessage(names=names)
        self._send_weights(protocol.Command.WEIGHTS_BEGIN, message)
        return self._on_weights(protocol.Command.WEIGHTS_BEGIN, message)

    def stage_weight(
        self, name: str, dtype: str, shape: tuple[int, ...], data: np.ndarray, layout: int
    ) -> None:
        """One full tensor of the open push: its header to every rank, then each rank its
        parts of it (:meth:`WeightStaging.receive`); every rank stages its shards.

        ``data`` is the tensor's bytes, uint8 (a view of the server's pooled buffer,
        ``megascore_server.push.chunks.TensorBuffers``: the tensor built on it keeps it in
        use until every part is sent and staged)."""
        self._require_driver("stage_weight")
        torch_dtype = getattr(torch, dtype)
        if len(data):
            with warnings.catch_warnings():  # a read-only buffer is only read (shards are copies)
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                tensor = torch.frombuffer(data, dtype=torch_dtype).reshape(shape)
        else:
            tensor = torch.empty(shape, dtype=torch_dtype)
        message = protocol.WeightsMessage(name=name, tensor=tensor, layout=layout)
        self._send_weights(protocol.Command.WEIGHTS_TENSOR, message)
        self._on_weights(protocol.Command.WEIGHTS_TENSOR, message)

    def commit_weights(self, weights_version: str, partial: bool) -> str:
        """Swaps the staged shards in on every rank, or raises CheckpointError (old kept)."""
        self._require_driver("commit_weights")
        message = protocol.WeightsMessage(version=weights_version, partial=partial)
        self._send_weights(protocol.Command.WEIGHTS_COMMIT, message)
        self._on_weights(protocol.Command.WEIGHTS_COMMIT, message)
        return self.loaded.weights_version

    def abort_weight_update(self) -> None:
        """Drops the open push's staged shards on every rank."""
        self._require_driver("abort_weight_update")
        self._send_weights(protocol.Command.WEIGHTS_ABORT, protocol.WeightsMessage())
        self._on_weights(protocol.Command.WEIGHTS_ABORT, protocol.WeightsMessage())

    def _send_weights(self, command, message) -> None:
        if self._broken is not None:
            raise WorkerLostError(f"replica is broken: {self._broken}")
        self._step += 1
        try:
            protocol.send_weights(command, message, self.command_group, _SRC, device="cpu")
        except (RuntimeError, OSError) as e:
            raise self._mark_broken(f"broadcasting {command.name} failed: {e}") from e

    def _on_weights(self, command, message) -> dict[str, WeightTarget] | None:
        """Every rank: one WEIGHTS_* message (BEGIN and COMMIT are collective); BEGIN
        returns every rank's targets."""
        if command == protocol.Command.WEIGHTS_BEGIN:
            loaded, local = self.loaded, None
            self._push_of = loaded
            try:
                self._push = WeightStaging(
                    loaded.model,
                    loaded.config,
                    self.pg_collection,
                    message.names,
                    buffers=self._staging_buffers,
                )
                local = weight_targets(
                    loaded.model, loaded.config, self.pg_collection, message.names
                )
            except Exception:  # noqa: BLE001 - every rank learns it through the gather
                logger.exception("rank %d: listing the push's tensors failed", self.rank)
                self._push = None
            try:
                targets = gather_targets(local, self.groups.status, loaded.config, message.names)
                gather_needs(self._push, self.groups.status)
            except RuntimeError as e:
                raise self._mark_broken(f"weight push begin all-gather failed: {e}") from e
            return targets
        elif command == protocol.Command.WEIGHTS_ABORT:
            if self._push is not None:
                self._staging_buffers = self._push.release()
            self._push = None
        elif self._push is None:
            raise self._mark_broken(f"{command.name} without an open weight push")
        elif command == protocol.Command.WEIGHTS_TENSOR:
            try:
                with _one_thread():  # memory-bound copies: see _one_thread
                    self._push.receive(
                        message.name, message.tensor, message.layout, self.command_group, _SRC
                    )
            except RuntimeError as e:
                raise self._mark_broken(f"sending the parts of {message.name!r} failed: {e}") from e
        else:
            push, self._push = self._push, None
            problem = push.problem(message.partial)
            if self._push_of is not self.loaded:  # a LoadWeights reloaded the model meanwhile
                problem = "the served model was reloaded (LoadWeights) during the push: push again"
            self._staging_buffers = push.release()  # kept when the ranks do not agree
            self._agree_or_raise(problem, "weight commit", "weight push")
            self._staging_buffers = push.apply()
            changed = len(push.staged)
            self.loaded.weights_version = message.version
            logger.info(
                "rank %d: %d pushed parameters swapped in (%.1f MB of tensor parts sent, "
                "%.1f MB received); now serving %s",
                self.rank,
                changed,
                push.sent_bytes / 1e6,
                push.received_bytes / 1e6,
                message.version,
            )

    def shutdown(self) -> None:
        """Tears down the replica's state on this rank.

        On rank 0 it first broadcasts SHUTDOWN (workers then leave their loop and
        tear down themselves); on a worker whose loop raised, or on a broken
        replica, it only tears down the local state. Megatron's parallel state and
        the engine's groups are destroyed; the default process group only if
        :meth:`create` initialised it. Idempotent.
        """
        if self._closed:
            return
        if self.rank == _SRC and self._broken is None:
            try:
                protocol.send_command(
                    protocol.Command.SHUTDOWN, self.command_group, _SRC, device="cpu"
                )
            except (RuntimeError, OSError) as e:
                logger.warning("SHUTDOWN broadcast failed: %s", e)
        self._teardown()

    # ---- workers ------------------------------------------------------------------------------

    def worker_loop(self) -> None:
        """Ranks != 0: executes rank 0's commands until SHUTDOWN.

        Raises:
            WorkerLostError: a step failed on some rank, rank 0 vanished or the
                protocol went out of step (the process should exit non-zero).
        """
        if self.rank == _SRC:
            raise RuntimeError("worker_loop runs on ranks != 0")
        while True:
            try:
                command, batch, extra = protocol.recv_command(
                    self.command_group, _SRC, loss_names(), device="cpu"
                )
            except (RuntimeError, OSError, protocol.ProtocolError) as e:
                raise self._mark_broken(f"rank {self.rank}: lost rank 0: {e}") from e
            if command == protocol.Command.SHUTDOWN:
                logger.info("rank %d: SHUTDOWN", self.rank)
                self._teardown()
                return
            if command in protocol.WEIGHT_COMMANDS:
                try:
                    self._on_weights(command, extra.weights)
                except CheckpointError as e:
                    logger.warning(
                        "rank %d: weight push refused, old weights kept: %s", self.rank, e
                    )
                continue
            if command == protocol.Command.RELOAD:
                try:
                    self._reload(extra.path, extra.version)
                except CheckpointError as e:
                    logger.warning("rank %d: reload failed, old weights kept: %s", self.rank, e)
                continue
            self._run_step(batch)

    # ---- internals ----------------------------------------------------------------------------

    def _run_step(self, batch: ScoreBatch) -> ScoreOutput | None:
        """Every rank: the step, split across the DP ranks; the output on rank 0."""
        shape = self.limits.routing
        dims = None if shape is None else (shape.num_moe_layers, shape.topk)
        try:
            model = self.loaded.model
            return self.data_parallel.run(model, batch, self.groups, self.step_cfg, dims)
        except WorkerLostError as e:
            raise self._mark_broken(str(e)) from e

    def _reload(self, model: str, version: str) -> None:
        """Every rank: checks ``model`` against the served one, agrees, then loads it into
        the served parameters in place; the ranks agree again once written.

        A failure before the first agreement (any check) leaves the old weights serving
        (CheckpointError). A failure while writing leaves them partly overwritten: the
        replica is then broken (WorkerLostError), never serving a mix of two checkpoints.
        """
        new, error = _load_agreeing(
            # Checks the architecture from the config before anything else (every rank:
            # rank 0 checked it already, but a worker may see other files).
            lambda before_write: reload_served_model(
                self.loaded,
                model,
                self.engine_cfg,
                self.pg_collection,
                weights_version=version,
                before_write=before_write,
            ),
            lambda problem: self._agree_or_raise(problem, "reload", f"loading {model!r}"),
            f"loading {model!r}",
        )
        try:
            failed = agree_on_status(error is not None, self.groups.status)
        except RuntimeError as e:
            raise self._mark_broken(f"reload status all-reduce failed: {e}") from e
        if failed:
            raise self._mark_broken(
                f"loading {model!r} failed on ranks {failed} after the weights began to be "
                f"overwritten: {error if error is not None else 'see the log of those ranks'}"
            )
        self.loaded = new
        logger.info("rank %d: now serving %s", self.rank, self.loaded.weights_version)

    def _agree_or_raise(self, problem: object, step: str, what: str) -> None:
        """Every rank: agrees on whether any rank has a ``problem`` (None: none here).

        Raises:
            CheckpointError: some rank had one ("``what`` failed on ranks [...]").
            WorkerLostError: the ``step`` status all-reduce itself failed.
        """
        try:
            failed = agree_on_status(problem is not None, self.groups.status)
        except RuntimeError as e:
            raise self._mark_broken(f"{step} status all-reduce failed: {e}") from e
        if failed:
            reason = problem if problem is not None else "see the log of those ranks"
            raise CheckpointError(f"{what} failed on ranks {failed}: {reason}")

    def _require_driver(self, what: str) -> None:
        if self.rank != _SRC:
            raise RuntimeError(f"{what} is called on rank 0 only")
        if self._closed:
            raise WorkerLostError("the engine is shut down")

    def _mark_broken(self, reason: str) -> WorkerLostError:
        if self._broken is None:
            logger.error("rank %d: replica broken: %s", self.rank, reason)
            self._broken = reason
        return WorkerLostError(reason)

    def _teardown(self) -> None:
        if self._closed:
            return
        self._closed = True
        groups = [self.groups.status, self.command_group]
        if self.data_parallel.results is not None:
            groups.append(self.data_parallel.results)
        _teardown_groups(groups, self._owns_default_group)
