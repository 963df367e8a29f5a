"""``examples/grpo_loop.py --launch`` end to end (issues 14, 25): two policy replicas and a
reference server, 3 GRPO steps.

The example's own numbers are checked: after every ``push_weights`` the policy
server's logprobs of the sampled rollouts equal the trainer's (<= 1e-4), the first
importance ratios of each step are 1 (old-policy logprobs from the server = the
trainer's), the reference server keeps the initial weights (KL 0 and old == reference
at step 0, KL > 0 after training), versions advance, and the whole run (server start
included) stays under 2 minutes.
"""

from __future__ import annotations

import pytest

from tests.e2e.serve import run_example

pytestmark = pytest.mark.timeout(300)


def test_grpo_example_runs_with_train_score_parity():
    steps, elapsed = run_example("grpo_loop.py", "--steps", "3")
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert [s["weights_version"] for s in steps] == ["grpo-step0", "grpo-step1", "grpo-step2"]
    for s in steps:
        assert s["train_score_parity"] <= 1e-4, s
        assert s["ratio_mean_dev_first"] <= 1e-4, s  # old-policy logprobs = the trainer's
        assert s["ratio_mean_dev_last"] > 1e-3, s  # the optimizer step moved the policy
        assert s["push_mb_per_s"] > 0
    assert steps[0]["old_vs_ref_max"] <= 1e-4 and abs(steps[0]["kl_to_reference"]) <= 1e-6
    assert steps[2]["old_vs_ref_max"] > 1e-3 and steps[2]["kl_to_reference"] > 1e-4
    assert elapsed < 120, f"the GRPO example took {elapsed:.0f} s"
