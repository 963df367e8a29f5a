"""``examples/trl_grpo.py --launch`` end to end (issue 26): TRL's GRPOTrainer, real TRL.

Two 3-step GRPO runs (beta > 0, a toy reward, same seed) of a tiny random Llama saved
with ``save_pretrained``: TRL's local reference model, and megascore's
``MegascoreGRPOTrainer`` whose reference logprobs come from a server serving the
saved weights. Checked per step: the same completions were sampled (some end early:
right padding; prompts of different lengths: left padding), the reference logprobs of
every completion token agree <= 1e-5 and so do the losses; the policy moved (KL > 0
after the first step, so the reference term is in the loss).
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
