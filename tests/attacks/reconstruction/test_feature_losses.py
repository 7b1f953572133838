"""The feature-inversion objective's terms and its convergence measure, by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from privfedcal.attacks.reconstruction.feature_losses import (
    BNPrior,
    raw_loss,
    relative_feature_error,
    stats_loss,
)


def test_relative_feature_error_by_hand():
    z = torch.tensor([[[3.0, 4.0], [1.0, 0.0]]])  # (R=1, B=2, d=2)
    t = torch.tensor([[3.0, 0.0], [1.0, 0.0]])
    assert float(relative_feature_error(z, per_image=t)[0]) == pytest.approx(4 / 3)
    mu = torch.tensor([2.0, 2.0])  # batch mean is (2, 2): error 0
    assert float(relative_feature_error(z, mu=mu)[0]) == pytest.approx(0.0)
    cov = torch.tensor([[2.0, 4.0], [4.0, 8.0]])  # the batch's unbiased covariance
    assert float(relative_feature_error(z, mu=mu, cov=cov)[0]) == pytest.approx(0.0, abs=1e-6)
    err = float(relative_feature_error(z, mu=mu, cov=2 * cov)[0])
    assert err == pytest.approx(0.5)  # ||S - 2S|| / ||2S||


def test_raw_loss_by_hand_and_padding_ignored():
    t = torch.tensor([[3.0, 4.0]])                       # (B=1, d=2), ||t||^2 = 25
    assert float(raw_loss(t[None], t)[0]) == pytest.approx(0.0)
    # twice the target: cos = 1, squared error relative to ||t||^2 = 1
    assert float(raw_loss(2 * t[None], t)[0]) == pytest.approx(1.0)
    # a padding image (valid False) adds nothing, whatever it holds
    z = torch.tensor([[[3.0, 4.0], [-9.0, 1.0]]])        # (R=1, B=2, d)
    targets = torch.tensor([[3.0, 4.0], [1.0, 1.0]])
    assert float(raw_loss(z, targets, torch.tensor([[True, False]]))[0]) == pytest.approx(0.0)


def test_stats_loss_is_zero_at_the_batch_statistics_and_grows_off_them():
    z = torch.tensor([[[3.0, 4.0], [1.0, 0.0]]])         # mean (2, 2), unbiased cov below
    mu, cov = torch.tensor([2.0, 2.0]), torch.tensor([[2.0, 4.0], [4.0, 8.0]])
    assert float(stats_loss(z, mu, cov)[0]) == pytest.approx(0.0, abs=1e-6)
    # covariance twice the batch's: cov term ||S - 2S||^2 / ||2S||^2 = 1/4
    assert float(stats_loss(z, mu, 2 * cov)[0]) == pytest.approx(0.25)


def test_bn_prior_by_hand_and_grouped_by_index_as_by_shape():
    bn = nn.BatchNorm1d(2)
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([1.0, 0.0]))
        bn.running_var.copy_(torch.tensor([1.0, 4.0]))
    bn.eval()
    model = nn.Sequential(bn)
    x = torch.tensor([[[0.0], [2.0]], [[2.0], [2.0]], [[5.0], [1.0]], [[7.0], [3.0]]])  # (4, 2, 1)
    prior = BNPrior(model, per_group=2)
    model(x)
    loss = prior.pop()
    # group 0: mean (1, 2), biased var (1, 0) -> ||(0, 2)|| + ||(0, -4)|| = 6
    # group 1: mean (6, 2), var (1, 1) -> ||(5, 2)|| + ||(0, -3)|| = sqrt(29) + 3
    assert loss.tolist() == pytest.approx([6.0, 29 ** 0.5 + 3])
    prior.group_ids, prior.groups = torch.tensor([0, 0, 1, 1]), 2
    model(x)
    assert prior.pop().tolist() == pytest.approx(loss.tolist())
    prior.remove()
    model(x)
    assert prior.pop() is None
