"""Local training and evaluation: the hot path, shared by the in-process and worker trainers.

Data stay device tensors; a client is an index tensor; batches are gathered by index and
augmented with batched tensor code. Every random draw comes from a generator seeded by
(seed, round, client), so a run is reproducible on CPU and resumable from any round.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.algorithms.algorithm import Algorithm, State, client_context
from privfedcal.federation.chain_steps import chain_steps
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.seeding import derive_seed, make_generator
from privfedcal.settings.floors import LocalSpec, Recipe


def autocast_for(device: torch.device, enabled: bool = True):
    """bf16 autocast on CUDA when ``enabled``; nothing on CPU (bf16 matmuls are slower there)."""
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


#: models with at least this many parameters train under bf16 autocast on CUDA by default; on
#: smaller ones (the CNN, ResNet-8, the MLP) the extra casts cost more than bf16 saves
MIXED_PRECISION_MIN_PARAMS = 5_000_000


def choose_mixed_precision(model: torch.nn.Module, device: torch.device,
                           setting: str = "auto") -> bool:
    """``--precision``: ``fp32`` never, ``bf16`` always (on CUDA), ``auto`` by model size."""
    if device.type != "cuda" or setting == "fp32":
        return False
    if setting == "bf16":
        return True
    return sum(p.numel() for p in model.parameters()) >= MIXED_PRECISION_MIN_PARAMS


def _to(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``; a CPU source is pinned first on CUDA so the copy is asynchronous."""
    if t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def set_deterministic(enabled: bool) -> None:
    """``--deterministic``: deterministic kernels (an error where none exists), no cuDNN
    autotuning. CPU runs are reproducible without it; see docs/usage.md."""
    if not enabled:
        return
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


