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
  collective; its timeout is at least ``load_timeout_s`` (ranks may start
  minutes apart; :mod:`megascore.engine.ranks.startup`).
* ``command``: every rank, gloo, a very long timeout on the workers: idle workers
  wait in it for rank 0's next message (``megascore.engine.ranks.protocol``). Rank 0's
  side times out after ``collective_timeout_s``: gloo's broadcast root blocks until
  every receiver took the message, so a hung worker fails the send instead of
  hanging rank 0 (and every request) forever.
* ``status``: every rank, gloo, ``3 x collective_timeout_s``: the per-step
  failure flags and the start-up barrier. It outlasts the step collectives so
  that a rank that failed early still hears from the ranks that first had to
  time out waiting for it.
* ``load``: every rank, gloo, ``load_timeout_s``: the agreements around a model load
  (start-up and reload), where ranks finish reading a large checkpoint minutes apart.
  A rank that dies meanwhile closes its connections and fails the agreement at once.
* Megatron's TP / CP / EP / PP groups from ``megascore.model.parallel`` (timeout
  ``collective_timeout_s``). Under NCCL the timeout is enforced by NCCL's watchdog,
  which aborts the communicators and ends the process
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, set here when unset): a rank left in a
  collective by a peer that raised (out of memory) or died fails within the timeout.
  Under PP, rank 0 is on the first stage; its peer on the last stage
  (:func:`~megascore.engine.ranks.startup.result_rank`) sends the step's results back over
  rank 0's PP group (:mod:`megascore.engine.schedule.step`).

