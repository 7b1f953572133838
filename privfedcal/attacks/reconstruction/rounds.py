"""Class gradients across rounds: images whose CReFF class gradients reproduce those one
client uploaded in several rounds, each under the model state and head the server sent
(the rounds together pin images one release leaves open; batched over targets).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.attacks.reconstruction.feature_inversion import InversionConfig, to_pixels
from privfedcal.attacks.reconstruction.gradient_inversion import GradientInversionResult
from privfedcal.attacks.reconstruction.modes import eval_mode
from privfedcal.errors import UsageError
from privfedcal.models.feature_classifier import FeatureClassifier


def invert_class_gradients(
    model: FeatureClassifier,
    states: Sequence[Mapping[str, Tensor]],
    heads: Sequence[tuple[Tensor, Tensor | None]],
    grads: Sequence[Tensor],
    label: int,
    n: int,
    *,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    generator: torch.Generator,
    config: InversionConfig | None = None,
) -> GradientInversionResult:
    """n images of class ``label`` whose CReFF class gradients reproduce those a client
    uploaded in several rounds: release r was computed with the extractor of ``states[r]``
    (the model state the server sent) and the head ``heads[r]``; the objective is the mean
    over releases of ``1 - cos(G_r(x), g_r)`` over ``[dW | db]`` (Geiping et al. 2020's
    cosine, one term per round), with the TV prior, box constraint and convergence test of
    ``optimise_images``. Every release adds C (d + 1) equations on the same images, so
    rounds together pin images one release leaves open (n > C - 1, or features the
    extractor maps alike). Needs the same samples in every release (CReFF's per-class cap
    ``client_draws * draw_size`` is above n) and the model runs in eval mode.
    """
    (res,) = invert_class_gradients_many(
        model, states, heads, [(grads, label, n)], image_shape=image_shape, mean=mean,
        std=std, generators=[generator], config=config)
    return res


def invert_class_gradients_many(
    model: FeatureClassifier,
    states: Sequence[Mapping[str, Tensor]],
    heads: Sequence[tuple[Tensor, Tensor | None]],
    targets: Sequence[tuple[Sequence[Tensor], int, int]],
    *,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    generators: Sequence[torch.Generator],
    config: InversionConfig | None = None,
) -> list[GradientInversionResult]:
    """``invert_class_gradients`` for several targets ``(grads, label, n)`` released under
    the same states and heads (clients' class gradients of the same rounds), optimised
    together (``engine.optimise_batch``: per-target generator, stop and best restart, so
    each result is the one the target gets alone, up to float rounding)."""
    from privfedcal.attacks.reconstruction.engine import optimise_batch

    if not states or len(states) != len(heads) or any(len(g) != len(states)
                                                      for g, _, _ in targets):
        raise UsageError("need one model state, head and class gradient per release")
    if len(generators) != len(targets):
        raise UsageError("need one generator per target")
    cfg = config or InversionConfig(restarts=1, tv_weight=1e-2, l2_weight=0.0, jitter=0,
                                    bn_weight=0.0)
    device = next(model.parameters()).device
    objective, error = _class_gradients_objective(model, states, heads, targets, device)
    with eval_mode(model):
        outs = optimise_batch(
            objective, batches=[n for _, _, n in targets], restarts=cfg.restarts,
            image_shape=image_shape, mean=mean, std=std, config=cfg, generators=generators,
            device=device, dtype=next(model.parameters()).dtype, error=error)
        results = []
        for t, ((_, label, n), out) in enumerate(zip(targets, outs, strict=True)):
            with torch.no_grad():
                one = out.images[None, None]  # as a batch of one target, one restart
                ok = torch.ones(1, n, dtype=torch.bool, device=device)
                cos = 1 - float(objective(one, torch.tensor([t], device=device), ok)[0, 0])
            results.append(GradientInversionResult(
                images=to_pixels(out.images, mean, std),
                labels=torch.full((n,), int(label), dtype=torch.long), gradient_cosine=cos,
                loss=float(out.losses[out.best]), restart_losses=out.losses,
                convergence=out.convergence))
    return results


_BatchObjective = Callable[[Tensor, Tensor, Tensor], Tensor]


def _class_gradients_objective(model: FeatureClassifier,
                               states: Sequence[Mapping[str, Tensor]],
                               heads: Sequence[tuple[Tensor, Tensor | None]],
                               targets: Sequence[tuple[Sequence[Tensor], int, int]],
                               device: torch.device
                               ) -> tuple[_BatchObjective, _BatchObjective]:
    """(objective, error) of ``optimise_batch`` for the targets' class gradients: per
    (target, restart), 1 - cosine between the head gradient its images give under each
    release's state and head and the observed one, averaged over the releases; the error
    is sqrt(2 (1 - cos))."""
    from torch.func import functional_call

    wrapped = _Features(model)  # functional_call with each release's state, model untouched
    sent = [{"model." + k: v.to(device) for k, v in st.items()} for st in states]
    hs = [(w.to(device).float(), None if b is None else b.to(device).float()) for w, b in heads]
    # (T, releases, C * (d + 1)) observed gradients; one-hot labels (T, C); image counts (T,)
    gs = torch.stack([torch.stack([g.to(device).float().flatten() for g in grads])
                      for grads, _, _ in targets])
    onehot = F.one_hot(torch.tensor([lab for _, lab, _ in targets], device=device),
                       hs[0][0].shape[0]).float()
    counts = torch.tensor([n for _, _, n in targets], device=device, dtype=torch.float32)

    def objective(x: Tensor, act: Tensor, valid: Tensor) -> Tensor:
        w_img = valid[:, None, :, None].float()  # (A, 1, Bmax, 1): padding images count 0
        # padding images skip the model: valid ones in, features scattered back
        idx = torch.nonzero(valid[:, None].expand(-1, x.shape[1], -1).reshape(-1))[:, 0]
        flat = x.flatten(0, 2)
        inp = flat.index_select(0, idx)
        terms = []
        for k, (st, (w, b)) in enumerate(zip(sent, hs, strict=True)):
            zv = functional_call(wrapped, st, (inp,))
            z = zv.new_zeros(flat.shape[0], zv.shape[-1]).index_copy(0, idx, zv)
            z = z.view(*x.shape[:3], -1)
            logits = z @ w.T + (0 if b is None else b)
            resid = (torch.softmax(logits, -1) - onehot[act][:, None, None]) * w_img
            zb = torch.cat([z, torch.ones_like(z[..., :1])], -1)
            # _head_gradient per (target, restart): residuals^T [z | 1] / n
            sim = (resid.transpose(-1, -2) @ zb / counts[act][:, None, None, None]).flatten(2)
            g = gs[act, k][:, None]
            terms.append(1 - (sim * g).sum(-1) / (sim.norm(dim=-1).clamp_min(1e-12)
                                                   * g.norm(dim=-1).clamp_min(1e-12)))
        return torch.stack(terms).mean(0)

    def error(x: Tensor, act: Tensor, valid: Tensor) -> Tensor:
        with torch.enable_grad():
            return torch.sqrt(2 * objective(x, act, valid).detach().clamp_min(0))

    return objective, error


class _Features(torch.nn.Module):
    """``model.features`` as a module's forward, for ``torch.func.functional_call``."""

    def __init__(self, model: FeatureClassifier) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model.features(x)
