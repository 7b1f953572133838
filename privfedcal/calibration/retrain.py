"""Classifier re-training shared by CCVR (Luo et al. 2021, sec. 4 "Classifier Re-Training"),
the oracle upper bound (sec. 3.3) and CReFF (Shang et al. 2022, Eq. 7).

Only the linear head ``logits = W z + b`` is trained, with cross-entropy and minibatch SGD;
the feature extractor is fixed. The head is read from and written back to a model state,
whichever parametrisation the method uses:

* ``classifier.weight`` / ``classifier.bias`` (plain ``nn.Linear``);
* ``classifier.parametrizations.weight.original`` (clsnorm, CCVR sec. 3.3): the logits use
  the row-normalised weight ``W_i / ||W_i||``. The raw weight is re-trained *through* the
  same normalisation, so the calibrated head means at inference what it meant in training.
  A clsnorm head has no bias (its ``classifier.bias`` is a frozen zero): :func:`read_head`
  reports ``bias=None`` for it, so no calibrator trains one, and :func:`write_head` leaves
  the stored zero untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.errors import UsageError
from privfedcal.federation.hooks import Calibrator, ServerContext
from privfedcal.federation.local import PlainSGD
from privfedcal.tensors import State

WEIGHT_KEY = "classifier.weight"
NORMALIZED_WEIGHT_KEY = "classifier.parametrizations.weight.original"
BIAS_KEY = "classifier.bias"


# ---- the head inside a model state --------------------------------------------------------
@dataclass(frozen=True, eq=False)
class Head:
    """A linear head as stored in a state: raw weight (C, d), bias (C,) or None."""

    weight: Tensor
    bias: Tensor | None
    normalized: bool = False


def read_head(state: State) -> Head:
    if WEIGHT_KEY in state:
        weight, normalized = state[WEIGHT_KEY], False
    elif NORMALIZED_WEIGHT_KEY in state:
        weight, normalized = state[NORMALIZED_WEIGHT_KEY], True
    else:
        raise KeyError(f"state has no classifier weight ({WEIGHT_KEY!r} or {NORMALIZED_WEIGHT_KEY!r})")
    # clsnorm is bias-free by definition: its stored zero bias is not part of the head.
    return Head(weight, None if normalized else state.get(BIAS_KEY), normalized)


def write_head(state: State, weight: Tensor, bias: Tensor | None) -> State:
    """A copy of ``state`` whose head is replaced (same key, dtype and device as before)."""
    out = dict(state)
    key = WEIGHT_KEY if WEIGHT_KEY in state else NORMALIZED_WEIGHT_KEY
    old = state[key]
    out[key] = weight.detach().to(device=old.device, dtype=old.dtype).clone()
    if BIAS_KEY in state and bias is not None:
        old_b = state[BIAS_KEY]
        out[BIAS_KEY] = bias.detach().to(device=old_b.device, dtype=old_b.dtype).clone()
    return out


def effective_weight(weight: Tensor, normalized: bool) -> Tensor:
    """The weight the logits use: rows normalised to unit L2 norm for clsnorm."""
    if not normalized:
        return weight
    return weight / weight.norm(dim=1, keepdim=True).clamp_min(1e-12)


def head_logits(z: Tensor, weight: Tensor, bias: Tensor | None, normalized: bool = False) -> Tensor:
    return F.linear(z, effective_weight(weight, normalized), bias)


def fresh_head(num_classes: int, dim: int, generator: torch.Generator, *,
               device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
               ) -> tuple[Tensor, Tensor]:
    """A new head drawn like ``nn.Linear``'s default: W, b ~ U(-1/sqrt(d), 1/sqrt(d))."""
    bound = 1.0 / math.sqrt(dim)
    gdev = generator.device
    w = (torch.rand(num_classes, dim, generator=generator, device=gdev) * 2 - 1) * bound
    b = (torch.rand(num_classes, generator=generator, device=gdev) * 2 - 1) * bound
    return w.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