Failure: when any rank fails a step, every rank learns it through the status
all-reduce (:func:`megascore.engine.schedule.step.run_step`, which first waits for the
step's CUDA work so that asynchronous CUDA errors count); the engine is then
*broken*: rank 0 raises :class:`~megascore.api.errors.WorkerLostError` for that and
every later call, and the workers leave their loop with the same error (exit
non-zero so that the launcher tears the replica down).

Weights: :mod:`megascore.engine.weights.reload` loads a checkpoint (``load_weights``),
:mod:`megascore.engine.weights.push.handler` takes pushed tensors; the workers' side of every
command is :mod:`megascore.engine.worker_loop`. Those parts are mixed into
:class:`DistributedEngine`; the set-up and teardown helpers are
:mod:`megascore.engine.ranks.startup`.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch
import torch.distributed as dist

from megascore.api.errors import CheckpointError, WorkerLostError
from megascore.api.limits import Limits, check_pinned_version
from megascore.api.losses import loss_names
from megascore.api.reference_step import reference_batch, with_reference
from megascore.api.types import ModelInfo, ParallelLayout, ScoreBatch, ScoreOutput
from megascore.checkpoint import parse_model_string
from megascore.config import EngineConfig
from megascore.engine.cache import setup as cache_setup
from megascore.engine.cache.planner import PrefixCache
from megascore.engine.layout.segment_packing import min_shared_prefix
from megascore.engine.outputs.routing import routing_shape
from megascore.engine.ranks import protocol
from megascore.engine.ranks.startup import (
    DRIVER_RANK,
    check_result_rank,
    control_groups,
    init_distributed,
    result_rank,
    teardown_groups,
)
from megascore.engine.schedule.data_parallel import DataParallelGroup
from megascore.engine.schedule.forward import moe_metric_names, mtp_metric_names
from megascore.engine.schedule.step import (
    StepConfig,
    StepGroups,
    agree_on_status,
    metrics_lead_rows,
)
from megascore.engine.weights.adapters import AdapterHandler
from megascore.engine.weights.push.apply import WeightStaging
from megascore.engine.weights.push.handler import WeightPushHandler
from megascore.engine.weights.reload import WeightReload
from megascore.engine.weights.served_model import LoadedModel, build_agreeing
from megascore.engine.weights.sets import WeightSets
from megascore.engine.worker_loop import WorkerLoop
from megascore.model.parallel import initialize_parallel, select_device

logger = logging.getLogger(__name__)


class DistributedEngine(WorkerLoop, WeightReload, WeightPushHandler, AdapterHandler):
    """A model replica; implements :class:`megascore.api.types.Engine` on rank 0."""

    def __init__(
        self,
        engine_cfg: EngineConfig,
        loaded: LoadedModel,
        pg_collection,
        groups: StepGroups,
        command_group: dist.ProcessGroup,
        load_group: dist.ProcessGroup,
        data_parallel: DataParallelGroup,
        device: torch.device,
    ):
        """Use :meth:`create`; this only stores what it built."""
        self.engine_cfg = engine_cfg
        names = tuple(name for name, _ in engine_cfg.weight_set_models)
        self.sets = WeightSets(loaded, names, engine_cfg.weight_sets)
        self.pg_collection = pg_collection
        self.groups = groups
        self.command_group = command_group
        self.load_group = load_group
        self.data_parallel = data_parallel
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = device
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
        self._cache_sharing: int | None = None  # the prefix cache's within-step sharing
        self._cache = self._start_prefix_cache()
        self._step = 0
        self._push: WeightStaging | None = None  # the open weight push's staged shards
        # host tensors the next push stages into (WeightStaging.buffers), from the last one
        self._staging_buffers: dict[str, torch.Tensor] = {}
        self._push_of: LoadedModel | None = None  # what was served when it began
        self._push_set = self.sets.default  # the weight set the open push changes
        self._broken: str | None = None
        self._closed = False
        self._owns_default_group = False

    def _start_prefix_cache(self) -> PrefixCache | None:
        """Every rank: the prefix cache's store (and on rank 0 its index), when the replica
        runs it (:func:`megascore.engine.cache.setup.start`); within-step sharing then
        goes through it and the step's own sharing is off."""
        layout = {
            "cp": self.engine_cfg.context_parallel_size,
            "tp": self.engine_cfg.tensor_model_parallel_size,
            "pad_multiple": self.step_cfg.pad_multiple,
            "backend": getattr(self.loaded.model, "megascore_attention_backend", "torch"),
        }
        started = cache_setup.start(
            self.engine_cfg, self.loaded.model, self.device, layout, self.groups.status
        )
        if started is None:
            return None
        store, index = started
        self._cache_sharing = self.step_cfg.min_shared_prefix
        self.step_cfg = dataclasses.replace(
            self.step_cfg, min_shared_prefix=None, prefix_store=store
        )
        if self.rank != DRIVER_RANK:
            return None
        keep = self.engine_cfg.prefix_cache is not False
        seeds = lambda batch: self.sets.cache_seeds(batch, self.sets.live)  # noqa: E731
        return PrefixCache(index, store.block, keep, self._cache_sharing, seeds)

    @property
    def loaded(self) -> LoadedModel:
        """The default weight set's record (its model is every set's)."""
        return self.sets.records[self.sets.default]

    def _forget_prefixes(self) -> None:
        """The served weights changed: nothing cached holds (rank 0's index is emptied);
        a reloaded model's attention layers get the key block again."""
        store = self.step_cfg.prefix_store
        if store is not None:
            cache_setup.configure(self.loaded.model, store.block)
        if self._cache is not None:
            self._cache.forget()

    def cached_prefix_tokens(self, batch: ScoreBatch):
        """Rank 0: the tokens of each sequence the prefix cache holds now (int64 ``[B]``;
        None without a cache or for a batch that does not read it), for the batcher's
        costs (:meth:`megascore.engine.cache.planner.PrefixCache.cached_now`)."""
        if self._cache is None or not self._cache.applies(batch):
            return None
        weight_set, slot = self.sets.target(batch.model)
        if slot >= 0:  # an adapter's request: every sequence its slot
            batch = dataclasses.replace(batch, adapter=np.full(batch.num_sequences, slot))
        seeds = self.sets.cache_seeds(batch, self.sets.names[weight_set])
        return self._cache.cached_now(batch, seeds)

    def prefix_cache_stats(self) -> dict[str, int] | None:
        """Rank 0: the prefix cache's counters (None without a cache)."""
        return None if self._cache is None else self._cache.stats()

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
        device = select_device(engine_cfg)  # the one place it is resolved
        owns_default_group = init_distributed(engine_cfg, device)
        own_groups: list[dist.ProcessGroup] = []
        try:
            pg_collection = initialize_parallel(engine_cfg)
            check_result_rank(pg_collection)
            status, command, load = control_groups(engine_cfg, own_groups)
            groups = StepGroups(
                tp=pg_collection.tp, cp=pg_collection.cp, pp=pg_collection.pp, status=status
            )
            data_parallel = DataParallelGroup.create(pg_collection, engine_cfg.collective_timeout_s)
            if data_parallel.results is not None:
                own_groups.append(data_parallel.results)
            start = time.perf_counter()
            loaded = build_agreeing(engine_cfg, pg_collection, load, device)
        except BaseException:
            teardown_groups(own_groups, owns_default_group)
            raise
        logger.info(
            "rank %d: every rank has built %s; built and loaded in %.2f s",
            dist.get_rank(),
            loaded.weights_version,
            time.perf_counter() - start,
        )
        engine = cls(
            engine_cfg, loaded, pg_collection, groups, command, load, data_parallel, device
        )
        engine._owns_default_group = owns_default_group
        try:
            engine.load_other_sets()
            engine.load_start_adapters()
        except BaseException:
            engine._teardown()
            raise
        auto_sp = engine.sequence_parallel and engine_cfg.sequence_parallel is None
        if auto_sp and engine.rank == DRIVER_RANK:
            logger.info(
                "sequence parallelism turned on for MoE model %s at TP=%d (Megatron's "
                "training-mode MoE forward needs it for the metrics; set sequence_parallel "
                "to override); per-sequence pad multiple %d",
                loaded.spec.name,
                engine_cfg.tensor_model_parallel_size,
                engine.pad_multiple,
            )
        return engine

    @property
    def pad_multiple(self) -> int:
        """Per-sequence pad multiple of every step (the server's batcher budgets with it)."""
        return self.step_cfg.pad_multiple

    @property
    def min_shared_prefix(self) -> int:
        """The shortest prefix a step shares (0: its steps run dense), by the step itself
        or through the prefix cache; the server's batcher plans a request's sequences
        that share one together."""
        return self.step_cfg.min_shared_prefix or self._cache_sharing or 0

    @property
    def metrics_lead_rows(self) -> int:
        """Rows a continuation repeats of its prefix in a step with MoE / MTP metrics
        (:func:`~megascore.engine.schedule.step.metrics_lead_rows`; 0: such steps run dense,
        as they do with the prefix cache), for the batcher's plan of such requests."""
        if not self.step_cfg.min_shared_prefix or self.step_cfg.metrics_reduction != "step":
            return 0
        return metrics_lead_rows(self.loaded.model.config)

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
            models=self.sets.served(),
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
            batch: the batch (:meth:`check` runs first, before any collective), scored
                with the weight set ``batch.model`` names; with ``batch.reference``, a
                step under that set first (``megascore.api.reference_step``).

        Returns:
            The batch's :class:`ScoreOutput` (flat token layout, ``weights_version`` of
            its set, ``reference_weights_version`` of the reference's).

        Raises:
            InvalidRequestError: the batch does not fit the model (no collective issued).
            NotFoundError: a weight set name not served (no collective issued).
            WrongVersionError: the batch is pinned to weights other than those served.
            WorkerLostError: a rank failed or a collective timed out; the replica
                must be restarted.
        """
        self._require_driver("score")
        if self._broken is not None:
            raise WorkerLostError(f"replica is broken: {self._broken}")
        weight_set, slot = self.sets.target(batch.model)
        reference = (
            self.sets.target(batch.reference, "options.reference") if batch.reference else None
        )
        version = self.sets.resolve(batch.model).weights_version
        ref_version = self.sets.resolve(batch.reference).weights_version if reference else ""
        check_pinned_version(batch.weights_version, version)
        self.check(batch)
        if reference is not None:  # its logprobs first, an input of the step under model
            under = self._with_adapter(reference_batch(batch), *reference)
            batch = with_reference(batch, self._score_on(under, reference[0]))
        out = self._score_on(self._with_adapter(batch, weight_set, slot), weight_set)
        out.weights_version, out.reference_weights_version = version, ref_version
        return out

    def _score_on(self, batch: ScoreBatch, weight_set: int) -> ScoreOutput:
        """Rank 0: ``batch`` under weight set ``weight_set`` (made live here, and on every
        rank by the step's header)."""
        self.sets.activate(self.sets.names[weight_set])
        if self._cache is not None and self._cache.applies(batch):
            return self._cache.score(batch, self._send_and_run)
        return self._send_and_run(batch)

    def _send_and_run(self, batch: ScoreBatch) -> ScoreOutput:
        """Rank 0: one step of ``batch`` on every rank, under the live weight set."""
        self._step += 1
        weight_set = self.sets.names.index(self.sets.live)
        try:
            protocol.send_batch(
                batch,
                self.command_group,
                DRIVER_RANK,
                loss_names(),
                device="cpu",
                step=self._step,
                weight_set=weight_set,
            )
        except (RuntimeError, OSError) as e:
            raise self._mark_broken(f"broadcasting step {self._step} failed: {e}") from e
        return self._run_step(batch)

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
        if self.rank == DRIVER_RANK and self._broken is None:
            try:
                protocol.send_command(
                    protocol.Command.SHUTDOWN, self.command_group, DRIVER_RANK, device="cpu"
                )
            except (RuntimeError, OSError) as e:
                logger.warning("SHUTDOWN broadcast failed: %s", e)
        self._teardown()

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

    def _agree_or_raise(
        self, problem: object, group: dist.ProcessGroup, step: str, what: str
    ) -> None:
        """Every rank: agrees over ``group`` on whether any rank has a ``problem`` (None:
        none here).

        Raises:
            CheckpointError: some rank had one ("``what`` failed on ranks [...]").
            WorkerLostError: the ``step`` status all-reduce itself failed.
        """
        try:
            failed = agree_on_status(problem is not None, group)
        except RuntimeError as e:
            raise self._mark_broken(f"{step} status all-reduce failed: {e}") from e
        if failed:
            reason = problem if problem is not None else "see the log of those ranks"
            raise CheckpointError(f"{what} failed on ranks {failed}: {reason}")

    def _require_driver(self, what: str) -> None:
        if self.rank != DRIVER_RANK:
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
        groups = [self.groups.status, self.command_group, self.load_group]
        if self.data_parallel.results is not None:
            groups.append(self.data_parallel.results)
        teardown_groups(groups, self._owns_default_group)
