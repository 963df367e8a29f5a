"""Issue 5 through the real server and client: HF checkpoints served by ``megascore serve``.

* For every supported family (llama, qwen2, mistral, mixtral) a tiny random
  transformers model (``testkit.checkpoints``, weights rescaled so
  logprobs are far from uniform) is saved and served as ``hf:DIR`` (TP=1, and TP=2
  for llama and mixtral: vocab-parallel output, split QKV groups, expert TP with
  sequence parallelism). Logprobs, top-k and the NLL returned through
  :class:`ScoringClient` equal transformers' own forward on the same weights
  (max |delta| <= 1e-4, fp32); ``GetModelInfo`` describes the checkpoint.
* Hot reload under load: client threads (sync and asyncio) score continuously while
  ``LoadWeights`` swaps llama A -> B -> A -> B -> A (and a load of another
  architecture is refused while B serves). No request fails, every response
  matches the transformers reference of the weights version it reports, and requests
  sent after a swap returned (and answered before the next began) carry the new version.
* Failed loads (missing directory, no weights, HF dir as ``megatron:``, two other
  architectures) answer FAILED_PRECONDITION (a built-in name: INVALID_ARGUMENT), and the
  old weights keep serving bit for bit; on TP=2 both ranks load B and agree.

Six servers (4 TP=1, 2 TP=2) are started ahead of their tests, several at once, and
stopped after their last test (:class:`ServerPool`); each must exit 0 on SIGTERM and
leave no process behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from megascore.checkpoint import resolve_model
from megascore_client import AsyncScoringClient, ScoringClient, ScoringError
from testkit.checkpoints import VOCAB, make_hf_model
from tests.e2e.serve import ServeProcess
from tests.e2e.server_pool import ServerSpec, module_pool

pytestmark = pytest.mark.timeout(1200)  # first test waits for the servers' start-up

ATOL = 1e-4  # fp32 Megatron vs fp32 transformers, compared in float64
TOP_K = 4
RPC_TIMEOUT_S = 120.0

# Server configurations: name -> (checkpoint, tensor-parallel size).
SERVERS: dict[str, tuple[str, int]] = {
    "llama-tp1": ("llama", 1),
    "qwen2-tp1": ("qwen2", 1),
    "mistral-tp1": ("mistral", 1),
    "mixtral-tp1": ("mixtral", 1),
    "llama-tp2": ("llama", 2),
    "mixtral-tp2": ("mixtral", 2),
}
# Checkpoints: name -> (family, seed). "llama" is llama A; "llama-b" the same
# architecture with other weights. qwen2 also carries a tokenizer.json.
CHECKPOINTS: dict[str, tuple[str, int]] = {
    "llama": ("llama", 0),
    "llama-b": ("llama", 1),
    "qwen2": ("qwen2", 0),
    "mistral": ("mistral", 0),
    "mixtral": ("mixtral", 0),
}
WITH_TOKENIZER = ("qwen2",)


def _sequences(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


# Length 1 (nothing to predict), short and long sequences; the vocabulary's ends.
PARITY_SEQS = _sequences(5, (1, 2, 9, 16, 31, 64, 120))
PARITY_SEQS[-1][:3] = [0, VOCAB - 1, 0]
RELOAD_SEQS = _sequences(6, (6, 11, 17, 24, 32, 40))


# ------------------------------------------------------------------------ references


@dataclasses.dataclass
class Reference:
    """transformers' view of one sequence (float64, from the fp32 forward)."""

    logprobs: np.ndarray  # [L-1]: log p(x_t | x_<t), t = 1..L-1
    full: np.ndarray  # [L-1, V]: log-softmax at positions 0..L-2
    top_k: np.ndarray  # [L-1, TOP_K]: the largest logprobs, descending


def hf_reference(model, sequences) -> list[Reference]:
    """One transformers forward per sequence (no padding), log-softmax in float64."""
    import torch

    refs = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq], dtype=torch.int64)
            lp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)[:-1]  # [L-1, V]
            target = lp.gather(-1, ids[0, 1:, None])[:, 0]
            refs.append(Reference(target.numpy(), lp.numpy(), lp.topk(TOP_K, -1).values.numpy()))
    return refs


def max_error(result, sequences, refs) -> float:
    """Max |server - reference| over every target logprob of ``result``."""
    worst = 0.0
    for i, (seq, ref) in enumerate(zip(sequences, refs, strict=True)):
        lp = result.logprobs[i]
        assert lp.shape == (len(seq),) and lp[0] == 0.0, f"sequence {i}: {lp.shape}, {lp[:1]}"
        worst = max(worst, float(np.abs(lp[1:].astype(np.float64) - ref.logprobs).max(initial=0)))
    return worst


# ------------------------------------------------------------------------ checkpoints


