"""``examples/trl_grpo.py --launch`` end to end (issue 26): TRL's GRPOTrainer, real TRL.

Two 3-step GRPO runs (beta > 0, a toy reward, same seed) of a tiny random Llama saved
with ``save_pretrained``: TRL's local reference model, and megascore's
``MegascoreGRPOTrainer`` whose reference logprobs come from a server serving the
saved weights. Checked per step: the same completions were sampled (some end early:
right padding; prompts of different lengths: left padding), the reference logprobs of
every completion token agree <= 1e-5 and so do the losses; the policy moved (KL > 0
after the first step, so the reference term is in the loss).

With ``--lora`` (issue 46) both runs train a peft LoRA adapter (TRL's ``peft_config``);
the one server holds the base only, the trainer pushes its adapter before each
generation batch and gets the old policy's and the reference's logprobs in one call:
the served reference equals TRL's (its base) and a local base forward; the served
adapter equals a local transformers + peft forward of the pushed weights (<= 1e-4,
fp32); it equals the base on the first push (LoRA's B is zero) and differs after.
"""

from __future__ import annotations

import pytest

from tests.e2e.serve import run_example

pytestmark = pytest.mark.timeout(300)


def test_trl_grpo_with_a_megascore_reference_matches_the_local_one():
    steps, elapsed = run_example("trl_grpo.py")
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s in steps:
        assert s["same_completions"], s
        assert s["completion_tokens"] > 0
        assert s["ref_logprob_max_abs_diff"] <= 1e-5, s
        assert s["loss_abs_diff"] <= 1e-5, s
    assert any(s["completion_tokens"] < 8 * 8 for s in steps)  # some completions ended early
    assert all(s["kl"] > 1e-3 for s in steps[1:])  # the policy moved: the KL term counts
    assert elapsed < 180, f"the TRL example took {elapsed:.0f} s"


def test_trl_grpo_with_lora_pushes_the_adapter_and_takes_the_base_as_reference():
    """``--lora``: TRL's ``peft_config`` on both runs; one server holding the base, the
    trainer's adapter pushed to it before each generation batch (``push_adapter``)."""
    steps, elapsed = run_example("trl_grpo.py", "--lora")
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s in steps:
        assert s["same_completions"], s
        assert s["completion_tokens"] > 0
        assert not s["local_old_logps"], s  # TRL's own run has no old-policy forward here
        # the served reference is the base: = TRL's (its adapter disabled) and a local base
        assert s["local_ref_vs_base_max_abs_diff"] == 0.0, s
        assert s["ref_logprob_max_abs_diff"] <= 1e-5, s
        assert s["ref_vs_base_max_abs_diff"] <= 1e-5, s
        # the old policy: the pushed adapter on the server = transformers + peft (fp32)
        assert s["policy_vs_peft_max_abs_diff"] <= 1e-4, s
        assert s["loss_abs_diff"] <= 1e-5, s
    # LoRA's B starts at zero: the first push is the base; after a step it moved
    assert steps[0]["policy_vs_reference_max_abs_diff"] <= 1e-5, steps[0]
    assert all(s["policy_vs_reference_max_abs_diff"] > 1e-2 for s in steps[1:]), steps
    assert all(s["kl"] > 1e-3 for s in steps[1:])  # the KL against the served base counts
    assert elapsed < 180, f"the TRL LoRA example took {elapsed:.0f} s"
