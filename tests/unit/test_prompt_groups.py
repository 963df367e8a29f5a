"""Groups on the wire (``ScoreRequest.groups``): the client finds consecutive sequences
sharing a prompt and sends it once; the server's expansion gives back exactly the
request sent without groups, and that request is smaller."""

from __future__ import annotations

import numpy as np
import pytest

from megascore.api import prompt_groups
from megascore_client.inputs import make_batch
from megascore_client.splitting import ScoreOptions, build_parts
from megascore_server.prompt_expansion import expand_groups


def _groups(spec, make) -> list[np.ndarray]:
    """Per sequence of groups ``spec`` (``(prompt length, [continuation lengths])`` each),
    rows from ``make(n)``; the sequences of a group share their prompt's rows."""
    seqs = []
    for prompt_len, conts in spec:
        prompt = make(prompt_len)
        seqs += [np.concatenate([prompt, make(n)]) for n in conts]
    return seqs


SPEC = [(40, [5, 0, 9]), (3, [4, 4]), (0, [30]), (20, [1]), (64, [12, 7, 33, 2])]


def test_find_groups_and_the_wire_rows_round_trip():
    rng = np.random.default_rng(0)
    seqs = _groups(SPEC, lambda n: rng.integers(0, 1000, n))
    ids, lengths = np.concatenate(seqs), np.array([len(s) for s in seqs])
    sizes, prompts = prompt_groups.find_groups(lengths, [ids])
    # a prompt of 3 tokens is not worth a group (< MIN_SHARED_PROMPT); a group of one has
    # no prompt; a continuation may be empty (the sequence is its prompt)
    np.testing.assert_array_equal(sizes, [3, 1, 1, 1, 1, 4])
    assert prompts[0] >= 40 and prompts[-1] >= 64 and not prompts[1:-1].any()
    keep = prompt_groups.wire_rows(lengths, sizes, prompts)
    assert keep.sum() == ids.size - 2 * prompts[0] - 3 * prompts[-1]
    index = prompt_groups.expand_index(lengths, sizes, prompts)
    np.testing.assert_array_equal(ids[keep][index], ids)


def test_no_groups_without_a_shared_prompt():
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 1000, n) for n in (20, 30, 25)]
    lengths = np.array([len(s) for s in seqs])
    assert prompt_groups.find_groups(lengths, [np.concatenate(seqs)]) is None


def test_a_group_keeps_its_prompt_when_a_later_sequence_shares_less():
    """Joining a sequence that shares only part of the prompt would save fewer tokens:
    it opens a new group."""
    base = np.arange(100)
    seqs = [base, np.r_[base[:90], [5]], np.r_[base[:20], [7, 7]]]
    lengths = np.array([len(s) for s in seqs])
    sizes, prompts = prompt_groups.find_groups(lengths, [np.concatenate(seqs)])
    np.testing.assert_array_equal(sizes, [2, 1])
    np.testing.assert_array_equal(prompts, [90, 0])


def test_a_prompt_is_shared_only_where_every_per_token_array_agrees():
    """The same tokens with another loss mask (or target ids, ...) are not the same
    prompt on the wire: the shared prefix ends where any array differs."""
    ids = np.tile(np.arange(50), 3)
    lengths = np.array([50, 50, 50])
    mask = np.ones(150, np.uint8)
    mask[50 + 30] = 0  # the second sequence's mask differs at position 30
    mask[100 + 5] = 0  # the third's at position 5: too short a prefix to share
    sizes, prompts = prompt_groups.find_groups(lengths, [ids, mask])
    np.testing.assert_array_equal(sizes, [2, 1])
    np.testing.assert_array_equal(prompts, [30, 0])


@pytest.mark.parametrize("split", [False, True])
def test_server_expands_the_client_request_to_the_one_without_groups(split):
    """Every per-token array (ids, mask, target ids, rollout logprobs, routing) goes
    compacted and comes back exact; a split call groups within each part."""
    rng = np.random.default_rng(2)
    spec = SPEC * 3
    seqs = _groups(spec, lambda n: rng.integers(0, 1000, n))
    masks = _groups(spec, lambda n: rng.integers(0, 2, n))
    rollout = _groups(spec, lambda n: rng.normal(size=n))
    targets = _groups(spec, lambda n: rng.integers(0, 1000, (n, 2)))
    routing = _groups(spec, lambda n: rng.integers(0, 8, (n, 3, 2)))
    masks[1] = masks[1].copy()
    masks[1][3] ^= 1  # inside its group's prompt: this sequence cannot share it
    batch = make_batch(
        seqs, loss_mask=masks, rollout_logprobs=rollout, target_ids=targets, routing=routing
    )
    limit = 24_000 if split else 1 << 30
    options = ScoreOptions(top_k=2)
    whole = build_parts(batch, options, "r", max_message_bytes=limit, groups=False)
    sent = build_parts(batch, options, "r", max_message_bytes=limit, groups=True)
    assert len(sent) == len(whole) > (1 if split else 0)
    assert sum(p.request.ByteSize() for p in sent) < 0.8 * sum(p.request.ByteSize() for p in whole)
    for part, plain in zip(sent, whole, strict=True):
        if not part.request.HasField("groups"):  # a part without a shared prompt
            assert part.request == plain.request
            continue
        assert part.request.ByteSize() < plain.request.ByteSize()
        lengths = np.frombuffer(part.request.lengths.data, np.int64)
        assert expand_groups(part.request, lengths) == plain.request
    assert sum(p.request.HasField("groups") for p in sent) >= (3 if split else 1)
