"""World-size-1 checks of DistributedEngine (run under torchrun --nproc-per-node 1).

``DistributedEngine.create`` initialises torch.distributed from torchrun's
environment itself. Results: ``OUT_DIR/single_checks.json`` (check -> "ok" or a
traceback) and reference outputs ``OUT_DIR/single_seed1234`` / ``single_seed7``
(.npz/.json) that the multi-rank launch is compared with.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from engine_common import TOP_K, CheckLog, edge_case_batch, save_output

from megascore.api.errors import CheckpointError, InvalidRequestError
from megascore.api.losses import loss_names
from megascore.api.types import ScoreBatch
from megascore.config import EngineConfig
from megascore.engine.runtime import DistributedEngine

ATOL = 1e-5


def sequence_slice(batch: ScoreBatch, i: int) -> ScoreBatch:
    off = batch.offsets()
    s, e = int(off[i]), int(off[i + 1])
    return dataclasses.replace(
        batch,
        token_ids=batch.token_ids[s:e],
        lengths=batch.lengths[i : i + 1],
        loss_mask=batch.loss_mask[s:e],
        temperature=batch.temperature[i : i + 1],
        target_ids=batch.target_ids[s:e],
        rollout_logprobs=batch.rollout_logprobs[s:e],
    )


def check_info(engine):
    info = engine.info()
    assert info.name == "tiny" and info.vocab_size == 512 and info.max_sequence_length == 1024
    assert info.num_parameters == sum(p.numel() for p in engine.loaded.model.parameters())
    assert info.loss_names == loss_names() and info.attention_backend == "torch"
    assert info.weights_version == "builtin:tiny@1234", info.weights_version
    assert info.moe_metric_names == () and info.mtp_metric_names == ()


def check_batch_composition_does_not_matter(engine, batch, out):
    off = batch.offsets()
    for i in range(batch.num_sequences):
        alone = engine.score(sequence_slice(batch, i))
        s, e = int(off[i]), int(off[i + 1])
        np.testing.assert_allclose(alone.logprobs, out.logprobs[s:e], rtol=0, atol=ATOL)
        np.testing.assert_allclose(alone.top_k_logprobs, out.top_k_logprobs[s:e], rtol=0, atol=ATOL)
        np.testing.assert_array_equal(alone.top_k_ids, out.top_k_ids[s:e])
        for name in ("entropy", "target_logprobs"):
            got, want = getattr(alone, name), getattr(out, name)[s:e]
            np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=name)
        for name, value in out.mismatch.items():
            np.testing.assert_allclose(alone.mismatch[name], value[i : i + 1], rtol=0, atol=ATOL)
        for name, value in out.losses.items():
            np.testing.assert_allclose(alone.losses[name], value[i : i + 1], rtol=1e-6, atol=ATOL)
        assert alone.num_loss_tokens[0] == out.num_loss_tokens[i]


def check_matches_unpacked_forward(engine, batch, out):
    """Each sequence through the model alone, unpacked (plain causal attention)."""
    model = engine.loaded.model
    off = batch.offsets()
    for i in range(batch.num_sequences):
        s, e = int(off[i]), int(off[i + 1])
        ids = torch.from_numpy(batch.token_ids[s:e])[None]
        with torch.no_grad():
            logits = model(
                input_ids=ids, position_ids=torch.arange(e - s)[None], attention_mask=None
            )[0]  # [L, V]
        lsm = torch.log_softmax(logits.double() / float(batch.temperature[i]), dim=-1)
        want = np.zeros(e - s)
        want[1:] = lsm[:-1].gather(-1, ids[0, 1:, None])[:, 0].numpy()
        np.testing.assert_allclose(out.logprobs[s:e], want, rtol=0, atol=ATOL)
        top_vals, top_ids = torch.topk(lsm[:-1], TOP_K, dim=-1)
        assert (out.top_k_ids[s] == -1).all() and (out.top_k_logprobs[s] == 0).all()
        np.testing.assert_allclose(out.top_k_logprobs[s + 1 : e], top_vals, rtol=0, atol=ATOL)
        np.testing.assert_array_equal(out.top_k_ids[s + 1 : e], top_ids.numpy())


def check_losses_and_layout(batch, out):
    off = batch.offsets()
    assert out.logprobs.dtype == np.float32 and out.logprobs.shape == (batch.num_tokens,)
    assert out.top_k_ids.dtype == np.int64 and out.top_k_ids.shape == (batch.num_tokens, TOP_K)
    assert (out.logprobs[off[:-1]] == 0).all()
    assert (out.logprobs[np.setdiff1d(np.arange(batch.num_tokens), off[:-1])] < 0).all()
    mask = batch.loss_mask.astype(np.float64)
    mask[off[:-1]] = 0
    nll = -np.add.reduceat(out.logprobs.astype(np.float64) * mask, off[:-1])
    count = np.add.reduceat(mask, off[:-1])
    np.testing.assert_array_equal(out.num_loss_tokens, count.astype(np.int64))
    np.testing.assert_allclose(out.losses["nll"], nll, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(out.losses["mean_nll"], nll / np.maximum(count, 1), rtol=1e-9)
    assert out.weights_version == "builtin:tiny@1234"


def check_output_switches(engine, batch, out):
    lean = engine.score(dataclasses.replace(batch, return_logprobs=False, top_k=0))
    assert lean.logprobs is None and lean.top_k_ids is None and lean.top_k_logprobs is None
    np.testing.assert_allclose(lean.losses["nll"], out.losses["nll"], rtol=0, atol=1e-9)
    nothing = engine.score(dataclasses.replace(batch, return_logprobs=False, top_k=0, losses=()))
    assert nothing.logprobs is None and nothing.losses == {}
    np.testing.assert_array_equal(nothing.num_loss_tokens, out.num_loss_tokens)
    plain = engine.score(dataclasses.replace(batch, temperature=None, loss_mask=None, top_k=64))
    assert plain.top_k_ids.shape == (batch.num_tokens, 64)
    # A dense model has no MoE / MTP metrics: asking is refused like routing is, naming
    # the option (docs/client.md), and the engine keeps scoring.
    for option in ("return_moe_metrics", "return_mtp_metrics"):
        try:
            engine.score(dataclasses.replace(batch, **{option: True}))
        except InvalidRequestError as e:
            assert f"options.{option}: the served model has no" in str(e), e
        else:
            raise AssertionError(f"{option} on a dense model was not refused")
    np.testing.assert_array_equal(engine.score(batch).logprobs, out.logprobs)


def check_invalid_batches_raise_before_any_collective(engine, batch):
    for bad in (
        dataclasses.replace(batch, token_ids=np.full(batch.num_tokens, 512)),
        dataclasses.replace(batch, top_k=257),  # max_top_k 256
        dataclasses.replace(batch, target_ids=np.zeros((batch.num_tokens, 257), np.int64)),
        dataclasses.replace(batch, rollout_logprobs=np.full(batch.num_tokens, np.nan)),
        dataclasses.replace(batch, losses=("bogus",)),
        ScoreBatch(token_ids=np.zeros(1025, np.int64), lengths=np.array([1025])),
        dataclasses.replace(batch, temperature=np.zeros(batch.num_sequences, np.float32)),
        dataclasses.replace(batch, lengths=batch.lengths + 1),
    ):
        try:
            engine.score(bad)
        except InvalidRequestError:
            pass
        else:
            raise AssertionError(f"no InvalidRequestError for {bad}")


def check_reload(engine, batch, out, out_dir):
    version = engine.load_weights("builtin:tiny@7", "")
    assert version == "builtin:tiny@7" and engine.info().weights_version == version
    out7 = engine.score(batch)
    assert out7.weights_version == version
    assert np.abs(out7.logprobs - out.logprobs).max() > 1e-3
    save_output(out_dir / "single_seed7", out7)
    for bad, error in (("hf:/nonexistent", CheckpointError), ("tiny-moe@1", InvalidRequestError)):
        try:
            engine.load_weights(bad, "x")
        except error:
            pass
        else:
            raise AssertionError(f"load_weights({bad!r}) did not raise {error.__name__}")
    again = engine.score(batch)  # failed loads kept the seed-7 weights
    assert again.weights_version == version
    np.testing.assert_array_equal(again.logprobs, out7.logprobs)
    assert engine.load_weights("tiny@1234", "v-back") == "v-back"
    back = engine.score(batch)
    np.testing.assert_array_equal(back.logprobs, out.logprobs)


def check_shutdown(engine):
    engine.shutdown()
    assert not dist.is_initialized()  # create() initialised it, shutdown destroys it
    engine.shutdown()  # idempotent


def main(out_dir: Path) -> None:
    log = CheckLog(out_dir / "single_checks.json")
    engine = DistributedEngine.create(EngineConfig(model="tiny", collective_timeout_s=60))
    batch = edge_case_batch()
    out = engine.score(batch)
    save_output(out_dir / "single_seed1234", out)
    log.run("info", check_info, engine)
    log.run("losses_and_layout", check_losses_and_layout, batch, out)
    log.run("matches_unpacked_forward", check_matches_unpacked_forward, engine, batch, out)
    log.run("batch_composition", check_batch_composition_does_not_matter, engine, batch, out)
    log.run("output_switches", check_output_switches, engine, batch, out)
    log.run("invalid_batches", check_invalid_batches_raise_before_any_collective, engine, batch)
    log.run("reload", check_reload, engine, batch, out, out_dir)
    log.run("shutdown", check_shutdown, engine)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
