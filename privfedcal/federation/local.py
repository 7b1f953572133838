"""Local training and evaluation: the hot path, shared by the in-process and worker trainers.

Data stay device tensors; a client is an index tensor; batches are gathered by index and
augmented with batched tensor code. Every random draw comes from a generator seeded by
(seed, round, client), so a run is reproducible on CPU and resumable from any round.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.algorithms.algorithm import Algorithm, State, client_context
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.seeding import derive_seed, make_generator
from privfedcal.settings.floors import LocalSpec


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
            grads = list(torch._foreach_add(grads, params, alpha=self.weight_decay))
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
    params: list[Tensor] = [p for p in model.parameters() if p.requires_grad]
    recipe = spec.recipe
    opt = PlainSGD(params, lr=recipe.lr, momentum=recipe.momentum,
                   weight_decay=recipe.weight_decay)
    n = int(idx.numel())
    total, steps = torch.zeros((), device=device), 0
    # The epoch's randomness (order, crop offsets, flips) is drawn at once from the CPU
    # generator and copied to the device in one non-blocking transfer per tensor: no step
    # waits on the host.
    for _ in range(recipe.local_epochs):
        order = idx[_to(torch.randperm(n, generator=g), device)]
        draws = tuple(_to(d, device) for d in draw_augmentation(n, g)) if spec.data.augment else ()
        for start in range(0, n, recipe.batch_size):
            batch = order[start:start + recipe.batch_size]
            if batch.numel() < 2 and n >= 2:
                continue  # a batch of one breaks BatchNorm and batch-statistics losses
            x, y = x_all[batch], y_all[batch]
            if spec.data.augment:
                x = apply_augmentation(x, tuple(d[..., start:start + recipe.batch_size]
                                                for d in draws))
            x = x.contiguous(memory_format=fmt)
            with autocast_for(device, spec.mixed_precision):
                loss = algo.local_loss(model, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach().float()
            steps += 1
    if relayout:
        model.to(memory_format=torch.contiguous_format)  # what leaves the client is plain NCHW
    new_client_state = algo.end_client(model)
    return LocalResult(clone_state(model), new_client_state, float(total) / max(steps, 1))


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
