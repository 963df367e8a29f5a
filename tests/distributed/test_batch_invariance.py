"""Issue 24: a sequence's outputs are bit-identical whatever else is in the step.

200 random sequences (lengths 1-512, capped by the model's positions) are scored alone,
twice; in 6 random packings; and in one packing with 2 and 4 microbatches, each with
its own temperature, target ids and rollout logprobs. Every per-token and per-sequence
output of the table (logprobs, top-k ids and logprobs, losses, loss-token counts,
entropy, target-id logprobs, mismatch statistics, importance weights, token ranks, the
next token, MoE routing) must
be ``==`` to the sequence scored alone, on ``tiny``, ``tiny-moe`` and a Qwen3-MoE
``hf:DIR`` checkpoint in float32, and on ``tiny-moe`` in bfloat16. The served side (SDK splitting,
concurrent clients) is ``tests/e2e/test_batch_invariance_served.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megascore.api import mismatch, schema
from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from testkit.checkpoints import write_hf_checkpoint
from tests.one_rank import one_rank_world

NUM_SEQUENCES = 200
PACKINGS = 6
LOSSES = ("nll", "mean_nll", "perplexity")
NUM_TARGETS = 3


@dataclasses.dataclass(frozen=True)
class Sequence:
    """One sequence and its per-sequence inputs (the same wherever it is scored)."""

    ids: np.ndarray
    temperature: float
    target_ids: np.ndarray  # [L, NUM_TARGETS]
    rollout_logprobs: np.ndarray  # [L]

    @classmethod
    def draw(cls, rng, length: int, vocab: int) -> Sequence:
        return cls(
            rng.integers(0, vocab, size=length),
            float(rng.choice([0.7, 1.0, 1.3])),
            rng.integers(0, vocab, size=(length, NUM_TARGETS)),
            -rng.exponential(6.0, size=length),
        )


@pytest.fixture(scope="module")
def hf_moe_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "qwen3_moe"
    write_hf_checkpoint("qwen3_moe", directory)
    return directory


def _per_sequence(out, lengths: np.ndarray) -> list[dict[str, np.ndarray]]:
    """The outputs of each sequence of a step, by name: every entry of the output table
    (``megascore.api.schema.OUTPUTS``) the step returned."""
    cuts = np.cumsum(lengths)[:-1]
    pieces = [dict() for _ in lengths]
    for decl in schema.outputs():
        value = out.values.get(decl.name)
        if value is None or decl.name == "cached_tokens":  # where it came from, not what
            continue
        if decl.per == schema.TOKEN:
            for piece, part in zip(pieces, np.split(value, cuts), strict=True):
                piece[decl.name] = part
            continue
        named = value if decl.keys is not None else {decl.name: value}
        for name, values in named.items():
            for piece, v in zip(pieces, values, strict=True):
                piece[name] = np.asarray(v)
    return pieces


def _assert_identical(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for name, value in want.items():
        assert got[name].dtype == value.dtype, (where, name)
        assert np.array_equal(got[name], value), (
            f"{where}: {name} differs (max |diff| "
            f"{np.max(np.abs(got[name].astype(np.float64) - value)):.3g})"
        )


def _score(engine, seqs: list[Sequence], routing: bool) -> list[dict]:
    lengths = np.array([len(s.ids) for s in seqs], dtype=np.int64)
    batch = ScoreBatch(
        token_ids=np.concatenate([s.ids for s in seqs]),
        lengths=lengths,
        top_k=5,
        losses=LOSSES,
        return_routing=routing,
        return_entropy=True,
        return_importance_weights=True,
        return_token_ranks=True,
        return_next_token=True,
        temperature=np.array([s.temperature for s in seqs], dtype=np.float32),
        target_ids=np.concatenate([s.target_ids for s in seqs]),
        rollout_logprobs=np.concatenate([s.rollout_logprobs for s in seqs]),
    )
    return _per_sequence(engine.score(batch), lengths)


def _random_packs(rng, n: int) -> list[list[int]]:
    """A random order of ``n`` sequences cut into packs of random sizes."""
    order = rng.permutation(n)
    cuts = np.sort(rng.choice(np.arange(1, n), size=rng.integers(1, 12), replace=False))
    return [list(pack) for pack in np.split(order, cuts)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "model, dtype",
    [
        ("tiny", "float32"),
        ("tiny-moe", "float32"),
        ("hf-qwen3-moe", "float32"),
        ("tiny-moe", "bfloat16"),
    ],
)
def test_outputs_are_bit_identical_alone_packed_and_in_microbatches(model, dtype, request):
    from megascore.engine.runtime import DistributedEngine

    model_string = (
        f"hf:{request.getfixturevalue('hf_moe_dir')}" if model.startswith("hf") else model
    )
    rng = np.random.default_rng(24)
    with one_rank_world():
        engine = DistributedEngine.create(
            EngineConfig(model=model_string, device="cpu", dtype=dtype, collective_timeout_s=120)
        )
        try:
            info = engine.info()
            routing = info.routing is not None
            max_len = min(512, info.max_sequence_length)
            lengths = rng.integers(1, max_len + 1, size=NUM_SEQUENCES)
            seqs = [Sequence.draw(rng, n, info.vocab_size) for n in lengths]
            alone = [_score(engine, [s], routing)[0] for s in seqs]
            wanted = {"entropy", "target_logprobs", "importance_weights", *mismatch.NAMES}
            wanted |= {"token_ranks", "next_token_ids", "next_token_logprobs"}
            assert wanted | ({"routing"} if routing else set()) <= alone[0].keys()
            for i in rng.choice(NUM_SEQUENCES, size=20, replace=False):
                _assert_identical(_score(engine, [seqs[i]], routing)[0], alone[i], f"rerun {i}")
            for p in range(PACKINGS):
                for pack in _random_packs(rng, NUM_SEQUENCES):
                    got = _score(engine, [seqs[i] for i in pack], routing)
                    for i, result in zip(pack, got, strict=True):
                        _assert_identical(result, alone[i], f"packing {p}, sequence {i}")
        finally:
            engine.shutdown()
        for microbatches in (2, 4):
            engine = DistributedEngine.create(
                EngineConfig(
                    model=model_string,
                    device="cpu",
                    dtype=dtype,
                    collective_timeout_s=120,
                    pipeline_microbatches=microbatches,
                )
            )
            try:
                got = _score(engine, seqs, routing)
            finally:
                engine.shutdown()
            for i, result in enumerate(got):
                _assert_identical(result, alone[i], f"{microbatches} microbatches, sequence {i}")


def test_without_batch_invariance_a_short_sequence_alone_rounds_differently():
    """The control: the same engine with ``batch_invariant=False`` differs for a sequence
    of two tokens alone vs packed (the matrix-vector path of the CPU BLAS), so the test
    above measures the padding, not luck."""
    from megascore.engine.runtime import DistributedEngine

    rng = np.random.default_rng(3)
    with one_rank_world():
        engine = DistributedEngine.create(
            EngineConfig(model="tiny", device="cpu", batch_invariant=False)
        )
        try:
            vocab = engine.info().vocab_size
            others = [Sequence.draw(rng, n, vocab) for n in (300, 200, 100)]
            differs = 0
            for _ in range(10):
                short = Sequence.draw(rng, 2, vocab)
                alone = _score(engine, [short], False)[0]["logprobs"]
                packed = _score(engine, [*others, short], False)[-1]["logprobs"]
                differs += int(not np.array_equal(alone, packed))
        finally:
            engine.shutdown()
    assert differs > 0
