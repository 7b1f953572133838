"""The vectorised trainer (``--client-batch K``): up to K clients of a round train at once.

Each trainable parameter is stacked along a new leading client axis; one training step runs
every active client's forward as one batched computation (``torch.func.vmap`` over
``functional_call``), one backward gives each client the gradient of its own loss (the
per-client losses are summed, and no client's loss depends on another's parameters), and
``StackedSGD`` applies ``torch.optim.SGD``'s update (momentum, weight decay) with one
momentum buffer per client. The numbers are the sequential trainer's (``local.train_client``)
within float32 rounding:

- each client draws its epoch order and augmentation from the generator of
  (seed, round, client, 1), in the same order as ``train_client``;
- a client's steps are its batches in the same order, including the skipped batch of one;
- a short batch is padded to the common batch width with weight-0 rows: the loss is the
  weighted mean over the real rows, the mean ``train_client`` takes;
- clients are sorted by their number of steps, so the clients still training at a step are a
  prefix of the stack: a client that has finished is never computed or moved.

The method's client hooks (``begin_client``/``local_loss``/``end_client``) act on one live
module, so they are not called here: the method's loss runs in its functional form, the one
its class declares (``Algorithm.vector_loss``) or a built-in one
(``vector_losses.vector_loss_of``), tested against its ``local_loss``; server rules run
unchanged.

Refused (``check_vectorisable``): methods without such a form, models with BatchNorm
(padding rows would enter its batch statistics and the running statistics would need one
copy per client) and models with Dropout (its random masks could not be drawn as the
sequential run draws them), and DP-SGD (settings/run_config.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from privfedcal.algorithms.algorithm import Algorithm, State
from privfedcal.federation.local import LocalResult, LocalSpec, autocast_for
from privfedcal.federation.vector_losses import VectorLoss, vector_loss_of
from privfedcal.federation.workers import TrainJob
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.seeding import make_generator
from privfedcal.settings.messages import SettingError

#: module types whose training-mode forward the vectorised trainer cannot reproduce
_REFUSED_MODULES = (nn.modules.batchnorm._BatchNorm, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
                    nn.Dropout3d, nn.AlphaDropout)


def check_vectorisable(model: nn.Module, algo: Algorithm) -> VectorLoss:
    """The vectorised form of ``algo``'s loss; a one-line UsageError unless
    ``--client-batch`` > 1 can train ``model`` with it exactly as the sequential trainer
    does."""
    loss = vector_loss_of(algo)
    if loss is None:
        raise SettingError("{client_batch} > 1: method {method!r} declares no vectorised "
                           "loss (a vector_loss on its class, privfedcal/algorithms/"
                           "vector_loss.py); it trains with {client_batch=}",
                           method=algo.name, client_batch=1)
    for name, module in model.named_modules():
        if isinstance(module, _REFUSED_MODULES):
            kind = "BatchNorm" if isinstance(module, nn.modules.batchnorm._BatchNorm) else "Dropout"
            raise SettingError("{client_batch} > 1 cannot train a model with {kind} ({name}: "
                               "{module}); use {client_batch=} or a model without it (mlp, "
                               "digits-cnn, cnn)", kind=kind, name=name,
                               module=type(module).__name__, client_batch=1)
    return loss


def slow_on_device(model: nn.Module, device: torch.device) -> str | None:
    """A note when ``--client-batch`` is measured slower than sequential training: a model
    with convolutions on a CPU (per-client weights make them grouped convolutions;
    docs/results/engine.md, "Vectorised local training"), else None."""
    if device.type == "cpu" and any(isinstance(m, nn.modules.conv._ConvNd)
                                    for m in model.modules()):
        return ("--client-batch > 1 trains this convolutional model more slowly than "
                "--client-batch 1 on a CPU (measured 0.4-0.6x; docs/results/engine.md); "
                "the numbers are the same either way")
    return None


class StackedSGD:
    """``torch.optim.SGD`` (no dampening, no Nesterov) on parameters stacked along dim 0,
    one momentum buffer per client; ``step(grads, k)`` updates clients ``0..k-1`` only.

    Per client and element: ``g = grad + wd * p``; ``buf = g`` on the first step, else
    ``buf = momentum * buf + g``; ``p = p - lr * buf`` (``local.PlainSGD``'s update). The
    buffers start at zero, so the first step's ``momentum * 0 + g`` is exactly ``g``. Where
    torch has it, the update runs as torch's fused SGD kernel (what
    ``torch.optim.SGD(fused=True)`` calls): one pass over each stacked tensor instead of
    four, which matters because a stack of K clients' parameters no longer fits in cache.
    """

    def __init__(self, params: list[Tensor], *, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, fused: bool | None = None) -> None:
        self.params = params
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.buffers = [torch.zeros_like(p) for p in params] if self.momentum != 0 else []
        self.fused = hasattr(torch, "_fused_sgd_") if fused is None else fused

    @torch.no_grad()
    def step(self, grads: list[Tensor | None], k: int) -> None:
        """One step of clients ``0..k-1``; ``grads`` (k, ...) are consumed (updated in place).
        A parameter without a gradient (unused by the loss) is skipped, as PlainSGD does."""
        live = [i for i, g in enumerate(grads) if g is not None]
        params = [self.params[i][:k] for i in live]
        gs: list[Tensor] = [grads[i] for i in live]  # type: ignore[misc]
        bufs = [self.buffers[i][:k] for i in live] if self.momentum != 0 else []
        # The fused kernel walks its tensors' memory in order: only tensors with one dense
        # layout (the trainer lays the stacks out as autograd returns the gradients) go to
        # it; any other runs op by op, which follows strides.
        fused = [j for j, (p, g) in enumerate(zip(params, gs, strict=True))
                 if self.fused and p.stride() == g.stride() and _dense(p)]
        if fused:
            torch._fused_sgd_([params[j] for j in fused], [gs[j] for j in fused],  # type: ignore[attr-defined]
                              [bufs[j] for j in fused] if bufs else [],
                              weight_decay=self.weight_decay, momentum=self.momentum,
                              lr=self.lr, dampening=0.0, nesterov=False, maximize=False,
                              is_first_step=False)
        done = set(fused)
        for j, (p, g) in enumerate(zip(params, gs, strict=True)):
            if j in done:
                continue
            if self.weight_decay != 0:
                g.add_(p, alpha=self.weight_decay)
            if self.momentum != 0:
                g = bufs[j].mul_(self.momentum).add_(g, alpha=1.0)
            p.add_(g, alpha=-self.lr)


def _dense(t: Tensor) -> bool:
    """Whether ``t`` fills its memory without gaps or overlaps (in some order of its dims)."""
    strides = t.stride()
    order = sorted(range(t.ndim), key=lambda d: -strides[d])
    return t.permute(order).is_contiguous()


def stack_clients(value: Tensor, k: int) -> Tensor:
    """``value`` repeated for ``k`` clients along a new dim 0. A matrix (a linear layer's
    weight) is stored transposed, (k, in, out) memory viewed as (k, out, in): the layout
    in which vmap's backward of a linear layer returns its gradient, so that the SGD update
    runs on matching layouts (``StackedSGD``)."""
    if value.ndim == 2:
        out = value.new_empty(k, value.shape[1], value.shape[0]).transpose(1, 2)
    else:
        out = value.new_empty(k, *value.shape)
    out.copy_(value.expand(k, *value.shape))
    return out


@dataclass
class StepPlan:
    """Every step of a group of clients, padded to a (steps, clients, width) grid.

    ``index``: sample indices into the training tensors; ``weight``: 1 for a real row, 0 for
    padding; ``draws``: the augmentation draws per row (offsets (T, 2, K, W), flips (T, K, W))
    or (); ``steps``: each client's number of steps, in descending order (clients sorted)."""

    index: Tensor
    weight: Tensor
    draws: tuple[Tensor, ...]
    steps: list[int]


