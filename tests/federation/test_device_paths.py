"""The GPU-path helpers, run on the CPU: precision choice, epoch-wise augmentation draws."""

from __future__ import annotations

import torch

from privfedcal.data.augment import apply_augmentation, augment_batch, draw_augmentation
from privfedcal.federation.local import MIXED_PRECISION_MIN_PARAMS, choose_mixed_precision


def test_mixed_precision_by_setting_and_model_size() -> None:
    small = torch.nn.Linear(10, 10)  # 110 parameters
    big = torch.nn.Linear(MIXED_PRECISION_MIN_PARAMS, 1)  # exactly the threshold + 1 bias
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not choose_mixed_precision(small, cuda, "auto")
    assert choose_mixed_precision(big, cuda, "auto")
    assert choose_mixed_precision(small, cuda, "bf16")
    assert not choose_mixed_precision(big, cuda, "fp32")
    assert not any(choose_mixed_precision(m, cpu, s) for m in (small, big)
                   for s in ("auto", "bf16", "fp32"))


def test_epoch_draws_sliced_per_batch_equal_whole_batch_augmentation() -> None:
    x = torch.randn(10, 3, 6, 6, generator=torch.Generator().manual_seed(0))
    whole = augment_batch(x, torch.Generator().manual_seed(4))
    draws = draw_augmentation(10, torch.Generator().manual_seed(4))
    parts = [apply_augmentation(x[s:s + 4], tuple(d[..., s:s + 4] for d in draws))
             for s in range(0, 10, 4)]
    assert torch.equal(torch.cat(parts), whole)
