"""Expected values computed without the server: the engine in this process, and SDK helpers.

:func:`engine_outputs` builds :class:`~megascore.engine.runtime.DistributedEngine` on a
world-size-1 gloo group inside the test process (the same model string and seed as the
servers) and scores the batches directly, no gRPC, no batcher.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megascore.api.types import ScoreBatch, ScoreOutput
from megascore.config import EngineConfig

VOCAB = 512  # the built-in tiny model
WEIGHTS = "builtin:tiny@1234"
LOSSES = ("nll", "mean_nll")
ATOL = 1e-5  # TP=2 vs TP=1 vs in-process: fp32 reductions in a different order


@dataclasses.dataclass(frozen=True)
class Case:
    """One scoring call: sequences plus options, as the SDK takes them."""

    sequences: list[list[int]]
    top_k: int = 0
    temperature: float = 1.0
    loss_mask: list[list[int]] | None = None

    def batch(self) -> ScoreBatch:
        lengths = np.array([len(s) for s in self.sequences], dtype=np.int64)
        mask = None
        if self.loss_mask is not None:
            mask = np.concatenate([np.asarray(m, dtype=np.uint8) for m in self.loss_mask])
        return ScoreBatch(
            token_ids=np.concatenate([np.asarray(s, dtype=np.int64) for s in self.sequences]),
            lengths=lengths,
            loss_mask=mask,
            temperature=np.full(lengths.size, self.temperature, dtype=np.float32),
            top_k=self.top_k,
            losses=LOSSES,
        )

    def score(self, client, **kw):
        """Scores this case with a sync SDK client."""
        return client.score(
            self.sequences,
            loss_mask=self.loss_mask,
            top_k=self.top_k,
            temperature=self.temperature,
            losses=LOSSES,
            **kw,
        )


def sample_cases(seed: int = 0) -> list[Case]:
    """Edge cases: length-1 sequences, one long, many short, a mask, top-k, temperatures."""
    rng = np.random.default_rng(seed)

    def seqs(*lengths: int) -> list[list[int]]:
        return [rng.integers(0, VOCAB, n).tolist() for n in lengths]

    masked = seqs(9, 4)
    return [
        Case(seqs(7, 1, 12, 4), top_k=3),
        Case(seqs(1)),
        Case(seqs(200, 3, 1, 64, 17), top_k=8, temperature=0.7),
        Case(masked, top_k=2, loss_mask=[[1, 1, 0, 0, 1, 1, 1, 0, 1], [0, 1, 1, 0]]),
        Case(seqs(*([2] * 24)), temperature=1.5),
    ]


def engine_outputs(batches: list[ScoreBatch], model: str = "tiny") -> list[ScoreOutput]:
    """Scores ``batches`` with a world-size-1 DistributedEngine built in this process."""
    import torch.distributed as dist

    from megascore.engine.runtime import DistributedEngine

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        engine = DistributedEngine.create(
            EngineConfig(model=model, device="cpu", collective_timeout_s=120)
        )
        try:
            return [engine.score(batch) for batch in batches]
        finally:
            engine.shutdown()
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def split(flat: np.ndarray, lengths) -> list[np.ndarray]:
    """Cuts a flat per-token array into per-sequence pieces."""
    return np.split(np.asarray(flat), np.cumsum(lengths)[:-1])


def assert_result_matches_output(result, case: Case, out: ScoreOutput, atol: float = ATOL):
    """An SDK ``ScoreResult`` equals the engine's ``ScoreOutput`` of the same case."""
    lengths = [len(s) for s in case.sequences]
    assert result.weights_version == out.weights_version == WEIGHTS
    np.testing.assert_array_equal(result.lengths, lengths)
    for i, want in enumerate(split(out.logprobs, lengths)):
        assert result.logprobs[i].dtype == np.float32 and result.logprobs[i].shape == want.shape
        np.testing.assert_allclose(result.logprobs[i], want, rtol=0, atol=atol)
    assert result.top_k == case.top_k
    if case.top_k:
        for i, (ids, lps) in enumerate(
            zip(split(out.top_k_ids, lengths), split(out.top_k_logprobs, lengths), strict=True)
        ):
            assert_top_k_close(result.top_k_ids[i], result.top_k_logprobs[i], ids, lps, atol)
    for name in LOSSES:
        np.testing.assert_allclose(result.loss[name], out.losses[name], rtol=1e-5, atol=atol)
    np.testing.assert_array_equal(result.num_tokens, out.num_loss_tokens)


def assert_top_k_close(ids_a, lps_a, ids_b, lps_b, atol: float) -> None:
    """Top-k of one sequence agree: values within ``atol``, ids equal except at near-ties.

    The tiny random model has logits that differ by less than fp32 reduction noise, so
    two layouts (TP=1 / TP=2) may order such a pair differently or swap the k-th id.
    With ``atol`` 0 the ids must be identical.
    """
    assert ids_a.shape == ids_b.shape == lps_a.shape == lps_b.shape
    np.testing.assert_allclose(lps_a, lps_b, rtol=0, atol=atol)
    for row, col in zip(*np.nonzero(ids_a != ids_b), strict=True):
        theirs = dict(zip(ids_b[row].tolist(), lps_b[row].tolist(), strict=True))
        mine = int(ids_a[row, col])
        # the id is elsewhere in the other row with the same value, or it replaced the
        # other row's k-th entry with (nearly) the same value
        other = theirs.get(mine, float(lps_b[row, -1]))
        assert abs(float(lps_a[row, col]) - other) <= 2 * atol, (
            f"top-k position {row}: id {mine} ({lps_a[row, col]}) is not a near-tie "
            f"(ids {ids_a[row]} vs {ids_b[row]})"
        )


def assert_results_equal(a, b, atol: float = 0.0) -> None:
    """Two SDK results of the same case agree (bit for bit when ``atol`` is 0)."""
    assert len(a.logprobs) == len(b.logprobs)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)
    assert a.top_k == b.top_k
    if a.top_k:
        for ids_a, lps_a, ids_b, lps_b in zip(
            a.top_k_ids, a.top_k_logprobs, b.top_k_ids, b.top_k_logprobs, strict=True
        ):
            assert_top_k_close(ids_a, lps_a, ids_b, lps_b, atol)
    assert a.loss.keys() == b.loss.keys()
    for name in a.loss:
        np.testing.assert_allclose(a.loss[name], b.loss[name], rtol=atol and 1e-5, atol=atol)
    np.testing.assert_array_equal(a.num_tokens, b.num_tokens)


def softmax_attention(q, k, v, mask, scale):
    """float64 softmax attention and log-sum-exps: ``q`` ``[n, heads, q_len, dim]``, ``k`` /
    ``v`` ``[n, groups, k_len, dim]`` (GQA), ``mask`` bool ``[q_len, k_len]`` (True: attend).

    Returns:
        ``(out [n, heads, q_len, v_dim], lse [n, heads, q_len])``, float64.
    """
    import torch

    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = q.double() @ k.transpose(-1, -2) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v, torch.logsumexp(scores, -1)