def client_steps(n: int, spec: LocalSpec, g: torch.Generator, width: int
                 ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """One client's batches as ``train_client`` forms them: per epoch a permutation of its
    ``n`` samples (then the augmentation draws, from the same generator in the same order),
    cut into batches of ``spec.training.batch_size``; a last batch of one sample is skipped when
    ``n >= 2``. Returns positions (S, width) into the client's samples, weights (S, width)
    and the draws laid out the same way; padding rows point at position 0 with weight 0."""
    from privfedcal.data.augment import draw_augmentation

    bs = spec.recipe.batch_size
    nb = math.ceil(n / bs)
    # train_client skips a batch of one sample when n >= 2: with batch size 1 every batch,
    # else at most the last one
    keep = nb if n < 2 else (0 if bs == 1 else nb - (n - (nb - 1) * bs == 1))
    # batch b holds epoch positions b*bs .. b*bs+bs-1; only the first `width` columns of a
    # batch can be real (width >= min(bs, n)); the same grid serves every epoch
    grid = torch.arange(keep * bs).view(keep, bs)[:, :width]
    ok = grid < n
    safe = torch.where(ok, grid, torch.zeros_like(grid))
    orders, offs, flips = [], [], []
    for _ in range(spec.recipe.local_epochs):
        orders.append(torch.randperm(n, generator=g))
        if spec.data.augment:
            offsets, flipped = draw_augmentation(n, g)
            offs.append(offsets[:, safe])  # (2, S, width)
            flips.append(flipped[safe])
    real = ok.repeat(len(orders), 1)
    pos = torch.stack(orders)[:, safe].reshape(-1, width).masked_fill_(~real, 0)
    drawn = (torch.cat(offs, 1), torch.cat(flips, 0)) if offs else ()
    return pos, real.float(), drawn


def plan_steps(jobs: list[TrainJob], spec: LocalSpec, round_: int) -> tuple[list[int], StepPlan]:
    """The step grid of ``jobs``: (job positions sorted by steps, most first; the plan)."""
    from torch.nn.utils.rnn import pad_sequence

    sizes = [int(j.indices.numel()) for j in jobs]
    width = max(1, min(spec.recipe.batch_size, max(sizes)))
    seed = spec.training.seed
    per_client = [client_steps(n, spec, make_generator(seed, round_, j.client, 1), width)
                  for n, j in zip(sizes, jobs, strict=True)]
    order = sorted(range(len(jobs)), key=lambda i: -per_client[i][0].shape[0])
    steps = [per_client[i][0].shape[0] for i in order]
    # pad_sequence stacks (S_c, ...) along a new dim 1, zero-filled to the longest S_c:
    # (T, K, width), client c's steps in column c
    index = pad_sequence([jobs[i].indices.cpu()[per_client[i][0]] for i in order])
    weight = pad_sequence([per_client[i][1] for i in order])
    draws: tuple[Tensor, ...] = ()
    if spec.data.augment:
        offsets = pad_sequence([per_client[i][2][0].permute(1, 0, 2) for i in order])
        draws = (offsets.permute(0, 2, 1, 3), pad_sequence([per_client[i][2][1] for i in order]))
    return order, StepPlan(index, weight, draws, steps)


class _FeaturesAndLogits(nn.Module):
    """``(model.features(x), model.classifier(z))`` as one forward, for functional_call."""

    def __init__(self, model: FeatureClassifier) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        z = self.model.features(x)
        return z, self.model.classifier(z)


class VectorisedTrainer:
    """Trains the round's clients ``client_batch`` at a time as one batched computation;
    the same interface and results as ``workers.InProcessTrainer``."""

    def __init__(self, model: FeatureClassifier, algo: Algorithm, x: Tensor, y: Tensor,
                 spec: LocalSpec, client_batch: int) -> None:
        loss = check_vectorisable(model, algo)
        if spec.dp_sgd is not None:
            raise SettingError("{client_batch} > 1 cannot train with {dp_train} (DP-SGD trains "
                               "clients one at a time); use {client_batch=}", client_batch=1)
        self.model, self.algo, self.x, self.y, self.spec = model, algo, x, y, spec
        self.client_batch = client_batch
        self.loss: VectorLoss = loss
        self.view = _FeaturesAndLogits(model)

    def train(self, global_state: State, jobs: list[TrainJob], round_: int,
              consume: Callable[[State], None] | None = None) -> list[LocalResult]:
        """``workers.Trainer.train``: ``client_batch`` clients at a time."""
        out: list[LocalResult] = []
        for start in range(0, len(jobs), self.client_batch):
            for r in self._train_group(global_state, jobs[start:start + self.client_batch],
                                       round_):
                if consume is not None:
                    consume(r.state)
                    r = r._replace(state={})
                out.append(r)
        return out

    def _train_group(self, global_state: State, jobs: list[TrainJob], round_: int
                     ) -> list[LocalResult]:
        """Every step of ``jobs`` (at most ``client_batch`` clients) as one batched step."""
        spec, model, device = self.spec, self.model, self.x.device
        model.load_state_dict(global_state)
        model.train()
        order, plan = plan_steps(jobs, spec, round_)
        k_all = len(jobs)
        # view keys: the wrapper's parameter names ("model." + the state-dict key)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        fixed = {f"model.{n}": t.detach() for n, t in
                 list(model.named_parameters()) + list(model.named_buffers())
                 if n not in trainable}
        stacked = [stack_clients(global_state[n].detach().to(device), k_all) for n in trainable]
        anchor = {f"model.{n}": global_state[n].detach().to(device) for n in trainable}
        recipe = spec.recipe
        opt = StackedSGD(stacked, lr=recipe.lr, momentum=recipe.momentum,
                         weight_decay=recipe.weight_decay)
        extra = self.loss.prepare(self, global_state, [jobs[i].client_state for i in order])
        names = [f"model.{n}" for n in trainable]
        view, algo, loss_fn = self.view, self.algo, self.loss

        def forward(params: State, x: Tensor) -> tuple[Tensor, Tensor]:
            return functional_call(view, {**fixed, **params}, (x,))

        def client_loss(params: State, x: Tensor, y: Tensor, w: Tensor, ext: State) -> Tensor:
            return loss_fn.loss(algo, forward, params, anchor, x, y, w, ext)

        batched = vmap(client_loss)
        index, weight = plan.index.to(device), plan.weight.to(device)
        draws = tuple(d.to(device) for d in plan.draws)
        totals = torch.zeros(k_all, device=device)
        for t in range(index.shape[0]):
            k = sum(1 for s in plan.steps if s > t)  # clients still training: a prefix
            rows = index[t, :k].reshape(-1)
            x, y = self.x[rows], self.y[rows]
            if spec.data.augment:
                from privfedcal.data.augment import apply_augmentation

                x = apply_augmentation(x, (draws[0][t, :, :k].reshape(2, -1),
                                           draws[1][t, :k].reshape(-1)))
            width = index.shape[2]
            x = x.reshape(k, width, *x.shape[1:])
            y = y.reshape(k, width)
            live = [p[:k].detach().requires_grad_() for p in stacked]
            with autocast_for(device, spec.mixed_precision):
                losses = batched(dict(zip(names, live, strict=True)), x, y, weight[t, :k],
                                 {key: v[:k] for key, v in extra.items()})
            grads = torch.autograd.grad(losses.sum(), live, allow_unused=True)
            opt.step(list(grads), k)
            totals[:k] += losses.detach().float()
        return self._results(global_state, jobs, order, plan, trainable, stacked, totals)

    def _results(self, global_state: State, jobs: list[TrainJob], order: list[int],
                 plan: StepPlan, trainable: list[str], stacked: list[Tensor], totals: Tensor
                 ) -> list[LocalResult]:
        position = {n: i for i, n in enumerate(trainable)}
        results: list[LocalResult | None] = [None] * len(jobs)
        for col, i in enumerate(order):
            # trained entries are rows of the stacks (copied only where stored transposed:
            # nothing writes to the stacks after training); the others are copies of the
            # received ones, as clone_state's
            state = {key: (stacked[position[key]][col].contiguous() if key in position
                           else v.detach().clone()) for key, v in global_state.items()}
            loss = float(totals[col]) / max(plan.steps[col], 1)
            results[i] = LocalResult(state, self.loss.client_state(state), loss)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        pass

    def terminate(self) -> None:
        pass
