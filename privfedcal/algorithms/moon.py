"""MOON, model-contrastive federated learning (Li, He & Song, CVPR 2021, Eq. 1-3)::

    l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )
    L     = CE + mu * l_con

sim is cosine similarity; z = ``model.features(x)`` (for the CCVR/MOON CNN: the projection
head output); z_glob from the global model the client received, z_prev from this client's
previous local model. A client without a previous model (its first round) would compare the
global model with itself (MOON's code): both similarities are equal, l_con is the constant
log 2 and its gradient is zero, so we drop the term there and the round reports l_con = 0.

Our choice: z_glob and z_prev are computed with ``torch.func.functional_call`` on the live
module (no model copies), under ``torch.no_grad()`` and with the module in eval mode, so
BatchNorm uses the stored running statistics and no buffer of the live model, or of the
stored states, is touched (MOON's code also runs the global and previous nets in eval mode).
Under mixed precision (autocast), the weights and biases of the frozen models' linear and
convolution layers are cast to the autocast dtype once per client instead of on every step
(autocast re-casts tensors that need no gradient at every call); the other entries
(normalisation layers, buffers) stay as stored, so the features are the same as with
per-step casting (tested).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from privfedcal.algorithms._checks import check_number
from privfedcal.algorithms.algorithm import Algorithm, ClientContext, State, hyper
from privfedcal.algorithms.vector_loss import Forward, VectorLoss, weighted_ce, weighted_mean
from privfedcal.models.feature_classifier import FeatureClassifier


def moon_contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, tau: float) -> Tensor:
    """Batch mean of MOON's l_con: CE over ``[sim(z, z_glob), sim(z, z_prev)] / tau``, target 0."""
    sims = torch.stack(
        [F.cosine_similarity(z, z_glob, dim=1), F.cosine_similarity(z, z_prev, dim=1)], dim=1
    )
    target = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    return F.cross_entropy(sims / tau, target)


class _FeatureView(nn.Module):
    """Exposes ``model.features`` as ``forward`` so that functional_call can run it."""

    def __init__(self, model: FeatureClassifier) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model.features(x)


class MoonLoss(VectorLoss):
    """MOON: ``CE + mu * l_con`` with z_glob from the received model and z_prev from the
    client's previous local model; a client without one (first round) has CE only, as in
    ``Moon.local_loss`` (its placeholder z_prev is z_glob, multiplied by 0)."""

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
        # the frozen models' features carry no gradient (as ``Moon`` computes them, under no_grad)
        z_glob = forward(anchor, x)[0].detach()
        z_prev = forward(prev, x)[0].detach()
        sims = torch.stack([F.cosine_similarity(z, z_glob, dim=1),
                            F.cosine_similarity(z, z_prev, dim=1)], dim=1) / algo.params.tau
        target = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
        con = weighted_mean(F.cross_entropy(sims, target, reduction="none"), w)
        return ce + algo.params.mu * ext["has_prev"] * con

    def client_state(self, state: State) -> State | None:
        return {k: v.clone() for k, v in state.items()}


@dataclasses.dataclass(frozen=True)
class MoonParams:
    """tau: temperature (paper: 0.5); mu: weight of l_con (paper uses 1 or 5)."""

    tau: float = hyper(0.5, "temperature of the contrastive loss")
    mu: float = hyper(1.0, "weight of the contrastive loss l_con")

    def __post_init__(self) -> None:
        check_number("moon", "tau", self.tau, low_open=True)
        check_number("moon", "mu", self.mu)


class Moon(Algorithm):
    """FedAvg plus the model-contrastive term; the client state is its last local model."""

    name = "moon"
    Params = MoonParams
    vector_loss = MoonLoss()

    _view: _FeatureView | None = None
    _glob: State | None = None
    _prev: State | None = None
    _cast: dict[torch.dtype, tuple[State, State | None]] | None = None

    def begin_client(
        self, model: FeatureClassifier, global_state: State, client_state: State | None,
        ctx: ClientContext | None = None,
    ) -> None:
        device = next(model.parameters()).device
        self._view = _FeatureView(model)
        self._glob = _view_state(global_state, device)
        self._prev = None if client_state is None else _view_state(client_state, device)
        self._cast = {}

    def _frozen_states(self, device_type: str) -> tuple[State, State | None]:
        """The frozen (global, previous) states for this step: as stored, or with their
        autocast-cast entries pre-cast (once per client) when autocast is on."""
        assert self._view is not None and self._glob is not None and self._cast is not None
        if not torch.is_autocast_enabled(device_type):
            return self._glob, self._prev
        dtype = torch.get_autocast_dtype(device_type)
        if dtype not in self._cast:
            keys = _autocast_keys(self._view)
            self._cast[dtype] = (_precast(self._glob, keys, dtype),
                                 None if self._prev is None else _precast(self._prev, keys, dtype))
        return self._cast[dtype]

    def _frozen_features(self, state: State, x: Tensor) -> Tensor:
        assert self._view is not None
        model = self._view.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                return functional_call(self._view, state, (x,))
        finally:
            model.train(was_training)

    def local_loss(self, model: FeatureClassifier, x: Tensor, y: Tensor) -> Tensor:
        if self._glob is None:
            raise RuntimeError("moon: begin_client must be called before local_loss")
        z = model.features(x)
        ce = F.cross_entropy(model.classifier(z), y)
        if self._prev is None:  # first round of this client: z_prev = z_glob, l_con = log 2
            return ce
        glob, prev = self._frozen_states(x.device.type)
        assert prev is not None
        z_glob = self._frozen_features(glob, x)
        z_prev = self._frozen_features(prev, x)
        return ce + self.params.mu * moon_contrastive_loss(z, z_glob, z_prev, self.params.tau)

    def end_client(self, model: FeatureClassifier) -> State | None:
        self._view = self._glob = self._prev = self._cast = None
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _view_state(state: State, device: torch.device) -> State:
    """Detached clones of the extractor entries, keyed for ``_FeatureView``."""
    return {
        f"model.{k}": v.detach().to(device).clone()
        for k, v in state.items()
        if not k.startswith("classifier.")
    }


#: layers whose weight and bias autocast casts to its lower-precision dtype (linear, conv)
_AUTOCAST_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _autocast_keys(view: nn.Module) -> frozenset[str]:
    """State keys of ``view`` that autocast would cast on every call: linear/conv params."""
    keys: set[str] = set()
    for name, module in view.named_modules():
        if isinstance(module, _AUTOCAST_LAYERS):
            keys.update(f"{name}.{p}" for p, _ in module.named_parameters(recurse=False))
    return frozenset(keys)


def _precast(state: State, keys: frozenset[str], dtype: torch.dtype) -> State:
    """``state`` with the floating entries in ``keys`` cast to ``dtype`` (the rest shared)."""
    return {k: v.to(dtype) if k in keys and v.is_floating_point() else v
            for k, v in state.items()}
