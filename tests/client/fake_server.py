"""A real gRPC server (sync ``grpc.server``) with a deterministic fake Scorer.

It speaks the megascore.v1 wire contract exactly (requests decoded with
``megascore.api.wire``) and computes values the tests can recompute with the ``ref_*``
functions: ``log p(x_t | x_<t) = -((x_t % 7) + 1) / 10 / temperature``. It records
every call (method, request id, metadata, sizes) and can inject failures, delays, a
gate that holds calls until released, and a required bearer token.
``grpc.health.v1`` is served by the real ``grpc_health`` servicer (Check calls counted).
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from megascore.api.errors import MegascoreError
from megascore.api.wire import decode_array, encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore.v1 import scoring_pb2_grpc as pb_grpc

VOCAB = 512
MAX_TOP_K = 8
LOSS_NAMES = ("nll", "mean_nll")
INT_DTYPES = (pb.DTYPE_INT32, pb.DTYPE_INT64)


def ref_logprobs(ids, temperature: float = 1.0) -> np.ndarray:
    """float32 [L]: entry 0 is 0.0, entry t is -((id_t % 7) + 1) / 10 / temperature."""
    ids = np.asarray(ids, dtype=np.int64)
    out = (-((ids % 7) + 1) / 10.0 / temperature).astype(np.float32)
    out[0] = 0.0
    return out


def ref_top_k(ids, k: int, temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """([L, k] int64 ids, [L, k] float32 logprobs); row 0 is -1 / 0.0."""
    ids = np.asarray(ids, dtype=np.int64)
    top_ids = (ids[:, None] + np.arange(k)[None, :]) % VOCAB
    top_lps = (-(np.arange(k)[None, :] + 1) / 10.0 / temperature).repeat(len(ids), 0)
    top_ids[0], top_lps[0] = -1, 0.0
    return top_ids, top_lps.astype(np.float32)


def ref_nll(ids, mask=None, temperature: float = 1.0) -> float:
    """Summed NLL over positions 1..L-1 where the mask is 1."""
    lp = ref_logprobs(ids, temperature).astype(np.float64)
    m = np.ones(len(lp)) if mask is None else np.asarray(mask, dtype=np.float64)
    return float(-(lp[1:] * m[1:]).sum())


ROUTING_LAYERS, ROUTING_TOPK = 3, 2


def ref_routing(ids) -> np.ndarray:
    """int32 [L, 3, 2] routes of the fake MoE model: token x, layer l -> (x + l + j) % 8."""
    ids = np.asarray(ids, dtype=np.int64)
    layers = np.arange(ROUTING_LAYERS)[None, :, None]
    return ((ids[:, None, None] + layers + np.arange(ROUTING_TOPK)) % 8).astype(np.int32)


def ref_moe(ids) -> dict[str, float]:
    ids = np.asarray(ids, dtype=np.float64)
    return {"load_balancing_loss": float(ids.mean() / 1000.0), "z_loss": float((ids % 3).mean())}


def ref_mtp(ids) -> dict[str, float]:
    ids = np.asarray(ids, dtype=np.int64)
    return {"mtp_1_loss": float((ids % 5).mean()), "mtp_1_acceptance_rate": float((ids % 2).mean())}


class FakeScorer(pb_grpc.ScorerServicer):
    """Deterministic Scorer with call recording and failure injection."""

    def __init__(
        self, *, token: str | None = None, max_request_tokens: int = 0, max_message_bytes: int = 0
    ):
        self.token = token
        self.max_request_tokens = max_request_tokens
        self.max_message_bytes = max_message_bytes  # advertised in ModelInfo (0 = not sent)
        self.lock = threading.Lock()
        self.calls: collections.Counter = collections.Counter()
        self.requests: list[dict] = []
        self.metadata: list[dict[str, str]] = []
        self.fail_next: list[tuple[grpc.StatusCode, str]] = []
        self.delay_s = 0.0
        self.load_delay_s = 0.0  # how long LoadWeights takes
        self.weights_version = "v0"
        self.name = "fake"
        self.gate = threading.Event()  # clear() holds every call (once counted) until set()
        self.gate.set()

    def _enter(self, method: str, context) -> None:
        with self.lock:
            self.calls[method] += 1
            self.metadata.append(dict(context.invocation_metadata()))
            failure = self.fail_next.pop(0) if self.fail_next else None
        self.gate.wait(30)
        if failure is not None:
            context.abort(*failure)
        if self.token is not None:
            auth = dict(context.invocation_metadata()).get("authorization")
            if auth != f"Bearer {self.token}":
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    def _score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        try:
            ids = decode_array(request.token_ids, "token_ids", INT_DTYPES).astype(np.int64)
            lengths = decode_array(request.lengths, "lengths", INT_DTYPES).astype(np.int64)
            mask = None
            if request.HasField("loss_mask"):
                mask = decode_array(request.loss_mask, "loss_mask").astype(np.int64)
        except MegascoreError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.reason)
        opts = request.options
        temperature = opts.temperature if opts.HasField("temperature") else 1.0
        with self.lock:
            self.requests.append(
                dict(
                    request_id=request.request_id,
                    num_sequences=len(lengths),
                    num_tokens=len(ids),
                    byte_size=request.ByteSize(),
                    options=opts,
                    id_dtype=request.token_ids.dtype,
                    has_temperature=opts.HasField("temperature"),
                    loss_mask=mask,
                    routing=decode_array(request.routing, "routing", INT_DTYPES)
                    if request.HasField("routing")
                    else None,
                )
            )
        if len(lengths) == 0 or (lengths < 1).any() or lengths.sum() != len(ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lengths: invalid")
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for i in range(len(lengths)):
            seq = ids[offsets[i] : offsets[i + 1]]
            if seq.max() >= VOCAB:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"token_ids: sequence {i} has id {seq.max()} >= vocab_size {VOCAB}",
                )
        if opts.top_k > MAX_TOP_K:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"top_k {opts.top_k} > {MAX_TOP_K}")
        for name in opts.losses:
            if name not in LOSS_NAMES:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown loss {name!r}")
        if self.max_request_tokens and len(ids) > self.max_request_tokens:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(ids)} tokens > limit")
        if self.delay_s:
            time.sleep(self.delay_s)
        seqs = [ids[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]
        masks = [
            None if mask is None else mask[offsets[i] : offsets[i + 1]] for i in range(len(seqs))
        ]
        resp = pb.ScoreResponse(
            request_id=request.request_id,
            lengths=encode_array(lengths),
            weights_version=self.weights_version,
            timings=pb.Timings(queue_ms=1.0, compute_ms=2.0, total_ms=3.0, num_steps=1),
        )
        if opts.return_logprobs:
            lps = [ref_logprobs(s, temperature) for s in seqs]
            resp.token_logprobs.CopyFrom(encode_array(np.concatenate(lps)))
        if opts.top_k:
            tops = [ref_top_k(s, opts.top_k, temperature) for s in seqs]
            resp.top_k = opts.top_k
            resp.top_k_ids.CopyFrom(encode_array(np.concatenate([t[0] for t in tops])))
            resp.top_k_logprobs.CopyFrom(encode_array(np.concatenate([t[1] for t in tops])))
        counts = np.array(
            [
                (len(s) - 1) if m is None else int(m[1:].sum())
                for s, m in zip(seqs, masks, strict=True)
            ],
            dtype=np.int64,
        )
        nll = np.array([ref_nll(s, m, temperature) for s, m in zip(seqs, masks, strict=True)])
        for name in opts.losses:
            values = nll if name == "nll" else nll / np.maximum(counts, 1)
            resp.sequence_losses[name].CopyFrom(encode_array(values.astype(np.float64)))
        resp.num_loss_tokens.CopyFrom(encode_array(counts))
        if opts.return_moe_metrics:
            resp.moe_metrics.update(ref_moe(ids))
        if opts.return_mtp_metrics:
            resp.mtp_metrics.update(ref_mtp(ids))
        if opts.return_routing:  # the replayed routes, else the fake model's own
            routes = ref_routing(ids)
            if request.HasField("routing"):
                routes = decode_array(request.routing, "routing", INT_DTYPES).astype(np.int32)
            resp.routing.CopyFrom(encode_array(routes))
            resp.routing_num_moe_layers, resp.routing_topk = ROUTING_LAYERS, ROUTING_TOPK
        return resp

    def Score(self, request, context):
        self._enter("Score", context)
        return self._score(request, context)

    def ScoreStream(self, request_iterator, context):
        self._enter("ScoreStream", context)
        for request in request_iterator:
            yield self._score(request, context)

    def GetModelInfo(self, request, context):
        self._enter("GetModelInfo", context)
        return pb.ModelInfo(
            name=self.name,
            architecture="gpt",
            num_parameters=12345,
            vocab_size=VOCAB,
            max_sequence_length=1024,
            dtype="float32",
            parallel=pb.ParallelLayout(
                world_size=2,
                tensor_model_parallel_size=2,
                context_parallel_size=1,
                expert_model_parallel_size=1,
                pipeline_model_parallel_size=1,
            ),
            attention_backend="torch",
            weights_version=self.weights_version,
            max_top_k=MAX_TOP_K,
            max_request_tokens=self.max_request_tokens,
            loss_names=list(LOSS_NAMES),
            moe_metric_names=["load_balancing_loss", "z_loss"],
            mtp_metric_names=["mtp_1_loss", "mtp_1_acceptance_rate"],
            max_tokens_per_batch=4096,
            max_message_bytes=self.max_message_bytes,
        )

    def LoadWeights(self, request, context):
        self._enter("LoadWeights", context)
        time.sleep(self.load_delay_s)
        if not request.model.startswith(("hf:", "megatron:")):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model: bad spec {request.model!r}")
        previous = self.weights_version
        self.weights_version = request.weights_version or f"v{self.calls['LoadWeights']}"
        return pb.LoadWeightsResponse(
            weights_version=self.weights_version, previous_weights_version=previous, load_ms=5.0
        )


class CountingHealth(health.HealthServicer):
    """The real health servicer, counting its Check calls; held by the scorer's gate."""

    def __init__(self, gate: threading.Event):
        super().__init__()
        self.gate = gate
        self.checks = 0
        self._count_lock = threading.Lock()

    def Check(self, request, context):
        with self._count_lock:
            self.checks += 1
        self.gate.wait(30)
        return super().Check(request, context)


