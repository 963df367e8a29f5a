"""The trainer-shaped adapters on the real model (shared ``--nproc 1`` server).

A real model's logprobs depend on every earlier token, so a pad token sent or a row
shifted by the left padding of verl's prompts changes them. Each padded result must
equal the client scoring the unpadded sequences directly, placed where the layout says.
"""

from __future__ import annotations

import numpy as np

from megascore_client import ScoringClient
from testkit.reference import VOCAB

PAD = 3  # a real token id as padding


def test_nemo_rl_and_verl_layouts_match_direct_scoring(tp1):
    rng = np.random.default_rng(11)
    with ScoringClient(tp1.target) as client:
        # NeMo-RL: right-padded [4, 12] with an empty row.
        lengths = np.array([12, 5, 0, 9])
        ids = np.full((4, 12), PAD, dtype=np.int64)
        for b, n in enumerate(lengths):
            ids[b, :n] = rng.integers(0, VOCAB, n)
        padded = client.score_padded(ids, lengths)
        direct = client.score([ids[b, :n] for b, n in enumerate(lengths) if n]).logprobs
        expected = np.zeros((4, 12), dtype=np.float32)
        for b, row in zip([0, 1, 3], direct, strict=True):
            expected[b, : len(row)] = row
        np.testing.assert_allclose(padded, expected, rtol=0, atol=1e-5)

        # verl: left-padded prompts [4, 7] + right-padded responses [4, 6].
        prompt_lens, response_lens = [7, 2, 4, 0], [6, 3, 0, 5]
        input_ids = np.full((4, 13), PAD, dtype=np.int64)
        mask = np.zeros((4, 13), dtype=np.int64)
        sequences = []
        for b, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
            seq = rng.integers(0, VOCAB, p + r)
            input_ids[b, 7 - p : 7 + r] = seq
            mask[b, 7 - p : 7 + r] = 1
            sequences.append(seq)
        got = client.score_responses(input_ids, mask, input_ids[:, 7:])
        direct = client.score([s for s in sequences if len(s)]).logprobs
        expected = np.zeros((4, 6), dtype=np.float32)
        for b, row in zip([0, 1, 2, 3], direct, strict=True):
            expected[b, : response_lens[b]] = row[prompt_lens[b] :]
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
        assert (got[2] == 0).all() and got[3, 0] == 0.0 and (got[0] != 0).all()
