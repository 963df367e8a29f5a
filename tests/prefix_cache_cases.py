"""Workloads for the prefix-cache tests: requests that repeat earlier requests' prefixes.

* turn by turn: trajectories that share a system prompt, each turn a request carrying the
  whole history (``score_from`` at the new turn for some, whole for others);
* GRPO, one response per request: a prompt's responses arrive in separate requests
  (``score_from`` at the response), then the whole group in one request (shared within
  the step);
* a group whose prompt ends on a block boundary, twice;
* interleaved unrelated requests, and a request whose sequence is a whole earlier one
  (it ends on a block boundary).

Every request carries options that change the outputs (top-k, a loss mask, losses,
target ids, rollout logprobs, temperatures), so a stored output that does not belong
would show. :func:`assert_same_outputs` compares two servers' answers bit for bit.
"""

from __future__ import annotations

import numpy as np

from megascore.api.types import ScoreBatch, ScoreOutput

VOCAB = 512
BLOCK = 16  # the tests' attention_block: many blocks in short sequences


def _request(seqs, rng, *, temperature=1.0, score_from=None, **options) -> ScoreBatch:
    lengths = np.array([len(s) for s in seqs], np.int64)
    total = int(lengths.sum())
    return ScoreBatch(
        token_ids=np.concatenate(seqs).astype(np.int64),
        lengths=lengths,
        loss_mask=(rng.random(total) < 0.9).astype(np.uint8),
        temperature=np.full(len(seqs), temperature, np.float32),
        top_k=4,
        losses=("nll", "mean_nll"),
        return_entropy=True,
        target_ids=(np.concatenate(seqs)[:, None] + np.arange(2)) % VOCAB,
        rollout_logprobs=rng.normal(-6.0, 1.0, total),
        score_from=None if score_from is None else np.asarray(score_from, np.int64),
        **options,
    )


def cache_workload(seed: int = 0, **options) -> list[ScoreBatch]:
    """The requests, in the order they are sent (see the module docstring)."""
    rng = np.random.default_rng(seed)

    def tokens(n):
        return rng.integers(1, VOCAB, int(n)).astype(np.int64)

    system = tokens(2 * BLOCK + 5)
    histories = [system.copy() for _ in range(3)]
    requests = []
    for _ in range(4):  # turns
        for t in range(3):
            start = len(histories[t])
            histories[t] = np.concatenate([histories[t], tokens(rng.integers(6, 30))])
            score_from = [start] if t != 1 else None  # trajectory 1 asks for everything
            requests.append(
                _request(
                    [histories[t]],
                    rng,
                    temperature=1.0 + 0.25 * t,
                    score_from=score_from,
                    **options,
                )
            )
        requests.append(_request([tokens(rng.integers(5, 40))], rng, **options))  # unrelated
    prompt = tokens(3 * BLOCK + 2)
    responses = [np.concatenate([prompt, tokens(rng.integers(3, 25))]) for _ in range(4)]
    for response in responses:
        requests.append(_request([response], rng, score_from=[len(prompt)], **options))
    group = [np.concatenate([prompt, tokens(rng.integers(3, 25))]) for _ in range(4)]
    requests.append(_request(group, rng, **options))  # shared within its step
    # a prompt that ends on a block boundary: its last block's last row predicts each
    # response's first token (another one per response); the group twice
    boundary = tokens(3 * BLOCK)
    again = [np.concatenate([boundary, tokens(rng.integers(3, 25))]) for _ in range(4)]
    requests += [_request(again, rng, **options) for _ in range(2)]
    requests.append(_request([histories[0][: 4 * BLOCK]], rng, **options))  # on a boundary
    requests.append(_request([histories[2], histories[0]], rng, **options))  # two cached
    return requests


def host_tier_workload(seed: int = 5) -> list[ScoreBatch]:
    """3 trajectories of 5 blocks and a bit, 3 turns each (a few tokens, outputs from the
    turn on), each turn after the other two trajectories' turns: a device tier of a few
    blocks has evicted its history by then, a host tier behind it still holds it."""
    rng = np.random.default_rng(seed)
    histories = [rng.integers(1, VOCAB, 5 * BLOCK + 3) for _ in range(3)]
    requests = []
    for _ in range(3):
        for t, history in enumerate(histories):
            start = len(history)
            histories[t] = np.r_[history, rng.integers(1, VOCAB, int(rng.integers(5, 20)))]
            lengths = np.array([len(histories[t])])
            requests.append(
                ScoreBatch(histories[t], lengths, top_k=3, score_from=np.array([start]))
            )
    return requests


def assert_same_outputs(got: ScoreOutput, want: ScoreOutput, what: str = "") -> None:
    """Every output of ``got`` equals ``want``'s bit for bit (``cached_tokens`` aside)."""
    assert set(got.values) == set(want.values), (what, set(got.values) ^ set(want.values))
    for name, value in want.values.items():
        if name == "cached_tokens":
            continue
        other = got.values[name]
        if isinstance(value, dict):
            for key in value:
                assert np.array_equal(other[key], value[key]), (what, name, key)
        else:
            assert np.array_equal(other, value), (what, name)
