"""Issue 20 item 6: the load-time sum of the parameter count over the pipeline stages runs
on the default group (start-up timeout), not on the PP group, whose timeout is the step
collective timeout (120 s by default) while stages finish loading minutes apart."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from megascore.engine.weights.served_model import count_parameters


def test_stage_sum_runs_on_the_default_group(pgs, monkeypatch):
    groups = []
    real = dist.all_reduce

    def spy(tensor, *args, group=None, **kwargs):
        groups.append(group)
        return real(tensor, *args, group=group, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", spy)
    model = torch.nn.Linear(3, 2, bias=False)
    one_stage = SimpleNamespace(pp=None, tp=None, ep=None, expt_tp=None)
    assert count_parameters(model, one_stage) == 6 and groups == []
    # two stages of one rank each, as this one-rank world's default group sums them
    two_stages = SimpleNamespace(pp=SimpleNamespace(size=lambda: 2), tp=None, ep=None, expt_tp=None)
    assert count_parameters(model, two_stages) == 12
    assert groups == [dist.group.WORLD]
