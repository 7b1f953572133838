"""The built-in methods' local losses in the form the vectorised trainer runs per client
under ``vmap`` (``algorithms/vector_loss.py``: a functional forward, per-row weights, 1 real
and 0 padding, and weighted means), and how the trainer finds a method's form
(``vector_loss_of``).

With every weight 1 each loss is the method's own ``Algorithm.local_loss`` (tested against
it); the formulas and their papers are in the methods' modules (privfedcal/algorithms/). A
method outside this table declares its form on its class (``Algorithm.vector_loss``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.algorithms.algorithm import Algorithm, State
from privfedcal.algorithms.vector_loss import Forward, VectorLoss, weighted_ce, weighted_mean


class ProximalLoss(VectorLoss):
    """FedProx / clsprox: ``CE + mu/2 * sum ||w - w_global||^2`` over the anchored
    parameters (``prefix``: all trainable ones, or the classifier's)."""

    def __init__(self, prefix: str = "model.") -> None:
        self.prefix = prefix

    def loss(self, algo: Algorithm, forward: Forward, params: State, anchor: State, x: Tensor,
             y: Tensor, w: Tensor, ext: State) -> Tensor:
        ce = weighted_ce(forward(params, x)[1], y, w)
        terms = [(p - anchor[k]).pow(2).sum() for k, p in params.items()
                 if k.startswith(self.prefix)]
        if not terms:
            return ce
        return ce + 0.5 * algo.params.mu * torch.stack(terms).sum()


class MoonLoss(VectorLoss):
    """MOON: ``CE + mu * l_con`` with z_glob from the received model and z_prev from the
    client's previous local model; a client without one (first round) has CE only, as in
    ``algorithms/moon.py`` (its placeholder z_prev is z_glob, multiplied by 0)."""

    def prepare(self, trainer: Any, global_state: State, client_states: list[State | None]
                ) -> State:
        device = trainer.x.device
        keys = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        ext = {f"model.{k}": torch.stack([(s if s is not None else global_state)[k].to(device)
                                          for s in client_states]) for k in keys}
        ext["has_prev"] = torch.tensor([s is not None for s in client_states],
                                       dtype=torch.float32, device=device)
        return ext

    def loss(self, algo: Algorithm, forward: Forward, params: State, anchor: State, x: Tensor,
             y: Tensor, w: Tensor, ext: State) -> Tensor:
        z, logits = forward(params, x)
        ce = weighted_ce(logits, y, w)
        prev = {k: v for k, v in ext.items() if k != "has_prev"}
        # the frozen models' features carry no gradient (moon.py computes them under no_grad)
        z_glob = forward(anchor, x)[0].detach()
        z_prev = forward(prev, x)[0].detach()
        sims = torch.stack([F.cosine_similarity(z, z_glob, dim=1),
                            F.cosine_similarity(z, z_prev, dim=1)], dim=1) / algo.params.tau
        target = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
        con = weighted_mean(F.cross_entropy(sims, target, reduction="none"), w)
        return ce + algo.params.mu * ext["has_prev"] * con

    def client_state(self, state: State) -> State | None:
        return {k: v.clone() for k, v in state.items()}


class FedUVLoss(VectorLoss):
    """FedUV: ``CE + mu * L_U(z) + lambda * L_V(logits)`` (algorithms/feduv.py) over the real
    rows: the unbiased column variance of the softmax over them, the pairs among them, and
    sigma the lower median of their non-zero squared distances (padding rows and their
    pairs are left out of the sort with +inf). A client batch of fewer than two real rows
    has CE only, as in feduv.py."""

    def loss(self, algo: Algorithm, forward: Forward, params: State, anchor: State, x: Tensor,
             y: Tensor, w: Tensor, ext: State) -> Tensor:
        z, logits = forward(params, x)
        ce = weighted_ce(logits, y, w)
        n = w.sum()
        several = (n >= 2).to(ce.dtype)  # batch statistics need two rows
        lam, c = algo.lam, algo.c  # type: ignore[attr-defined]  # FedUV's resolved weights
        return (ce + several * algo.params.mu * self.uniformity(z, w)
                + several * lam * self.variance(logits, w, n, c))

    @staticmethod
    def variance(logits: Tensor, w: Tensor, n: Tensor, c: float) -> Tensor:
        """L_V: mean over classes of ``max(0, c - std_j)``, std over the real rows."""
        probs = F.softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=1)
        mean = (probs * w[:, None]).sum(0) / n
        var = (((probs - mean) ** 2) * w[:, None]).sum(0) / (n - 1).clamp_min(1)
        return F.relu(c - var.clamp_min(1e-12).sqrt()).mean()

    @staticmethod
    def uniformity(z: Tensor, w: Tensor) -> Tensor:
        """L_U: mean of exp(-d^2 / sigma) over the pairs of real rows."""
        z = z if z.dtype == torch.float64 else z.float()
        if z.shape[0] < 2:  # a batch of one row has no pair (its weight `several` is 0 too)
            return (z * 0).sum()
        rows, cols = torch.triu_indices(z.shape[0], z.shape[0], offset=1, device=z.device)
        diff = z[rows] - z[cols]
        pair_d2 = (diff * diff).sum(dim=1)
        real = w[rows] * w[cols]
        chosen = (real > 0) & (pair_d2 > 0)
        ordered = torch.where(chosen, pair_d2, torch.full_like(pair_d2, torch.inf)).sort().values
        middle = torch.div(chosen.sum() - 1, 2, rounding_mode="floor").clamp_min(0)
        sigma = ordered.gather(0, middle.reshape(1))[0]
        # no non-zero distance: sigma = inf, every term exp(0) = 1 with zero gradient (feduv.py)
        return (torch.exp(-pair_d2 / sigma) * real).sum() / real.sum().clamp_min(1)


#: the built-in methods whose loss is not FedAvg's, by name -> their vectorised loss
VECTOR_LOSSES: dict[str, VectorLoss] = {
    "fedprox": ProximalLoss(),
    "clsprox": ProximalLoss("model.classifier."),
    "moon": MoonLoss(),
    "feduv": FedUVLoss(),
}

#: the client hooks a method keeps from ``Algorithm`` when it trains on FedAvg's loss
_CLIENT_HOOKS = ("begin_client", "local_loss", "end_client")


def vector_loss_of(algo: Algorithm | type[Algorithm]) -> VectorLoss | None:
    """The vectorised form of a method's loss: the one its class declares
    (``vector_loss``), else the built-in one of its name, else FedAvg's when the method
    keeps FedAvg's client hooks (its differences are the server rule or the model's
    configuration: fedavgm, freeze, clsnorm); None when it has none (it trains only
    with ``--client-batch 1``)."""
    cls = algo if isinstance(algo, type) else type(algo)
    if cls.vector_loss is not None:
        return cls.vector_loss
    if cls.name in VECTOR_LOSSES:
        return VECTOR_LOSSES[cls.name]
    if all(getattr(cls, h) is getattr(Algorithm, h) for h in _CLIENT_HOOKS):
        return VectorLoss()
    return None


__all__ = ["Forward", "VECTOR_LOSSES", "VectorLoss", "vector_loss_of", "weighted_ce",
           "weighted_mean"]
