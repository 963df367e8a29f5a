"""Two-rank gloo checks of gather_cp_shards and the engine protocol.

Run by tests/distributed/test_primitives.py under torchrun (--nproc-per-node 2).
Each check runs on both ranks; its outcome ("ok" or the traceback) goes to
``OUT_DIR/rank{r}.json``. The process exits non-zero when any check failed.
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megascore.api.types import ScoreBatch
from megascore.engine.layout.packing import pack_sequences
from megascore.engine.ranks.distributed import gather_cp_shards
from megascore.engine.ranks.protocol import (
    Command,
    WeightsMessage,
    recv_command,
    send_batch,
    send_command,
    send_weights,
)
from megascore.engine.weights.push.transfer import recv_parts, send_parts

CPU = torch.device("cpu")
LOSS_REGISTRY = ("nll", "kl", "entropy")
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def expect_value_error(fn, match: str) -> None:
    try:
        fn()
    except ValueError as e:
        assert match in str(e), f"ValueError {e!r} does not mention {match!r}"
    else:
        raise AssertionError(f"expected ValueError mentioning {match!r}")


@check
def gather_cp_shards_matches_single_process_packing(rank, groups):
    lengths = [5, 0, 3, 7]
    ids = torch.arange(1, 16)  # [T], the sequences concatenated
    kwargs = {"pad_individual_seqs_to_multiple_of": 4, "pad_packed_seq_to": 24}
    full = pack_sequences(ids, lengths, **kwargs)
    mine = pack_sequences(ids, lengths, cp_rank=rank, cp_size=2, **kwargs)
    assert mine.input_ids_cp_sharded.shape == (1, 12)
    # local: [1, T/2, 2] per-token values with a trailing dimension
    local = torch.stack([mine.input_ids_cp_sharded.float(), -mine.input_ids_cp_sharded.float()], -1)
    gathered = gather_cp_shards(local, mine.cu_seqlens_padded, groups["pair"])
    expected = torch.stack([full.input_ids.float(), -full.input_ids.float()], -1)
    assert gathered.shape == (1, 24, 2) and torch.equal(gathered, expected)
    # A one-rank CP group returns the input itself.
    alone = groups["self"]
    assert gather_cp_shards(full.input_ids, full.cu_seqlens_padded, alone) is full.input_ids
    # A shard of the wrong size raises on every rank before any collective.
    expect_value_error(
        lambda: gather_cp_shards(local[:, :10], mine.cu_seqlens_padded, groups["pair"]),
        "is not [1, 24 / 2, ...]",
    )


def _full_batch() -> ScoreBatch:
    lengths = np.array([3, 1, 4], np.int64)
    return ScoreBatch(
        token_ids=np.array([5, 9, 2, 7, 1, 1, 3, 8], np.int64),
        lengths=lengths,
        loss_mask=np.array([1, 1, 0, 1, 1, 0, 1, 1], np.uint8),
        temperature=np.array([1.0, 0.5, 2.25], np.float32),
        top_k=4,
        losses=("nll", "kl"),
        return_logprobs=False,
        return_moe_metrics=True,
        return_mtp_metrics=True,
        return_routing=True,
        routing=np.arange(8 * 3 * 2, dtype=np.int16).reshape(8, 3, 2) % 7,
    )


def _minimal_batch() -> ScoreBatch:
    return ScoreBatch(token_ids=np.array([11, 12], np.int64), lengths=np.array([2], np.int64))


def _assert_same_batch(got: ScoreBatch, want: ScoreBatch) -> None:
    for name in ("token_ids", "lengths"):
        value = getattr(got, name)
        assert value.dtype == np.int64 and np.array_equal(value, getattr(want, name)), name
    if want.loss_mask is None:
        assert got.loss_mask is None
    else:
        assert got.loss_mask.dtype == np.uint8 and np.array_equal(got.loss_mask, want.loss_mask)
    if want.temperature is None:
        assert got.temperature is None
    else:
        assert got.temperature.dtype == np.float32
        assert np.array_equal(got.temperature, want.temperature)
    if want.routing is None:
        assert got.routing is None
    else:
        assert got.routing.dtype == np.int32 and np.array_equal(got.routing, want.routing)
    assert got.losses == tuple(sorted(want.losses)), got.losses
    fields = (
        "top_k",
        "return_logprobs",
        "return_moe_metrics",
        "return_mtp_metrics",
        "return_routing",
    )
    for name in fields:
        assert getattr(got, name) == getattr(want, name), name


@check
def protocol_round_trip(rank, groups):
    group = groups["pair"]
    path, version = "/ckpt/модель-β", "v2 ✓"
    if rank == 0:
        bad = ScoreBatch(
            token_ids=np.array([1, 2], np.int64), lengths=np.array([2]), losses=("bogus",)
        )
        # Rejected before any collective: the worker does not see it.
        expect_value_error(
            lambda: send_batch(bad, group, 0, LOSS_REGISTRY, device=CPU), "unknown loss"
        )
        expect_value_error(
            lambda: send_command(Command.FORWARD, group, 0, device=CPU), "send_batch"
        )
        send_batch(_full_batch(), group, 0, LOSS_REGISTRY, device=CPU, step=7)
        send_batch(_minimal_batch(), group, 0, LOSS_REGISTRY, device=CPU, step=8)
        send_command(Command.RELOAD, group, 0, device=CPU, path=path, version=version, step=9)
        send_command(Command.RELOAD, group, 0, device=CPU, step=10)  # empty strings
        send_command(Command.SHUTDOWN, group, 0, device=CPU, step=11)
        return
    received = []
    while True:
        message = recv_command(group, 0, LOSS_REGISTRY, device=CPU)
        received.append(message)
        if message.command == Command.SHUTDOWN:
            break
    assert [m.command for m in received] == [
        Command.FORWARD,
        Command.FORWARD,
        Command.RELOAD,
        Command.RELOAD,
        Command.SHUTDOWN,
    ]
    assert [m.extra.step for m in received] == [7, 8, 9, 10, 11]
    _assert_same_batch(received[0].batch, _full_batch())
    _assert_same_batch(received[1].batch, _minimal_batch())
    command, batch, extra = received[2]
    assert batch is None and (extra.path, extra.version) == (path, version), extra
    empty = received[3]  # a RELOAD without strings
    assert empty.batch is None and (empty.extra.path, empty.extra.version) == ("", "")
    assert received[4].batch is None and received[4].extra.path == ""


@check
def weights_protocol_round_trip(rank, groups):
    """A weight push's messages: a tensor's header (bf16, 0-d, empty) arrives as a meta
    tensor of its shape and dtype; its parts (rows, columns, the whole) follow point to
    point, each as sent, in the order sent."""
    group = groups["pair"]
    bf16 = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16) / 7
    tensors = [("model.embed_tokens.weight", bf16, 2), ("s", torch.tensor(2.5), 0)]
    tensors.append(("empty", torch.empty(0, 3, dtype=torch.float16), 1))
    parts = {"model.embed_tokens.weight": [bf16[1:3], bf16[:, 2:4], bf16], "s": [], "empty": []}
    W = WeightsMessage
    if rank == 0:
        expect_value_error(
            lambda: send_weights(Command.RELOAD, W(), group, 0, device=CPU), "send_batch"
        )
        bad = W(name="ids", tensor=torch.arange(3))
        expect_value_error(
            lambda: send_weights(Command.WEIGHTS_TENSOR, bad, group, 0, device=CPU), "int64"
        )
        send_weights(Command.WEIGHTS_BEGIN, W(names=2), group, 0, device=CPU, step=1)
        for name, tensor, layout in tensors:
            message = W(name=name, tensor=tensor, layout=layout)
            send_weights(Command.WEIGHTS_TENSOR, message, group, 0, device=CPU, step=2)
            sent = send_parts({1: parts[name]}, group)
            assert sent == sum(p.numel() * p.element_size() for p in parts[name])
        commit = W(version="v ✓", partial=True)
        send_weights(Command.WEIGHTS_COMMIT, commit, group, 0, device=CPU, step=3)
        send_weights(Command.WEIGHTS_ABORT, W(), group, 0, device=CPU, step=4)
        return
    got = []
    for _ in range(len(tensors) + 3):
        got.append(recv_command(group, 0, LOSS_REGISTRY, device=CPU))
        w = got[-1].extra.weights
        if got[-1].command == Command.WEIGHTS_TENSOR:
            shapes = [p.shape for p in parts[w.name]]
            received = recv_parts(shapes, w.tensor.dtype, 0, group)
            for a, b in zip(received, parts[w.name], strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), (w.name, a, b)
    expected = [Command.WEIGHTS_BEGIN, *[Command.WEIGHTS_TENSOR] * len(tensors)]
    assert [m.command for m in got] == [*expected, Command.WEIGHTS_COMMIT, Command.WEIGHTS_ABORT]
    assert all(m.batch is None for m in got) and got[0].extra.weights.names == 2
    for m, (name, tensor, layout) in zip(got[1:], tensors, strict=False):
        w = m.extra.weights
        assert (w.name, w.layout, w.tensor.dtype) == (name, layout, tensor.dtype), w
        assert w.tensor.shape == tensor.shape and w.tensor.device.type == "meta", w
    commit = got[-2].extra
    assert commit.version == commit.weights.version == "v ✓" and commit.weights.partial
    assert got[-1].extra.weights == W() and got[-1].extra.step == 4


def main() -> int:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    groups = {"pair": dist.new_group([0, 1])}
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    groups["self"] = singles[rank]
    results = {}
    for fn in CHECKS:
        try:
            fn(rank, groups)
            results[fn.__name__] = "ok"
        except Exception:
            results[fn.__name__] = traceback.format_exc()
        dist.barrier(group=groups["pair"])
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0 if all(v == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
