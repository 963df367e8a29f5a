"""A fake :class:`megascore.api.types.Engine` for service tests (numpy only, no torch).

Every per-token value is a deterministic function of the token, the previous
token of the *same* sequence and that sequence's temperature, so a request's
results do not depend on which other requests shared its engine step: tests
compute the expected response from the request alone (:func:`compute`) and
compare (``score_from`` and ``cached_tokens`` as the real engine's table says).
Batch-level MoE / MTP metrics are token means over the step, so their
token-weighted mean over several steps equals the mean over the request. A fake
MoE engine (``routing=RoutingShape(...)``) routes token ``x`` of every layer ``l`` to
experts ``(x + l + j) % E``, j < k, and adds ``0.001 * sum(route)`` to the logprob of
the token after it, so a replayed routing shows in the logprobs.

The engine can be slowed down (``delay_s``), held at a gate (``gate``), made to
fail one step or every step, or to raise :class:`WorkerLostError`. Like the real
engine it checks every step against its :class:`Limits` first (``check``);
narrowing ``limits`` below what ``info()`` announces lets requests through the
wire gate that the engine then refuses.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from megascore.api import selection
from megascore.api.errors import CheckpointError, InvalidRequestError, WorkerLostError
from megascore.api.limits import Limits, RoutingShape, check_pinned_version
from megascore.api.types import ModelInfo, ParallelLayout, ScoreBatch, ScoreOutput

VOCAB = 1000
MAX_LEN = 512
MAX_TOP_K = 8
LOSS_NAMES = ("mean_nll", "nll")


def _first_positions(lengths: np.ndarray) -> np.ndarray:
    starts = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


def fake_routing(ids: np.ndarray, shape: RoutingShape) -> np.ndarray:
    """int32 ``[T, L, k]`` routes of the fake MoE engine (see module docstring)."""
    layers = np.arange(shape.num_moe_layers)[None, :, None]
    slots = np.arange(shape.topk)[None, None, :]
    return ((ids[:, None, None] + layers + slots) % shape.num_experts).astype(np.int32)


def compute(
    batch: ScoreBatch, weights_version: str = "v0", routing: RoutingShape | None = None
) -> ScoreOutput:
    """The fake forward: deterministic outputs for ``batch`` (see module docstring)."""
    ids = batch.token_ids.astype(np.int64)
    starts = _first_positions(batch.lengths)
    prev = np.roll(ids, 1)
    prev[starts] = 0
    temp = np.repeat(batch.temperatures().astype(np.float32), batch.lengths)
    salt = np.float32(sum(map(ord, weights_version)) % 50)  # other weights, other values
    raw = (((ids * 7 + prev * 3) % 101) + 1).astype(np.float32) / np.float32(10) + salt / 100
    routes = None
    if routing is not None:
        routes = batch.routing if batch.routing is not None else fake_routing(ids, routing)
        prev_route = np.roll(routes.reshape(ids.size, -1).sum(axis=1), 1)
        prev_route[starts] = 0
        raw += np.float32(0.001) * prev_route.astype(np.float32)
    logprobs = -(raw / temp)
    logprobs[starts] = 0.0
    values = {"logprobs": logprobs.astype(np.float32), "losses": {}}
    out = ScoreOutput(values=values, weights_version=weights_version)
    if batch.return_routing:
        values["routing"] = np.asarray(routes, dtype=np.int32)
    if batch.top_k:
        j = np.arange(batch.top_k, dtype=np.int64)
        values["top_k_ids"] = (ids[:, None] * 5 + j[None, :] * 11) % VOCAB
        values["top_k_logprobs"] = (
            -((j[None, :] + 1).astype(np.float32) * np.float32(0.5) + (ids[:, None] % 7) / 10)
            / temp[:, None]
        ).astype(np.float32)
        values["top_k_ids"][starts] = -1
        values["top_k_logprobs"][starts] = 0.0
    scored = batch.scored_mask()  # the loss mask from each sequence's score_from on
    mask = np.ones(ids.size) if scored is None else scored.astype(np.float64)
    mask[starts] = 0.0
    weighted = mask * logprobs.astype(np.float64)
    nll = -np.add.reduceat(weighted, starts)
    count = np.add.reduceat(mask, starts).astype(np.int64)
    if "nll" in batch.losses:
        out.losses["nll"] = nll
    if "mean_nll" in batch.losses:
        out.losses["mean_nll"] = nll / np.maximum(count, 1)
    values["num_loss_tokens"] = count
    values["cached_tokens"] = batch.cached_tokens()
    if batch.score_from is not None:  # the per-token outputs before it hold their fill
        selection.fill_positions(values, batch.before_score_from())
    if batch.return_moe_metrics:
        out.moe_metrics = {
            "load_balancing_loss": float(ids.mean() / VOCAB),
            "z_loss": float((ids % 10).mean()),
        }
    if batch.return_mtp_metrics:
        out.mtp_metrics = {
            "mtp_1_loss": float((ids % 17).mean() / 17),
            "mtp_1_acceptance_rate": float((ids % 2).mean()),
        }
    return out


class FakeEngine:
    """Fake engine implementing the ``Engine`` protocol; records every step.

    Attributes:
        delay_s: sleep per step.
        gate: when set to an unset ``threading.Event``, steps wait on it.
        fail_next: exception raised by the next step only.
        fail_always: exception raised by every step.
        limits: what ``check`` (and so every step) accepts.
        refused: the steps ``check`` refused.
        steps: ``(ScoreBatch, weights_version)`` of every successful step.
        events: ``("step", n_seqs)`` / ``("load", version)`` in execution order.
    """

    def __init__(
        self,
        *,
        max_len: int = MAX_LEN,
        version: str = "v0",
        delay_s: float = 0.0,
        routing: RoutingShape | None = None,
        metrics: bool = True,
    ):
        self.max_len = max_len
        self.routing = routing
        self.metrics = metrics  # False: a dense model without MTP (no MoE / MTP metrics)
        self.version = version
        self.delay_s = delay_s
        self.gate: threading.Event | None = None
        self.fail_next: BaseException | None = None
        self.fail_always: BaseException | None = None
        self.limits = Limits(
            vocab_size=VOCAB,
            max_sequence_length=max_len,
            max_top_k=MAX_TOP_K,
            max_target_ids=MAX_TOP_K,
            loss_names=LOSS_NAMES,
            routing=routing,
            metric_groups=("moe", "mtp") if metrics else (),
        )
        self.refused: list[ScoreBatch] = []
        self.steps: list[tuple[ScoreBatch, str]] = []
        self.events: list[tuple[str, object]] = []
        self.started = threading.Event()
        self.shutdown_called = 0
        self.threads: set[str] = set()
        self._loads = 0

    def info(self) -> ModelInfo:
        return ModelInfo(
            name="fake",
            architecture="gpt",
            num_parameters=12345,
            dtype="float32",
            parallel=ParallelLayout(),
            attention_backend="torch",
            limits=self.limits,
            checkpoint_path=f"fake:{self.version}",
            weights_version=self.version,
            moe_metric_names=("load_balancing_loss", "z_loss") if self.metrics else (),
            mtp_metric_names=("mtp_1_loss", "mtp_1_acceptance_rate") if self.metrics else (),
        )

    def check(self, batch: ScoreBatch) -> None:
        batch.check(self.limits)

    def score(self, batch: ScoreBatch) -> ScoreOutput:
        self.threads.add(threading.current_thread().name)
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30), "test gate never opened"
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        if self.fail_always is not None:
            raise self.fail_always
        check_pinned_version(batch.weights_version, self.version)
        try:
            self.check(batch)
        except InvalidRequestError:
            self.refused.append(batch)
            raise
        self.steps.append((batch, self.version))
        self.events.append(("step", batch.num_sequences))
        return compute(batch, self.version, self.routing)

    def load_weights(self, model: str, weights_version: str, weight_set: str = "") -> str:
        if not model.startswith(("hf:", "megatron:", "builtin:")):
            raise InvalidRequestError(f"model {model!r}: expected hf:DIR, megatron:DIR or builtin:")
        if self.delay_s:
            time.sleep(self.delay_s)
        if "lost" in model:
            raise WorkerLostError("rank 1 did not answer the RELOAD broadcast")
        if "bad" in model:
            raise CheckpointError(f"{model}: tensor 'decoder.layers.0.weight' has shape [3, 4]")
        if "crash" in model:
            raise RuntimeError("disk on fire")
        self._loads += 1
        self.version = weights_version or f"v{self._loads}"
        self.events.append(("load", self.version))
        return self.version

    def shutdown(self) -> None:
        self.shutdown_called += 1