class FakeServer:
    """Runs a :class:`FakeScorer` + health service on 127.0.0.1; restartable on its port."""

    def __init__(
        self,
        scorer: FakeScorer | None = None,
        *,
        max_message_bytes: int = 256 * 1024 * 1024,
        credentials: grpc.ServerCredentials | None = None,
        port: int = 0,
    ):
        self.scorer = scorer or FakeScorer()
        self.health = CountingHealth(self.scorer.gate)
        self.max_message_bytes = max_message_bytes
        self.credentials = credentials
        self.port = port
        self._server: grpc.Server | None = None

    def start(self) -> FakeServer:
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32),
            options=[
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes),
            ],
        )
        pb_grpc.add_ScorerServicer_to_server(self.scorer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        address = f"127.0.0.1:{self.port}"
        if self.credentials is None:
            self.port = server.add_insecure_port(address)
        else:
            self.port = server.add_secure_port(address, self.credentials)
        self.set_serving(True)
        server.start()
        self._server = server
        return self

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else (health_pb2.HealthCheckResponse.NOT_SERVING)
        )
        for service in ("", "megascore.v1.Scorer"):
            self.health.set(service, status)

    def stop(self, grace: float | None = None) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        return self.start() if self._server is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def check_scores(result, seqs, *, top_k: int, temperature=1.0, masks=None, metrics=True):
    """Asserts that a client ``result`` for ``seqs`` holds the ``ref_*`` values: logprobs,
    top-k ids and logprobs, the "nll" loss and (``metrics``) the MoE / MTP metrics."""
    masks = [None] * len(seqs) if masks is None else masks
    for i, seq in enumerate(seqs):
        np.testing.assert_array_equal(result.logprobs[i], ref_logprobs(seq, temperature))
        ids, lps = ref_top_k(seq, top_k, temperature)
        np.testing.assert_array_equal(result.top_k_ids[i], ids)
        np.testing.assert_array_equal(result.top_k_logprobs[i], lps)
    expected = [ref_nll(s, m, temperature) for s, m in zip(seqs, masks, strict=True)]
    np.testing.assert_allclose(result.loss["nll"], expected)
    if metrics:
        # Token-weighted mean of per-request means == the mean over the whole batch.
        flat = np.concatenate(seqs)
        assert result.moe_metrics == pytest.approx(ref_moe(flat))
        assert result.mtp_metrics == pytest.approx(ref_mtp(flat))
