"""DP-SGD local training inside the federation (``--dp-train``), over ``privacy/dpsgd.py``.

Every selected client runs ``E * round(1/q)`` Poisson-sampled DP-SGD steps (q = B / n_k: one
epoch in expectation per local epoch), with per-sample clipping to ``--dp-grad-clip`` and
noise multiplier planned by the run's accountant with ``--dp-train-share`` of the budget.

Accounting (sample level): an example of client k is touched only by client k's updates, so
its epsilon composes the calibration uploads with client k's DP-SGD steps. We plan the noise
for the client that needs the most (``protection.plan_with_dpsgd``), check every client at
that noise (``verify_clients``), and assume each takes part in every round
(client sampling is not used for amplification: conservative). The Poisson batches and the
noise come from OS entropy (privacy/noise.py), so the server sees neither. The guarantee then covers the
model updates too. Methods whose loss couples samples of a batch (FedUV, MOON's reference
models, proximal terms that opacus would drop) are refused, see ``DPSGD_METHODS``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from privfedcal.privacy.dpsgd import dpsgd_sample_rate, make_private_training


@dataclass(frozen=True)
class DPSGDSpec:
    noise_multiplier: float
    max_grad_norm: float
    seeded: bool = False  # --insecure-seeded-noise: batches and noise from the public seed


def local_steps(n: int, batch_size: int, local_epochs: int) -> int:
    return local_epochs * max(1, round(1 / dpsgd_sample_rate(batch_size, n)))


def client_rates(cfg, exp) -> list[tuple[float, int]]:
    """(sample rate, steps per round) of every client (distinct values)."""
    sizes = sorted({int(p.numel()) for p in exp.parts})
    return [(dpsgd_sample_rate(cfg.batch_size, n), local_steps(n, cfg.batch_size,
                                                               cfg.local_epochs)) for n in sizes]


def verify_clients(cfg, exp, upload_entries, sigma: float, delta: float, target: float) -> None:
    """Every client's examples (uploads + its own DP-SGD steps) must fit the budget."""
    from privfedcal.errors import PrivacyBudgetError
    from privfedcal.privacy.accounting import compute_epsilon

    for q, steps in client_rates(cfg, exp):
        eps = compute_epsilon([*upload_entries, (sigma, q, steps * cfg.rounds)],
                              cfg.accountant, delta)
        if eps > target:
            raise PrivacyBudgetError(f"a client with DP-SGD sample rate {q:.3g} would spend "
                                     f"epsilon {eps:.3f} > {target:g}")


def train_dpsgd(model, algo, x: Tensor, y: Tensor, spec, dp: DPSGDSpec, seed: int) -> float:
    """Run one client's DP-SGD local training on (x, y); returns the mean loss."""
    from privfedcal.data.augment import augment_batch
    from privfedcal.privacy.noise import noise_generator

    # Poisson batches and gradient noise from OS entropy: the server can neither regenerate
    # the noise nor learn the batches (which is what the amplification assumes)
    g = noise_generator(seed, seeded=dp.seeded, device=x.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum)
    pt = make_private_training(model, opt, x, y, noise_multiplier=dp.noise_multiplier,
                               max_grad_norm=dp.max_grad_norm, batch_size=spec.batch_size,
                               generator=g, steps=local_steps(len(x), spec.batch_size,
                                                              spec.local_epochs))
    # the loss is summed on the device and read back once, after the loop (no per-step sync)
    total, steps = torch.zeros((), device=x.device), 0
    # opacus's hooks fire on the first layer, whose inputs need no gradient: harmless
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    try:
        for xb, yb in pt.loader:
            pt.optimizer.zero_grad(set_to_none=True)
            if spec.augment and xb.shape[0]:
                xb = augment_batch(xb, g)
            # an empty Poisson batch still takes its step (noise alone): skipping it would
            # reveal that it was empty
            loss = algo.local_loss(model, xb, yb)
            loss.backward()
            pt.optimizer.step()
            if xb.shape[0]:
                total += loss.detach().float()
                steps += 1
    finally:
        pt.close()
    # weight decay is data-independent: applied after the private step (post-processing)
    if spec.weight_decay:
        with torch.no_grad():
            for p in params:
                p.mul_(1 - spec.lr * spec.weight_decay)
    return float(total) / max(steps, 1)
