"""attacks/reconstruction/modes.py: eval_mode puts every submodule in eval mode and restores each one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from privfedcal.attacks.reconstruction.modes import eval_mode


def _model():
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    m.train()
    m[3].eval()  # a mixed model: one submodule already in eval mode
    return m


def test_eval_mode_freezes_batchnorm_and_dropout_then_restores_each_flag():
    m = _model()
    before = [sub.training for sub in m.modules()]
    bn_mean = m[1].running_mean.clone()
    x = torch.randn(8, 3) * 5 + 3
    with eval_mode(m) as inner:
        assert inner is m and not any(sub.training for sub in m.modules())
        y1, y2 = m(x), m(x)
    assert torch.equal(y1, y2)  # dropout off
    assert torch.equal(m[1].running_mean, bn_mean)  # running statistics untouched
    assert [sub.training for sub in m.modules()] == before == [True, True, True, True, False]


def test_eval_mode_restores_on_error():
    m = _model()
    with pytest.raises(RuntimeError, match="boom"), eval_mode(m):
        raise RuntimeError("boom")
    assert [sub.training for sub in m.modules()] == [True, True, True, True, False]