@dataclasses.dataclass
class Checkpoint:
    family: str
    directory: Path
    model: object  # the transformers model whose weights were saved
    version: str  # the weights version the loader derives for hf:DIR

    @property
    def spec(self) -> str:
        return f"hf:{self.directory}"


def _write_tokenizer(directory: Path) -> None:
    """A WordLevel tokenizer over the model's vocabulary ("t0" .. "t255")."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    assert Tokenizer.from_file(str(directory / "tokenizer.json")).encode("t5 t255").ids == [5, 255]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Checkpoint]:
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, (family, seed) in CHECKPOINTS.items():
        directory = root / name
        model = make_hf_model(family, seed)
        model.save_pretrained(directory)
        if family in WITH_TOKENIZER:
            _write_tokenizer(directory)
        version = resolve_model(f"hf:{directory}").metadata.weights_version
        out[name] = Checkpoint(family, directory.resolve(), model, version)
    versions = [c.version for c in out.values()]
    assert len(set(versions)) == len(versions), f"weights versions collide: {versions}"
    return out


# ------------------------------------------------------------------------ servers


@pytest.fixture(scope="module")
def pool(request, checkpoints, tmp_path_factory):
    specs = {
        name: ServerSpec(checkpoints[ckpt].spec, tp, ("--tp", str(tp)) if tp > 1 else ())
        for name, (ckpt, tp) in SERVERS.items()
    }
    yield from module_pool(request, tmp_path_factory, "serve-ckpt", specs)


@pytest.fixture
def server(pool, config):
    yield from pool.lend(config)


def _client(server: ServeProcess) -> ScoringClient:
    # No retries: a request that fails must show up as a failure.
    return ScoringClient(server.target, timeout=RPC_TIMEOUT_S, retries=None)


# ------------------------------------------------------------------------ hot reload (llama TP=1)
# First in the module: the llama TP=1 server then stops early (after its parity test).


@dataclasses.dataclass
class Record:
    indices: list[int]
    result: object
    sent: float
    received: float


class LoadGenerator:
    """Client threads scoring random subsets of RELOAD_SEQS until stopped.

    ``sync_threads`` threads each use their own ScoringClient (one call at a time);
    one more thread runs an asyncio loop with ``async_width`` concurrent calls on an
    AsyncScoringClient. Every response and every exception is recorded.
    """

    def __init__(self, target: str, sync_threads: int = 2, async_width: int = 3):
        self.target = target
        self.records: list[Record] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._sync_worker, args=(k,), daemon=True)
            for k in range(sync_threads)
        ]
        self._threads.append(
            threading.Thread(target=self._async_worker, args=(async_width,), daemon=True)
        )

    def _pick(self, rng) -> list[int]:
        return sorted(rng.choice(len(RELOAD_SEQS), size=int(rng.integers(1, 4)), replace=False))

    def _record(self, indices, result, sent) -> None:
        with self._lock:
            self.records.append(Record(indices, result, sent, time.monotonic()))

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self.errors.append(exc)
        self.stop.set()

    def _sync_worker(self, k: int) -> None:
        rng = np.random.default_rng(100 + k)
        try:
            with ScoringClient(self.target, timeout=RPC_TIMEOUT_S, retries=None) as client:
                while not self.stop.is_set():
                    indices = self._pick(rng)
                    sent = time.monotonic()
                    result = client.score([RELOAD_SEQS[i] for i in indices])
                    self._record(indices, result, sent)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self._fail(exc)

    def _async_worker(self, width: int) -> None:
        rng = np.random.default_rng(200)

        async def one(client) -> None:
            while not self.stop.is_set():
                indices = self._pick(rng)
                sent = time.monotonic()
                result = await client.score([RELOAD_SEQS[i] for i in indices])
                self._record(indices, result, sent)

        async def run() -> None:
            async with AsyncScoringClient(
                self.target, timeout=RPC_TIMEOUT_S, retries=None
            ) as client:
                await asyncio.gather(*(one(client) for _ in range(width)))

        try:
            asyncio.run(run())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self._fail(exc)

    def __enter__(self) -> LoadGenerator:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(RPC_TIMEOUT_S + 10)
        if exc_type is None:  # else keep the test's own error
            assert not any(t.is_alive() for t in self._threads), "a client thread hangs"

    def count_after(self, t: float) -> int:
        with self._lock:
            return sum(r.sent >= t for r in self.records)

    def wait_for(self, t: float, n: int, timeout: float = 180.0) -> None:
        """Waits until ``n`` requests sent at or after ``t`` were answered."""
        end = time.monotonic() + timeout
        while self.count_after(t) < n:
            assert not self.errors, f"requests failed: {self.errors[:3]}"
            assert time.monotonic() < end, f"only {self.count_after(t)} responses after {t}"
            time.sleep(0.05)


@dataclasses.dataclass
class Swap:
    ckpt: Checkpoint
    started: float
    finished: float


def _serving_intervals(swaps: list[Swap], first: Checkpoint):
    """(from, until, checkpoint): times at which exactly one version can be served."""
    edges = [(-np.inf, first)] + [(s.finished, s.ckpt) for s in swaps]
    starts = [s.started for s in swaps] + [np.inf]
    return [(lo, hi, ckpt) for (lo, ckpt), hi in zip(edges, starts, strict=True)]


@pytest.mark.parametrize("config", ["llama-tp1"])
def test_hot_reload_under_concurrent_load(server, config, checkpoints):
    a, b = checkpoints["llama"], checkpoints["llama-b"]
    refs = {c.version: hf_reference(c.model, RELOAD_SEQS) for c in (a, b)}
    # The references tell A from B everywhere (otherwise matching proves nothing).
    gap = min(
        np.abs(ra.logprobs - rb.logprobs).max()
        for ra, rb in zip(refs[a.version], refs[b.version], strict=True)
    )
    assert gap > 100 * ATOL

    with _client(server) as control:
        if control.model_info().weights_version != a.version:
            control.load_weights(a.spec)
        swaps: list[Swap] = []
        with LoadGenerator(server.target) as load:
            since = time.monotonic()
            for target, previous in ((b, a), (a, b), (b, a), (a, b)):
                load.wait_for(since, 6)
                if target is a and previous is b and len(swaps) == 1:
                    # A refused load under the same load: B keeps serving throughout
                    # (its interval below spans this call).
                    with pytest.raises(ScoringError) as failure:
                        control.load_weights(checkpoints["mixtral"].spec)
                    assert failure.value.code is grpc.StatusCode.FAILED_PRECONDITION
                    assert control.model_info().weights_version == b.version
                    load.wait_for(time.monotonic(), 3)
                started = time.monotonic()
                answer = control.load_weights(target.spec)
                since = time.monotonic()
                swaps.append(Swap(target, started, since))
                assert (answer.weights_version, answer.previous_weights_version) == (
                    target.version,
                    previous.version,
                )
                assert answer.load_ms > 0
                info = control.model_info()
                assert (info.weights_version, info.checkpoint_path) == (
                    target.version,
                    str(target.directory),
                )
            load.wait_for(since, 6)
        assert not load.errors, f"requests failed during reload: {load.errors[:3]}"

    records = load.records
    intervals = _serving_intervals(swaps, a)
    seen = {a.version: 0, b.version: 0}
    pinned = 0
    worst = 0.0
    for r in records:
        version = r.result.weights_version
        assert version in refs, f"unknown weights version {version!r}"
        seen[version] += 1
        sequences = [RELOAD_SEQS[i] for i in r.indices]
        err = max_error(r.result, sequences, [refs[version][i] for i in r.indices])
        worst = max(worst, err)
        assert err <= ATOL, f"response claims {version} but is {err:.3e} off its reference"
        for lo, hi, ckpt in intervals:
            if r.sent >= lo and r.received <= hi:
                pinned += 1
                assert version == ckpt.version, f"sent {r.sent - lo:.3f}s after the swap"
    assert min(seen.values()) >= 12, seen
    assert pinned >= 30, f"only {pinned} of {len(records)} responses inside a quiet interval"
    print(f"\n{len(records)} responses {seen}, {pinned} pinned, max |delta| {worst:.2e}")


@pytest.mark.parametrize("config", ["llama-tp1"])
def test_failed_load_keeps_serving_old_weights(server, config, checkpoints, tmp_path):
    a = checkpoints["llama"]
    refs = hf_reference(a.model, PARITY_SEQS)
    broken = tmp_path / "broken"  # config.json but no weights
    broken.mkdir()
    (broken / "config.json").write_bytes((a.directory / "config.json").read_bytes())
    failures = [
        (f"hf:{tmp_path / 'missing'}", grpc.StatusCode.FAILED_PRECONDITION, "not a directory"),
        (f"hf:{broken}", grpc.StatusCode.FAILED_PRECONDITION, "safetensors"),
        (f"megatron:{a.directory}", grpc.StatusCode.FAILED_PRECONDITION, "megascore.json"),
        (checkpoints["qwen2"].spec, grpc.StatusCode.FAILED_PRECONDITION, "architecture"),
        (checkpoints["mixtral"].spec, grpc.StatusCode.FAILED_PRECONDITION, "architecture"),
        ("tiny@3", grpc.StatusCode.INVALID_ARGUMENT, "served model"),
    ]
    with _client(server) as client:
        answer = client.load_weights(a.spec)  # whatever an earlier test left: A again
        assert answer.weights_version == a.version
        before = client.score(PARITY_SEQS, top_k=TOP_K)
        assert max_error(before, PARITY_SEQS, refs) <= ATOL
        for spec, code, words in failures:
            with pytest.raises(ScoringError) as failure:
                client.load_weights(spec)
            assert failure.value.code is code, (spec, failure.value)
            assert words in failure.value.details, (spec, failure.value.details)
            if code is grpc.StatusCode.FAILED_PRECONDITION:
                assert f"still serving weights {a.version!r}" in failure.value.details
            info = client.model_info()
            assert (info.weights_version, info.checkpoint_path, info.architecture) == (
                a.version,
                str(a.directory),
                "llama",
            ), spec
            after = client.score(PARITY_SEQS, top_k=TOP_K)
            assert after.weights_version == a.version
            for x, y in zip(before.logprobs, after.logprobs, strict=True):
                np.testing.assert_array_equal(x, y, err_msg=spec)
            for x, y in zip(before.top_k_ids, after.top_k_ids, strict=True):
                np.testing.assert_array_equal(x, y, err_msg=spec)


# ------------------------------------------------------------------------ parity, every family


@pytest.mark.parametrize(
    "config",
    [
        "llama-tp1",
        "qwen2-tp1",
        "mistral-tp1",
        "mixtral-tp1",
        "mixtral-tp2",
        "llama-tp2",  # last: the next test uses the same server
    ],
)
def test_hf_checkpoint_scores_match_transformers(server, config, checkpoints):
    name, tp = SERVERS[config]
    ckpt = checkpoints[name]
    refs = hf_reference(ckpt.model, PARITY_SEQS)
    assert min(r.logprobs.std() for r in refs if r.logprobs.size > 4) > 0.5, "flat reference"

    with _client(server) as client:
        info = client.model_info()
        result = client.score(PARITY_SEQS, top_k=TOP_K, losses=("nll",))

    assert (info.name, info.architecture, info.checkpoint_path) == (
        ckpt.directory.name,
        ckpt.family,
        str(ckpt.directory),
    )
    assert info.vocab_size == VOCAB and info.max_sequence_length == 512
    assert info.dtype == "float32"
    assert info.has_tokenizer == (ckpt.family in WITH_TOKENIZER)
    assert info.weights_version == ckpt.version and len(ckpt.version) == 16
    assert info.parallel.world_size == tp and info.parallel.tensor_model_parallel_size == tp
    assert info.num_parameters == sum(p.numel() for p in ckpt.model.parameters())
    assert result.weights_version == ckpt.version

    err = max_error(result, PARITY_SEQS, refs)
    assert err <= ATOL, f"{config}: max |delta logprob| {err:.3e}"
    print(f"\n{config}: max |delta logprob| {err:.2e}")
    for i, (seq, ref) in enumerate(zip(PARITY_SEQS, refs, strict=True)):
        n = len(seq)
        ids, vals = result.top_k_ids[i], result.top_k_logprobs[i].astype(np.float64)
        assert ids.shape == vals.shape == (n, TOP_K)
        assert (ids[0] == -1).all() and (vals[0] == 0.0).all()
        # The k values are transformers' k largest, and each id has the value it claims
        # (tie-proof: no assumption on the order of near-equal logits).
        assert np.abs(vals[1:] - ref.top_k).max(initial=0) <= ATOL, f"sequence {i}"
        claimed = np.take_along_axis(ref.full, ids[1:], axis=-1)
        assert np.abs(vals[1:] - claimed).max(initial=0) <= ATOL, f"sequence {i}"
        assert result.num_tokens[i] == n - 1
        assert result.loss["nll"][i] == pytest.approx(-ref.logprobs.sum(), abs=1e-3)


# ------------------------------------------------------------------------ TP=2 reload


@pytest.mark.parametrize("config", ["llama-tp2"])
def test_tp2_reload_and_refused_load(server, config, checkpoints):
    """Both ranks load B (each its own shards) and agree; a refused load changes nothing."""
    a, b = checkpoints["llama"], checkpoints["llama-b"]
    with _client(server) as client:
        answer = client.load_weights(b.spec)
        assert answer.weights_version == b.version
        got = client.score(PARITY_SEQS)
        assert got.weights_version == b.version
        assert max_error(got, PARITY_SEQS, hf_reference(b.model, PARITY_SEQS)) <= ATOL
        with pytest.raises(ScoringError) as failure:
            client.load_weights(checkpoints["qwen2"].spec)
        assert failure.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "architecture" in failure.value.details
        again = client.score(PARITY_SEQS)
        assert again.weights_version == b.version
        for x, y in zip(got.logprobs, again.logprobs, strict=True):
            np.testing.assert_array_equal(x, y)
        assert client.load_weights(a.spec).weights_version == a.version
        back = client.score(PARITY_SEQS)
        assert max_error(back, PARITY_SEQS, hf_reference(a.model, PARITY_SEQS)) <= ATOL
