"""Linear CKA between the same layer of different client models (Kornblith et al. 2019).

CCVR (Luo et al. 2021, sec. 3.2 and appendix B, figs. 1-2) compares client models layer
by layer on the same inputs with linear centred kernel alignment:

    CKA(X, Y) = ||X^T Y||_F^2 / (||X^T X||_F ||Y^T Y||_F)

for features ``X`` (n x p) and ``Y`` (n x q) whose columns have been centred. (The
appendix prints the denominator norms squared; that is a typo: with squares CKA(X, X)
would not be 1. We follow Kornblith et al.) Everything is computed in float64.

Two equal ways to evaluate it, picked by cost: in feature space (``p x q`` products, cheap
when ``n`` is large) or with the centred Gram matrices ``K = X X^T`` (``n x n``), using
``||X^T Y||_F^2 = <K, L>_F`` (cheap for wide conv layers and few inputs).
CKA is undefined (NaN) for a layer whose features are constant over the inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from privfedcal.errors import UsageError

__all__ = ["CKAResult", "cka_matrix", "layer_features", "linear_cka", "pairwise_cka"]


def _centred(x: Tensor, name: str) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise UsageError(f"{name} must be a tensor of shape (n_samples, ...), got {x!r:.60}")
    x = x.detach().reshape(x.shape[0], -1).to(torch.float64)
    if x.shape[0] < 2:
        raise UsageError(f"CKA needs at least 2 samples, {name} has {x.shape[0]}")
    if not torch.isfinite(x).all():
        raise UsageError(f"{name} contains NaN or Inf")
    return x - x.mean(dim=0, keepdim=True)


def pairwise_cka(features: Sequence[Tensor]) -> Tensor:
    """Symmetric ``(K, K)`` float64 matrix of linear CKA between K feature sets on the same n inputs.

    Each set is ``(n, ...)`` and is flattened per sample; widths may differ between sets.
    """
    if len(features) < 1:
        raise UsageError("pairwise_cka needs at least one feature set")
    xs = [_centred(f, f"feature set {i}") for i, f in enumerate(features)]
    n = xs[0].shape[0]
    if any(x.shape[0] != n for x in xs):
        raise UsageError(
            f"all feature sets must have the same number of samples, got {[x.shape[0] for x in xs]}"
        )
    widths = [x.shape[1] for x in xs]
    device = xs[0].device
    xs = [x.to(device) for x in xs]
    if n < 2 * max(widths):
        # Gram form: normalised centred Grams, then one matrix product gives every pair.
        grams = torch.stack([(x @ x.T).reshape(-1) for x in xs])
        norms = torch.linalg.vector_norm(grams, dim=1)
        cross = grams @ grams.T
    else:
        # Feature form: ||X_i^T X_j||_F^2, one p x q product per pair (K is small).
        k = len(xs)
        cross = torch.empty(k, k, dtype=torch.float64, device=device)
        for i in range(k):
            for j in range(i, k):
                cross[i, j] = cross[j, i] = torch.linalg.matrix_norm(xs[i].T @ xs[j]).square()
        norms = cross.diagonal().sqrt()
    # 0/0 -> NaN on purpose: CKA is undefined for constant features.
    return cross / (norms[:, None] * norms[None, :])


def linear_cka(x: Tensor, y: Tensor) -> float:
    """Linear CKA of features ``x`` (n x p) and ``y`` (n x q) on the same n inputs, in [0, 1]."""
    return float(pairwise_cka([x, y])[0, 1])


def layer_features(
    model: nn.Module, x: Tensor, layers: Sequence[str], *, batch_size: int | None = None
) -> dict[str, Tensor]:
    """Outputs of the named sub-modules of ``model`` on inputs ``x``, flattened per sample.

    Uses forward hooks on ``model.named_modules()``; the model runs in eval mode under
    ``torch.no_grad`` and its training flag is restored afterwards. A module that runs more
    than once per forward pass (a shared ``nn.ReLU``) is refused: its output is ambiguous.
    Returns ``{layer: Tensor (n, numel per sample)}`` on the model's output device.
    """
    if isinstance(layers, str):
        layers = [layers]
    modules = dict(model.named_modules())
    missing = [name for name in layers if name not in modules]
    if missing or not layers:
        valid = ", ".join(name for name in modules if name) or "(none)"
        raise UsageError(f"unknown layer(s) {missing or '(none given)'}; valid layers: {valid}")
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    step = x.shape[0] if batch_size is None else batch_size
    chunks: dict[str, list[Tensor]] = {name: [] for name in layers}
    calls: dict[str, int] = {}

    def make_hook(name: str):
        def hook(_module: nn.Module, _inputs: object, output: object) -> None:
            if not isinstance(output, Tensor):
                raise UsageError(f"layer {name!r} does not output a single tensor")
            calls[name] = calls.get(name, 0) + 1
            chunks[name].append(output.detach().reshape(output.shape[0], -1))

        return hook

    handles = [modules[name].register_forward_hook(make_hook(name)) for name in layers]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, x.shape[0], step):
                calls.clear()
                model(x[start : start + step])
                for name in layers:
                    if calls.get(name, 0) != 1:
                        raise UsageError(
                            f"layer {name!r} ran {calls.get(name, 0)} times in one forward pass; "
                            "CKA needs a module that runs exactly once"
                        )
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return {name: torch.cat(parts) for name, parts in chunks.items()}


@dataclass(frozen=True)
class CKAResult:
    """Pairwise CKA between clients for each layer.

    ``matrices[layer]`` is the symmetric ``(K, K)`` CKA matrix (CCVR fig. 1);
    ``mean[layer]`` the mean over the K(K-1)/2 distinct client pairs (CCVR fig. 2).
    """

    layers: tuple[str, ...]
    matrices: dict[str, Tensor]
    mean: dict[str, float]


def cka_matrix(
    models_or_feature_sets: Sequence[nn.Module] | Sequence[Mapping[str, Tensor]],
    x: Tensor | None = None,
    layers: Sequence[str] | None = None,
    *,
    batch_size: int | None = None,
) -> CKAResult:
    """Pairwise linear CKA between client models (or their precomputed features) per layer.

    Pass either K models together with shared inputs ``x`` and ``layers``, or K mappings
    ``{layer: features (n, ...)}`` computed on the same inputs (``layers`` then defaults to
    the first mapping's keys).
    """
    items = list(models_or_feature_sets)
    if len(items) < 2:
        raise UsageError(
            f"CKA between clients needs at least 2 models or feature sets, got {len(items)}"
        )
    models = [item for item in items if isinstance(item, nn.Module)]
    mappings = [item for item in items if isinstance(item, Mapping)]
    feature_sets: list[Mapping[str, Tensor]]
    if len(models) == len(items):
        if x is None or layers is None:
            raise UsageError("cka_matrix on models needs the shared inputs x and the layer names")
        feature_sets = [layer_features(m, x, layers, batch_size=batch_size) for m in models]
    elif len(mappings) == len(items):
        feature_sets = mappings
        layers = list(mappings[0]) if layers is None else layers
    else:
        raise UsageError(
            "cka_matrix takes a list of models or a list of {layer: features} mappings"
        )
    layers = tuple([layers] if isinstance(layers, str) else layers)
    matrices: dict[str, Tensor] = {}
    mean: dict[str, float] = {}
    for layer in layers:
        absent = [i for i, fs in enumerate(feature_sets) if layer not in fs]
        if absent:
            raise UsageError(f"layer {layer!r} missing from feature set(s) {absent}")
        mat = pairwise_cka([fs[layer] for fs in feature_sets])
        upper = torch.triu_indices(mat.shape[0], mat.shape[0], offset=1, device=mat.device)
        matrices[layer] = mat
        mean[layer] = float(mat[upper[0], upper[1]].mean())
    return CKAResult(layers=layers, matrices=matrices, mean=mean)
