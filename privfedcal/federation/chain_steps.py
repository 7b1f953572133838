"""The MLP's local SGD steps with a hand-written backward: bit for bit what autograd and
``PlainSGD`` compute, at about 0.6x the time of a step on a CPU.

A step of a small network on a CPU is mostly overhead around its matrix products: building
the autograd graph, the engine's bookkeeping, a gradient tensor and three optimiser kernels
per parameter. For a chain of ``Linear`` and ``ReLU`` layers under the plain cross-entropy
loss the backward is short enough to write out with the very kernels autograd runs (the same
``addmm``/``mm`` operands and layouts, ``threshold_backward``, ``_log_softmax_backward_data``,
``nll_loss_backward``), so every number is the same. The parameters, their gradients and the
momentum live in one flat buffer each while a client trains: the matrix products write the
gradients into it, and weight decay, momentum and the update are one operation each.

It runs only where that equality is known to hold (``chain_steps``: the MLP exactly as
registered, the plain cross-entropy of ``Algorithm.local_loss``, float32 parameters on a CPU,
no hooks anywhere); everything else trains through autograd. ``tests/federation/
test_chain_steps.py`` compares the two bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from privfedcal.algorithms.algorithm import Algorithm
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.settings.floors import Recipe

_aten = torch.ops.aten
_MEAN = 1  # nll_loss's reduction code for "mean"
_IGNORE = -100  # F.cross_entropy's default ignore_index


def chain_linears(model: nn.Module) -> list[nn.Linear] | None:
    """The linear layers of ``model`` in order when it is the registered MLP (flatten, then
    Linear and ReLU pairs, then a linear classifier, all of torch's own classes), else None."""
    from privfedcal.models.mlp import MLP

    if type(model) is not MLP:
        return None
    body = list(model.body)
    if not body or type(body[0]) is not nn.Flatten or (body[0].start_dim, body[0].end_dim) != (1, -1):
        return None
    pairs = body[1:]
    if len(pairs) % 2:
        return None
    linears = []
    for lin, act in zip(pairs[0::2], pairs[1::2], strict=True):
        if type(lin) is not nn.Linear or type(act) is not nn.ReLU:
            return None
        linears.append(lin)
    linears.append(model.classifier)
    if type(model.classifier) is not nn.Linear or any(m.bias is None for m in linears):
        return None
    return linears


def _observed(model: nn.Module) -> bool:
    """Whether anything watches the model's forward or backward: a module hook (its own or
    a global one) or a hook on a parameter. A hand-written step would bypass it."""
    from torch.nn.modules import module as module_globals

    if (module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks
            or module_globals._global_backward_hooks
            or module_globals._global_backward_pre_hooks):
        return True
    for m in model.modules():
        if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks):
            return True
    return any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
               for p in model.parameters())


def chain_steps(model: FeatureClassifier, algo: Algorithm, x_all: Tensor, y_all: Tensor,
                recipe: Recipe) -> ChainSteps | None:
    """Hand-written steps for this client's training, or None where autograd must take them
    (another model or loss, a parameter that is frozen, not float32 or not on the CPU, a
    hook, gradients switched off)."""
    if x_all.device.type != "cpu" or x_all.dtype != torch.float32 or y_all.dtype != torch.int64:
        return None
    if type(algo).local_loss is not Algorithm.local_loss or not torch.is_grad_enabled():
        return None
    linears = chain_linears(model)
    if linears is None or _observed(model):
        return None
    params = [p for m in linears for p in (m.weight, m.bias)]
    if len(params) != len(list(model.parameters())) or not all(
            p.requires_grad and p.dtype == torch.float32 and p.device.type == "cpu"
            for p in params):
        return None
    return ChainSteps(params, recipe)


class ChainSteps:
    """One client's steps: the parameters copied into a flat buffer at the start, written
    back to the model by ``finish``."""

    def __init__(self, params: list[Tensor], recipe: Recipe) -> None:
        self.params = params
        self.lr, self.momentum = float(recipe.lr), float(recipe.momentum)
        self.weight_decay = float(recipe.weight_decay)
        total = sum(p.numel() for p in params)
        self.flat = torch.empty(total)
        self.grad = torch.empty(total)
        self.buffer: Tensor | None = None  # momentum, from the first step's gradient
        self.views, self.grads = [], []
        at = 0
        for p in params:
            self.views.append(self.flat[at:at + p.numel()].view(p.shape))
            self.grads.append(self.grad[at:at + p.numel()].view(p.shape))
            at += p.numel()
        with torch.no_grad():
            torch._foreach_copy_(self.views, params)

    @torch.no_grad()
    def step(self, x: Tensor, y: Tensor) -> Tensor:
        """One SGD step on the batch (x, y); returns its loss."""
        layers = len(self.views) // 2
        h = x.flatten(1)
        inputs = []  # each layer's input; after the first, the previous ReLU's output
        for i in range(layers):
            inputs.append(h)
            w, b = self.views[2 * i], self.views[2 * i + 1]
            h = torch.addmm(b, h, w.t())  # F.linear on a 2-D input
            if i < layers - 1:
                h = torch.relu(h)
        logp = torch.log_softmax(h, 1)
        loss, total_weight = _aten.nll_loss_forward(logp, y, None, _MEAN, _IGNORE)
        g = _aten.nll_loss_backward(torch.ones_like(loss), logp, y, None, _MEAN, _IGNORE,
                                    total_weight)
        g = _aten._log_softmax_backward_data(g, logp, 1, logp.dtype)
        for i in reversed(range(layers)):
            # addmm's backward for weight.t(), a column-major operand: (g^T x)^T^T = g^T x
            torch.mm(g.t(), inputs[i], out=self.grads[2 * i])
            torch.sum(g, 0, out=self.grads[2 * i + 1])
            if i:
                g = _aten.threshold_backward(g.mm(self.views[2 * i]), inputs[i], 0)
        self._update()
        return loss

    def _update(self) -> None:
        """``PlainSGD.step`` on the flat buffers: the same element-wise kernels."""
        grad = self.grad
        if self.weight_decay != 0:
            grad.add_(self.flat, alpha=self.weight_decay)
        if self.momentum != 0:
            if self.buffer is None:
                self.buffer = grad.clone()
            else:
                self.buffer.mul_(self.momentum).add_(grad, alpha=1.0)
            grad = self.buffer
        self.flat.add_(grad, alpha=-self.lr)

    def finish(self) -> None:
        """The trained parameters into the model."""
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.views)


__all__ = ["ChainSteps", "chain_linears", "chain_steps"]