# ---- training ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RetrainParams:
    """SGD settings for re-training a head (the CCVR paper does not state its own).

    ``steps`` fixes the number of SGD steps; when None it is ``epochs`` passes over the
    re-training set (so the default scales with the number of virtual/real features), but
    at least ``min_steps`` (small sets, e.g. ``oracle:10``, would otherwise barely move).
    """

    steps: int | None = None
    epochs: int = 10
    min_steps: int = 100
    lr: float = 0.01
    batch_size: int = 64
    momentum: float = 0.9
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 0:
            raise UsageError(f"re-training steps must be >= 0, got {self.steps}")
        if self.epochs < 0 or self.min_steps < 0:
            raise UsageError(f"re-training epochs and min steps must be >= 0, got {self.epochs}, {self.min_steps}")
        if not self.lr > 0:
            raise UsageError(f"re-training lr must be > 0, got {self.lr}")
        if self.batch_size < 1:
            raise UsageError(f"re-training batch size must be >= 1, got {self.batch_size}")
        if not 0 <= self.momentum < 1:
            raise UsageError(f"re-training momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise UsageError(f"re-training weight decay must be >= 0, got {self.weight_decay}")

    def num_steps(self, n: int) -> int:
        if self.steps is not None:
            return self.steps
        return max(self.min_steps, self.epochs * math.ceil(n / self.batch_size))


def retrain_classifier(weight: Tensor, bias: Tensor | None, features: Tensor, labels: Tensor, *,
                       steps: int, lr: float, batch_size: int | None, momentum: float = 0.0,
                       weight_decay: float = 0.0, generator: torch.Generator,
                       normalized: bool = False, closed_form: bool | None = None
                       ) -> tuple[Tensor, Tensor | None]:
    """Train the head (from ``weight``, ``bias``) with CE by minibatch SGD; return new tensors.

    Each epoch visits the samples in an order drawn from ``generator`` (the last batch of an
    epoch may be smaller); ``batch_size=None`` or >= n means full batch. ``bias=None`` keeps
    the head bias-free. Deterministic for a given generator state; the inputs are not modified.

    A plain linear head (``normalized=False``) is trained with the closed-form gradient of
    softmax cross-entropy, ``dW = (softmax(Z W^T + b) - Y)^T Z / B``, ``db = sum(P - Y) / B``,
    and ``torch.optim.SGD``'s update written out (weight decay added to the gradient, momentum
    buffer seeded with the first gradient); the result equals the autograd path up to float
    rounding (tested), without building a graph per step. ``closed_form=False`` forces
    autograd (a clsnorm head always uses it: its gradient goes through the row
    normalisation).
    """
    n = features.shape[0]
    if n == 0 or steps == 0:
        return weight.detach().clone(), None if bias is None else bias.detach().clone()
    bs = n if batch_size is None else min(batch_size, n)
    use_closed = (not normalized) if closed_form is None else (closed_form and not normalized)
    w = weight.detach().clone()
    b = None if bias is None else bias.detach().clone()
    z = features.detach().to(device=w.device, dtype=w.dtype).clone()
    y = labels.detach().to(device=w.device, dtype=torch.long).clone()

    def batches():
        order = torch.arange(n, device=w.device)
        pos = n  # forces a fresh permutation at the first step
        for _ in range(steps):
            if bs == n:
                yield z, y
                continue
            if pos >= n:
                order = torch.randperm(n, generator=generator, device=generator.device).to(w.device)
                pos = 0
            idx = order[pos:pos + bs]
            pos += bs
            yield z[idx], y[idx]

    if use_closed:
        return _sgd_closed_form(w, b, z, y, steps, bs, generator, lr, momentum, weight_decay)
    with torch.inference_mode(False), torch.enable_grad():
        w = w.requires_grad_(True)
        params = [w]
        if b is not None:
            b = b.requires_grad_(True)
            params.append(b)
        # torch.optim.SGD's update, without importing torch._dynamo (federation/local.py)
        opt = PlainSGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
        for zb, yb in batches():
            loss = F.cross_entropy(head_logits(zb, w, b, normalized), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return w.detach(), None if b is None else b.detach()


def _sgd_closed_form(w: Tensor, b: Tensor | None, z: Tensor, y: Tensor, steps: int, bs: int,
                     generator: torch.Generator, lr: float, momentum: float,
                     weight_decay: float) -> tuple[Tensor, Tensor | None]:
    """Plain-linear-head SGD with the analytic CE gradient (``torch.optim.SGD`` semantics,
    dampening 0, no Nesterov), the same batches as the autograd path.

    The head is kept as one (d+1, C) matrix ``H = [W | b]^T`` over rows ``[z, 1]`` (stored
    transposed: ``F H`` is 2-3x faster than ``F W^T`` for these small shapes on a CPU), and
    every sample row carries its one-hot label. The epochs' permutations are drawn up front
    (the same draws, in the same order, as one per epoch) and each epoch's rows are gathered
    once, so a minibatch is a view and a step is four kernels: ``logits = F H``, softmax,
    ``- Y``, and one ``addmm`` that applies ``-(lr / B) F^T R`` (with momentum: accumulates
    the buffer ``m buf + F^T R / B``). No host synchronisation inside the loop."""
    n, d = z.shape
    num_classes = w.shape[0]
    # rows [z | 1 | onehot(y)]: one gather per epoch yields features and targets together
    rows = torch.cat([z, torch.ones(n, 1, dtype=z.dtype, device=z.device),
                      F.one_hot(y, num_classes).to(z.dtype)], dim=1)
    width = d + 1 if b is not None else d
    head = (torch.cat([w, b[:, None]], dim=1) if b is not None else w).T.contiguous()
    buf = torch.zeros_like(head) if momentum else None  # m * 0 + g = g: torch's first step
    per_epoch = math.ceil(n / bs)
    epochs = math.ceil(steps / per_epoch)
    if bs == n:
        orders: list[Tensor | None] | Tensor = [None] * epochs
    else:  # one copy to the device for all epochs
        orders = torch.stack([torch.randperm(n, generator=generator, device=generator.device)
                              for _ in range(epochs)]).to(z.device)
    left = steps
    for order in orders:
        shuffled = rows if order is None else rows[order]
        feats_all = shuffled[:, :width].split(bs)
        targets_all = shuffled[:, d + 1:].split(bs)
        for feats, targets in zip(feats_all[:left], targets_all[:left], strict=True):
            r = torch.softmax(feats @ head, dim=1).sub_(targets)
            scale = 1.0 / feats.shape[0]
            if buf is not None:
                buf.addmm_(feats.T, r, beta=momentum, alpha=scale)
                if weight_decay:
                    buf.add_(head, alpha=weight_decay)
                head.sub_(buf, alpha=lr)
            else:
                head.addmm_(feats.T, r, beta=1.0 - lr * weight_decay, alpha=-lr * scale)
        left -= len(feats_all)
    head = head.T
    if b is None:
        return head.contiguous(), None
    return head[:, :d].contiguous(), head[:, d].contiguous()


def retrain_head_of(state: State, features: Tensor, labels: Tensor, params: RetrainParams,
                    generator: torch.Generator) -> tuple[Tensor, Tensor | None]:
    """Re-train the head stored in ``state`` on (features, labels), from its current values."""
    head = read_head(state)
    return retrain_classifier(
        head.weight.float(), None if head.bias is None else head.bias.float(), features, labels,
        steps=params.num_steps(int(features.shape[0])), lr=params.lr,
        batch_size=params.batch_size, momentum=params.momentum,
        weight_decay=params.weight_decay, generator=generator, normalized=head.normalized)


class PosthocCalibrator(Calibrator):
    """Base of calibrators that replace the head once, after training (CCVR, oracle)."""

    def __init__(self, params: Any, *, num_classes: int, feature_dim: int | None = None) -> None:
        self.params = params
        self.num_classes = num_classes
        self.feature_dim = feature_dim
        self._head: tuple[Tensor, Tensor | None] | None = None
        self._evaluated: tuple[State, State] | None = None  # (global state, its eval_state)

    def _install(self, ctx: ServerContext, weight: Tensor, bias: Tensor | None,
                 details: dict[str, Any]) -> dict[str, Any]:
        """Evaluate before/after, keep the new head; the summary fields for the run.

        Neither evaluation is repeated in a run: "before" is the global model the final round
        has just evaluated, and ``eval_state``/``feature_transform`` return the same objects
        for the same global state, so the summary's evaluation of the calibrated model is
        the one made here (the simulator keeps its last evaluation by object identity)."""
        before = ctx.evaluate(ctx.global_state)
        self._head, self._evaluated = (weight, bias), None
        after = ctx.evaluate(self.eval_state(ctx.global_state), self.feature_transform())
        return {
            "accuracy_before_calibration": before["accuracy"],
            "per_class_accuracy_before_calibration": before.get("per_class_accuracy"),
            "calibration": {"name": self.name, "accuracy_after": after["accuracy"], **details},
        }

    def eval_state(self, global_state: State) -> State:
        if self._head is None:
            return global_state
        if self._evaluated is None or self._evaluated[0] is not global_state:
            self._evaluated = (global_state, write_head(global_state, *self._head))
        return self._evaluated[1]

    def state_dict(self) -> dict[str, Any]:
        if self._head is None:
            return {}
        weight, bias = self._head
        return {"weight": weight} if bias is None else {"weight": weight, "bias": bias}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._head = (state["weight"], state.get("bias")) if state else None
        self._evaluated = None
