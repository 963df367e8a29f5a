"""Issue 20: a checkpoint's model draws no random weights.

Start-up from ``hf:`` and ``megatron:``: no random-number op runs while the model is
built and loaded (a ``TorchFunctionMode`` counts every random op torch is asked for; the
built-in model, which does draw, shows the count works), and the logprobs equal
transformers' on the checkpoint's weights. (LoadWeights in place:
``test_engine_reload_in_place.py``.)
"""

from __future__ import annotations

import numpy as np
import pytest
from torch.overrides import TorchFunctionMode

from megascore.checkpoint.megatron_ckpt import save_checkpoint
from megascore.config import EngineConfig
from megascore.engine.weights.served_model import load_served_model
from testkit.checkpoints import megatron_logprobs, token_batch

TOL = 1e-4
_RANDOM_OPS = {
    "normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_",
    "cauchy_", "log_normal_", "randn", "rand", "randint", "randperm", "normal",
    "bernoulli", "multinomial", "randn_like", "rand_like", "randint_like",
}  # fmt: skip


class RandomOps(TorchFunctionMode):
    """Counts the random-number ops torch is asked for (functions and tensor methods)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _RANDOM_OPS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _reference(directory) -> np.ndarray:
    return np.load(directory / "reference.npy")


def test_builtin_model_draws_its_weights(pgs):
    """The counter sees the draws a built-in makes (so a zero below means none)."""
    with RandomOps() as ops:
        load_served_model("tiny", EngineConfig(device="cpu"), pgs)
    assert len(ops.calls) > 0


@pytest.mark.parametrize("kind", ["hf", "megatron"])
def test_no_random_draw_when_a_checkpoint_follows(hf_dirs, pgs, tmp_path, kind):
    engine_cfg = EngineConfig(device="cpu")
    model = f"hf:{hf_dirs['llama']}"
    if kind == "megatron":
        source = load_served_model(model, engine_cfg, pgs)
        save_checkpoint(source.model, source.config, tmp_path / "mg")
        model = f"megatron:{tmp_path / 'mg'}"
    with RandomOps() as ops:
        loaded = load_served_model(model, engine_cfg, pgs)
    assert ops.calls == []
    got = megatron_logprobs(loaded.model, token_batch(), pgs.tp)
    assert np.abs(got - _reference(hf_dirs["llama"])).max() <= TOL