class PlainSGD:
    """SGD with momentum and weight decay: the update of ``torch.optim.SGD`` (no dampening,
    no Nesterov), op for op, so results are bitwise the same.

    Why not ``torch.optim.SGD`` itself: building any ``torch.optim`` optimizer imports
    ``torch._dynamo`` (seconds of start-up for a command that never compiles) and every
    ``step``/``zero_grad`` goes through dynamo's disable wrapper. The update is applied with
    ``torch._foreach_*`` calls (one call per op for all tensors: on a GPU one launch; on a
    CPU torch runs the same per-tensor kernels as its own CPU update, so the results are
    bitwise those of ``torch.optim.SGD`` either way, with a fifth of the Python calls).

    ``step`` consumes the gradients: weight decay is added to ``p.grad`` in place (the same
    kernel and values as ``torch.optim.SGD``'s out-of-place add, without allocating a new
    tensor per parameter and step). Read a gradient before ``step``, not after.
    """

    def __init__(self, params: list[Tensor], *, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.buffers: list[Tensor | None] = [None] * len(self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return
        params = [self.params[i] for i in live]
        self._step_foreach(live, params, [p.grad for p in params])  # type: ignore[misc]

    def _step_foreach(self, live: list[int], params: list[Tensor], grads: list[Tensor]) -> None:
        if self.weight_decay != 0:
            torch._foreach_add_(grads, params, alpha=self.weight_decay)
        if self.momentum != 0:
            bufs = [self.buffers[i] for i in live]
            if any(b is None for b in bufs):
                for j, i in enumerate(live):
                    if bufs[j] is None:
                        bufs[j] = self.buffers[i] = grads[j].detach().clone()
                    else:
                        bufs[j].mul_(self.momentum).add_(grads[j])  # type: ignore[union-attr]
            else:
                torch._foreach_mul_(bufs, self.momentum)  # type: ignore[arg-type]
                torch._foreach_add_(bufs, grads, alpha=1.0)  # type: ignore[arg-type]
            grads = bufs  # type: ignore[assignment]
        torch._foreach_add_(params, grads, alpha=-self.lr)


class AutogradSteps:
    """Local SGD steps through autograd and ``PlainSGD``: any model, any method's loss
    (``chain_steps.ChainSteps`` takes the MLP's plain cross-entropy steps by hand)."""

    def __init__(self, model: FeatureClassifier, algo: Algorithm, recipe: Recipe,
                 amp: bool) -> None:
        self.model, self.algo = model, algo
        self.amp = next(model.parameters()).device if amp else None
        self.opt = PlainSGD([p for p in model.parameters() if p.requires_grad], lr=recipe.lr,
                            momentum=recipe.momentum, weight_decay=recipe.weight_decay)

    def step(self, x: Tensor, y: Tensor) -> Tensor:
        """One SGD step on the batch (x, y); returns its loss, detached."""
        if self.amp is not None:
            with autocast_for(self.amp):
                loss = self.algo.local_loss(self.model, x, y)
        else:
            loss = self.algo.local_loss(self.model, x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def finish(self) -> None:
        """Nothing: the steps updated the model's own parameters."""


def clone_state(model: torch.nn.Module) -> State:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class LocalResult(NamedTuple):
    """What one client's local training returns to the server."""

    state: State                # the trained model's state ({} once handed to ``consume``)
    client_state: State | None  # the method's per-client state kept between rounds, or None
    loss: float | None          # the mean local training loss; None under DP-SGD (private)


def train_client(model: FeatureClassifier, algo: Algorithm, global_state: State,
                 client_state: State | None, x_all: Tensor, y_all: Tensor, idx: Tensor,
                 spec: LocalSpec, round_: int, client: int) -> LocalResult:
    """Train ``model`` from ``global_state`` on the client's samples ``idx``.

    Returns (new local state, per-client state to keep, mean training loss; None under
    DP-SGD, where the loss is private and never leaves the client).
    """
    from privfedcal.data.augment import apply_augmentation, draw_augmentation

    g = make_generator(spec.training.seed, round_, client, 1)
    model.load_state_dict(global_state)
    model.train()
    algo.begin_client(model, global_state, client_state,
                      client_context(client, y_all[idx], algo.num_classes))
    if spec.dp_sgd is not None:
        from privfedcal.privacy.dpsgd_local import train_dpsgd

        train_dpsgd(model, algo, x_all[idx], y_all[idx], spec, spec.dp_sgd,
                    derive_seed(spec.training.seed, round_, client, 6))
        return LocalResult(clone_state(model), algo.end_client(model), None)
    device = x_all.device
    fmt = train_memory_format(model, x_all)
    # a layout change walks every module (~50 us for the MLP): only when there is one
    relayout = fmt != torch.contiguous_format
    if relayout:
        model.to(memory_format=fmt)  # before the optimiser, whose buffers follow the parameters
    recipe = spec.recipe
    amp = spec.mixed_precision and device.type == "cuda"
    steps = chain_steps(model, algo, x_all, y_all, recipe) or AutogradSteps(model, algo,
                                                                           recipe, amp)
    n, bs = int(idx.numel()), recipe.batch_size
    chunk = epoch_chunk(x_all, bs)
    losses: list[Tensor] = []
    # The epoch's randomness (order, crop offsets, flips) is drawn at once from the CPU
    # generator and copied to the device in one non-blocking transfer per tensor: no step
    # waits on the host. The shuffled samples are gathered a chunk of batches at a time, so a
    # step slices a view instead of launching two gathers (the same values, in the same order).
    for _ in range(recipe.local_epochs):
        order = idx[_to(torch.randperm(n, generator=g), device)]
        draws = tuple(_to(d, device) for d in draw_augmentation(n, g)) if spec.data.augment else ()
        for first in range(0, n, chunk):
            part = order[first:first + chunk]
            xs, ys = x_all[part], y_all[part]
            if not spec.data.augment and relayout:
                xs = xs.contiguous(memory_format=fmt)
            for start in range(0, int(part.numel()), bs):
                if min(bs, n - first - start) < 2 and n >= 2:
                    continue  # a batch of one breaks BatchNorm and batch-statistics losses
                x, y = xs[start:start + bs], ys[start:start + bs]
                if spec.data.augment:
                    at = first + start
                    x = apply_augmentation(x, tuple(d[..., at:at + bs] for d in draws))
                    if relayout:
                        x = x.contiguous(memory_format=fmt)
                losses.append(steps.step(x, y))
    steps.finish()
    if relayout:
        model.to(memory_format=torch.contiguous_format)  # what leaves the client is plain NCHW
    new_client_state = algo.end_client(model)
    return LocalResult(clone_state(model), new_client_state, mean_loss(losses))


#: At most this many bytes of samples are gathered at once for a client's epoch
#: (``epoch_chunk``): a whole epoch of the digits or a CIFAR client of ~2,700 images.
EPOCH_CHUNK_BYTES = 32 << 20


def epoch_chunk(x_all: Tensor, batch_size: int) -> int:
    """How many samples local training gathers at once: whole batches, at most
    ``EPOCH_CHUNK_BYTES`` of ``x_all``'s samples (at least one batch)."""
    row = max(1, x_all[:1].numel() * x_all.element_size())
    return max(1, EPOCH_CHUNK_BYTES // row // batch_size) * batch_size


def mean_loss(losses: list[Tensor]) -> float:
    """The mean of the steps' losses, summed in float32 one after the other from 0 (what
    ``total += loss`` on a float32 scalar gives), with one transfer from the device."""
    if not losses:
        return 0.0
    values = torch.stack(losses).float().cpu().numpy()
    return float(np.add.accumulate(values, dtype=np.float32)[-1]) / len(losses)


def train_memory_format(model: torch.nn.Module, x: Tensor) -> torch.memory_format:
    """Channels-last (NHWC) for convolutional models trained on grayscale images on a CPU,
    else as stored.

    oneDNN's NCHW convolution backward is slow on one input channel: a 28x28 grayscale
    batch of the CNN stepped as slowly as a 32x32 RGB one, and NHWC makes its round ~1.25x
    faster (benchmarks/probes/npz_shapes.py, docs/usage.md "Speed"); on 3-channel images the two
    layouts measured within noise of each other, so those stay NCHW. The weights return to
    NCHW when local training ends, so nothing that leaves the client changes layout; the
    numbers differ from NCHW's in the last bits only."""
    convolutional = any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    if x.device.type == "cpu" and x.dim() == 4 and x.shape[1] == 1 and convolutional:
        return torch.channels_last
    return torch.contiguous_format


#: Largest inference batch on a CPU. The CNN's activations then stay in cache: one thread
#: runs its forward ~1.5-1.8x faster than in batches of 1,024-2,048 (same outputs per image).
CPU_INFERENCE_BATCH = 256


@torch.no_grad()
def evaluate(model: FeatureClassifier, state: State, x: Tensor, y: Tensor, num_classes: int,
             transform=None, batch_size: int = 2048) -> dict[str, Any]:
    """Top-1 accuracy (fraction), per-class accuracy and mean CE loss on (x, y); batches of at
    most ``CPU_INFERENCE_BATCH`` on a CPU."""
    if x.device.type == "cpu":
        batch_size = min(batch_size, CPU_INFERENCE_BATCH)
    model.load_state_dict(state)
    model.eval()
    correct = torch.zeros(num_classes, device=x.device)
    seen = torch.zeros(num_classes, device=x.device)
    loss_sum = torch.zeros((), device=x.device, dtype=torch.float64)
    for start in range(0, x.shape[0], batch_size):
        xb, yb = x[start:start + batch_size], y[start:start + batch_size]
        # fp32, as the calibrators extract the features their heads are trained on
        with autocast_for(x.device, enabled=False):
            z = model.features(xb)
            if transform is not None:
                z = transform(z)
            logits = model.classifier(z).float()
        loss_sum += F.cross_entropy(logits, yb, reduction="sum").double()
        hit = (logits.argmax(1) == yb).float()
        correct.index_add_(0, yb, hit)
        seen.index_add_(0, yb, torch.ones_like(hit))
    per_class = torch.where(seen > 0, correct / seen.clamp_min(1), torch.nan)
    n = float(seen.sum())
    return {
        "accuracy": float(correct.sum()) / n,
        "loss": float(loss_sum) / n,
        "per_class_accuracy": [None if v != v else round(float(v), 6) for v in per_class.tolist()],
    }
