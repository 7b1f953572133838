"""DP-SGD local training inside the federation (``--dp-train``), over ``privacy/dpsgd.py``.

Every selected client runs the same public schedule: ``E * round(n_nom / B)`` Poisson-sampled
DP-SGD steps per round at sample rate ``q = B / n_nom``, where ``n_nom`` is a public nominal
client size (``--dp-nominal-size``, default the federation's training examples over the
clients, both fixed by the public config and dataset), and every step divides the noisy
clipped sum by the public expected batch size ``q * n_nom``. Neither the number of steps nor
the sample rate nor the scale of an update depends on the client's private size n_k, so
neighbouring datasets (one example added or removed) produce the same schedule, the same
message shapes and the same accounted epsilon. Poisson sampling amplifies with q alone,
whatever n_k is (each example joins a batch independently with probability q).

Accounting (sample level): an example of client k is touched only by client k's updates, so
its epsilon composes the calibration uploads with client k's DP-SGD steps. Every client runs
the same schedule, so one plan covers all (``protection.noise_plan``); each client is
assumed to take part in every round (client sampling is not used for amplification:
conservative). The Poisson batches and the noise come from OS entropy (privacy/noise.py),
so the server sees neither. The local training loss never leaves the client: the server
detects divergence from the (DP) update itself. The guarantee then covers the model updates
too. Methods whose loss couples samples of a batch (FedUV, MOON's reference models, proximal
terms that opacus would drop) are refused, see ``Algorithm.dp_sgd``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from privfedcal.privacy.dpsgd import dpsgd_sample_rate, make_private_training
from privfedcal.settings.floors import PrivacyOptions


@dataclass(frozen=True)
class DPSGDSpec:
    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float  # public: min(1, B / n_nom)
    steps: int          # public: DP-SGD steps per round, the same for every client
    expected_batch_size: float  # public: q * n_nom, the divisor of every step's noisy sum
    seeded: bool = False  # --insecure-seeded-noise: batches and noise from the public seed


def nominal_size(privacy: PrivacyOptions, examples: int) -> int:
    """The public client size the schedule is planned with: ``--dp-nominal-size``, else the
    federation's training examples over the clients (rounded down, at least 1). The
    federation's size is public (``federation/setup.py`` ``held_examples``): the server
    plans with it too, without the partition."""
    if privacy.dp_nominal_size is not None:
        return int(privacy.dp_nominal_size)
    return max(1, int(examples) // privacy.clients)


def schedule(nominal: int, batch_size: int | None, local_epochs: int | None
             ) -> tuple[float, int]:
    """(sample rate, steps per round) of every client: ``q = min(1, B / n_nom)`` and one
    nominal epoch in expectation per local epoch. The batch size and local epochs must be
    resolved (``run_config.resolve_training_defaults``)."""
    if batch_size is None or local_epochs is None:
        raise ValueError("resolve batch_size and local_epochs before DP-SGD's schedule "
                         "(run_config.resolve_training_defaults)")
    q = dpsgd_sample_rate(batch_size, nominal)
    return q, local_epochs * max(1, round(1 / q))


def client_rates(privacy: PrivacyOptions, examples: int) -> list[tuple[float, int]]:
    """(sample rate, steps per round) of the clients: one public schedule for all."""
    return [schedule(nominal_size(privacy, examples), privacy.batch_size, privacy.local_epochs)]


def verify_clients(privacy: PrivacyOptions, examples: int, upload_entries, sigma: float,
                   delta: float, target: float) -> None:
    """Every client's examples (uploads + its own DP-SGD steps) must fit the budget."""
    from privfedcal.errors import PrivacyBudgetError
    from privfedcal.privacy.accounting import compute_epsilon

    for q, steps in client_rates(privacy, examples):
        eps = compute_epsilon([*upload_entries, (sigma, q, steps * privacy.rounds)],
                              privacy.accountant, delta)
        if eps > target:
            raise PrivacyBudgetError(f"a client with DP-SGD sample rate {q:.3g} would spend "
                                     f"epsilon {eps:.3f} > {target:g}")


def train_dpsgd(model, algo, x: Tensor, y: Tensor, spec, dp: DPSGDSpec, seed: int) -> None:
    """Run one client's DP-SGD local training on (x, y) with the public schedule of ``dp``.
    Returns nothing: the loss is a function of the private data outside the budget."""
    from privfedcal.data.augment import augment_batch
    from privfedcal.privacy.noise import noise_generator

    # Poisson batches and gradient noise from OS entropy: the server can neither regenerate
    # the noise nor learn the batches (which is what the amplification assumes)
    g = noise_generator(seed, seeded=dp.seeded, device=x.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=spec.training.lr, momentum=spec.training.momentum)
    pt = make_private_training(model, opt, x, y, noise_multiplier=dp.noise_multiplier,
                               max_grad_norm=dp.max_grad_norm, batch_size=spec.training.batch_size,
                               generator=g, steps=dp.steps, sample_rate=dp.sample_rate,
                               expected_batch_size=dp.expected_batch_size)
    # opacus's hooks fire on the first layer, whose inputs need no gradient: harmless
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    try:
        for xb, yb in pt.loader:
            pt.optimizer.zero_grad(set_to_none=True)
            if spec.data.augment and xb.shape[0]:
                xb = augment_batch(xb, g)
            # an empty Poisson batch still takes its step (noise alone): skipping it would
            # reveal that it was empty
            loss = algo.local_loss(model, xb, yb)
            loss.backward()
            pt.optimizer.step()
    finally:
        pt.close()
    # weight decay is data-independent: applied after the private step (post-processing)
    if spec.training.weight_decay:
        with torch.no_grad():
            for p in params:
                p.mul_(1 - spec.training.lr * spec.training.weight_decay)
