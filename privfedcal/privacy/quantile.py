"""Choosing the feature clip privately: a DP quantile of the clients' feature norms.

CCVR's release is calibrated to a feature clip R (sensitivities 1, R, R^2 for count, sum and
outer; ``dp.py``). Picking R by looking at the feature norms centrally leaks them; this
module picks it from a differentially private estimate of a quantile of the norms, charged
to the same budget as the calibration release (docs/privacy/feature-clip.md, "Choosing the
feature clip without a central look").

The mechanism is a noisy histogram of feature norms over a PUBLIC geometric grid, in the
spirit of adaptive clipping (Andrew et al., NeurIPS 2021, "Differentially Private Learning
with Adaptive Clipping"), which releases noisy counts of norms below a candidate clip and
moves the clip geometrically towards a target quantile. Here, where the neighbouring
datasets differ in one sample (not one client), counts over a whole grid of candidates cost
no more than one count, so a grid is released at once:

* client half (``noisy_norm_histogram``): the client's counts of norms in the bins of the
  grid ``(-inf, e_0], (e_0, e_1], ..., (e_{B-1}, inf)``, plus Gaussian noise of std
  ``z * sqrt(share)`` per bin. Adding or removing one sample changes one bin by 1, so the
  histogram has L2 sensitivity ``SENSITIVITY`` = 1 and the release is a Gaussian mechanism
  with noise multiplier z (sample-level neighbours, as every privfedcal release);
* server half (``quantile_from_histogram``): sums the noisy histograms, fits a
  non-increasing curve to the counts above each edge (isotonic regression, pure
  post-processing) and returns the edge where that curve crosses ``(1 - quantile) N``,
  interpolated geometrically inside the bin;
* two stages: a coarse grid (one bin per octave over ``[low, high]``) locates the median
  (``locate_quantile``), then a fine grid (``per_octave`` bins per octave, from ``below``
  octaves under that median to ``above`` octaves over it, 1 and 1.5 by default)
  estimates the target quantile. Every bin between the estimate and the top of a grid adds
  its noise to the count above the estimate, so a fine grid over the whole public range
  drowns high quantiles in the noise of empty bins, and so does a coarse stage aimed at the
  target itself; the median sits under half of the samples and is found within an octave
  even at small epsilon, and the fine grid's last bin holds everything above it
  (``benchmarks/privacy/clip_estimators.py``; docs/results/privacy.md has the comparison). A quantile
  more than ``above`` octaves over the median (2.8 times it) is estimated as the grid's
  top: the clip then clips more than the target share, which biases the statistics but
  adds no noise (below ``below`` octaves under it, the bottom: a larger clip than asked).

Accounting: the two stages are Gaussian releases at q = 1 with noise multipliers
``z / sqrt(w)`` and ``z / sqrt(1 - w)`` (``w = locate_share``), whose RDP curves add up to
exactly that of ONE Gaussian release of multiplier z (``a / (2 z^2)`` at order a), so the
clip is planned as one release (``QUANTILE_RELEASE``, q = 1, one step) together with the
calibration releases in one ``plan_noise`` call (``plan_clip_noise``): the clip's release is
calibrated alone to ``share * target`` and the calibration releases take the rest, so the
composition of everything in opacus' accountant stays within the target.

The guarantee holds for what the server sees of the histograms when every client adds its
noise from OS entropy (``noise.noise_generator``) and sends one histogram per stage at that
stage's multiplier (a client ledger's limit: ``STAGES``); the grid's edges and the estimates
are public, and the second stage's edges depending on the first stage's output is the
adaptive composition RDP covers. A client reporting false norms can move the clip, which is
a matter of accuracy, not privacy: every feature is clipped to the public clip, so any clip
keeps the calibration release's sensitivities.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from privfedcal.errors import UsageError
from privfedcal.privacy.accounting import ReleasePlan, compute_epsilon, plan_noise
from privfedcal.privacy.noise import noise_generator

#: the label of the clip's releases in plans, accountants and client ledgers
QUANTILE_RELEASE = "feature-clip"
#: L2 change of a client's norm histogram when one sample is added or removed
SENSITIVITY = 1.0
#: most bins a client accepts in one histogram (the count does not change the privacy, only
#: the upload's size: a server cannot make a client send a histogram without bound)
MAX_BINS = 4096
#: histograms each client sends for one clip (the located median, then the fine grid)
STAGES = 2
#: inputs per forward pass when a client's data come as one tensor
FEATURE_BATCH = 1024
#: the calibration release a clip is chosen for by default: one upload per client, q = 1
ONE_SHOT = ReleasePlan("calibration", 1.0, 1)


@dataclass(frozen=True)
class ClipSearch:
    """The public parameters of the private clip: target ``quantile`` of the feature norms;
    ``share`` of the epsilon budget it spends; the grid's range ``[low, high]`` (norms
    outside fall in the end bins); the first stage's ``locate_quantile`` and its share
    ``locate_share`` of the clip's noise budget (1 / z^2); the fine grid's ``per_octave``
    bins per octave from ``below`` octaves under the located quantile to ``above`` over.
    The default quantile, the median, is estimated within 2% at epsilon 0.8 and clips half
    of the samples; with it DP CCVR at epsilon 8 on the digits MLP scored 5.7 points over
    the fixed clip 10 after 5 rounds and 1.6 under it after 30 (where 10 is the 9th
    percentile). Lower targets did better there (0.1: 7.4 over, 0.7 under), high ones
    worse, and 0.99 is unreliable on small federations (docs/results/privacy.md, "Choosing
    the feature clip privately")."""

    quantile: float = 0.5
    share: float = 0.1
    low: float = 1e-2
    high: float = 1e4
    locate_quantile: float = 0.5
    locate_share: float = 0.2
    per_octave: int = 4
    below: float = 1.0
    above: float = 1.5

    def __post_init__(self) -> None:
        checks = [
            (0 < self.quantile < 1, f"clip quantile must be in (0, 1), got {self.quantile}"),
            (0 < self.share < 1, f"clip budget share must be in (0, 1), got {self.share}"),
            (math.isfinite(self.high) and 0 < self.low < self.high,
             f"clip grid needs 0 < low < high (finite), got [{self.low}, {self.high}]"),
            (0 < self.locate_quantile < 1,
             f"locate_quantile must be in (0, 1), got {self.locate_quantile}"),
            (0 < self.locate_share < 1,
             f"locate_share must be in (0, 1), got {self.locate_share}"),
            (1 <= self.per_octave <= 64, f"per_octave must be in [1, 64], got {self.per_octave}"),
            (0 < self.below <= 16 and 0 < self.above <= 16,
             f"below and above must be in (0, 16] octaves, got {self.below}, {self.above}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)
        if math.log2(self.high / self.low) + 2 > MAX_BINS:
            raise UsageError(f"clip grid [{self.low}, {self.high}] has more than {MAX_BINS} "
                             "bins")

    def stage_sigmas(self, noise_multiplier: float) -> tuple[float, float]:
        """The two stages' multipliers, composing to one release of ``noise_multiplier``."""
        return (noise_multiplier / math.sqrt(self.locate_share),
                noise_multiplier / math.sqrt(1.0 - self.locate_share))

    def first_edges(self) -> Tensor:
        """Edges of the first stage: one per octave over ``[low, high]``."""
        return geometric_edges(self.low, self.high, 1)

    def fine_edges(self, centre: float) -> Tensor:
        """Edges of the second stage around the first stage's estimate ``centre``, inside
        ``[low, high]``."""
        lo = min(max(centre / 2.0 ** self.below, self.low), self.high / 2.0)
        hi = max(min(centre * 2.0 ** self.above, self.high), 2.0 * lo)
        return geometric_edges(lo, hi, self.per_octave)


def geometric_edges(low: float, high: float, per_octave: int) -> Tensor:
    """``low * 2^(k / per_octave)`` for k = 0.. up to the first edge >= ``high`` (float64)."""
    count = max(1, math.ceil(math.log2(high / low) * per_octave - 1e-9))
    return low * 2.0 ** (torch.arange(count + 1, dtype=torch.float64) / per_octave)


def check_edges(edges: Tensor) -> Tensor:
    """``edges`` as float64 after checking them (finite, > 0, increasing, at most
    ``MAX_BINS`` bins): what a client does with edges a server sent."""
    e = torch.as_tensor(edges, dtype=torch.float64).flatten()
    if e.numel() < 1 or e.numel() + 1 > MAX_BINS:
        raise UsageError(f"clip edges: need 1 to {MAX_BINS - 1} edges, got {e.numel()}")
    if not bool(torch.isfinite(e).all()) or bool((e <= 0).any()) or bool((e.diff() <= 0).any()):
        raise UsageError("clip edges must be finite, > 0 and increasing")
    return e


def norm_histogram(norms: Tensor, edges: Tensor) -> Tensor:
    """Counts (float64, ``len(edges) + 1``) of ``norms`` in ``(-inf, e_0], (e_0, e_1], ...,
    (e_last, inf)``; a non-finite norm counts in the last bin (it is one sample either way)."""
    e = check_edges(edges)
    n = torch.as_tensor(norms).detach().flatten().to(device="cpu", dtype=torch.float64)
    n = torch.nan_to_num(n, nan=math.inf, posinf=math.inf, neginf=0.0)
    bins = torch.searchsorted(e, n, side="left")  # bin i: e_{i-1} < norm <= e_i
    return torch.bincount(bins, minlength=e.numel() + 1).to(torch.float64)


def noisy_norm_histogram(norms: Tensor, edges: Tensor, noise_multiplier: float, *,
                         share: float = 1.0, generator: torch.Generator | None = None
                         ) -> Tensor:
    """A client's release: ``norm_histogram`` plus Gaussian noise of std
    ``noise_multiplier * SENSITIVITY * sqrt(share)`` per bin. ``share`` < 1 only where the
    histograms are summed securely and every one of n clients adds its part (as
    ``DPAccounting.share``, 1/(n-1)). ``generator``: for tests only; by default the noise comes
    from OS entropy, never from a seed the server knows."""
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise UsageError(f"noise multiplier must be finite and > 0, got {noise_multiplier}")
    if not 0 < share <= 1:
        raise UsageError(f"noise share must be in (0, 1], got {share}")
    counts = norm_histogram(norms, edges)
    g = generator if generator is not None else noise_generator()
    noise = torch.randn(counts.shape, generator=g, dtype=torch.float64,
                        device=g.device).cpu()
    return counts + noise_multiplier * SENSITIVITY * math.sqrt(share) * noise


def _non_increasing(y: Tensor) -> Tensor:
    """Least-squares non-increasing fit of ``y`` (pool adjacent violators)."""
    means: list[float] = []
    sizes: list[int] = []
    for v in y.tolist():
        means.append(v)
        sizes.append(1)
        while len(means) > 1 and means[-2] < means[-1]:
            m, s = means.pop(), sizes.pop()
            means[-1] = (means[-1] * sizes[-1] + m * s) / (sizes[-1] + s)
            sizes[-1] += s
    return torch.tensor([m for m, s in zip(means, sizes, strict=True) for _ in range(s)],
                        dtype=torch.float64)


def quantile_from_histogram(histogram: Tensor, edges: Tensor, quantile: float, *,
                            num_examples: float | None = None) -> float:
    """The server half: the ``quantile`` of the norms from a (noisy, summed) histogram over
    ``edges``. The counts above each edge are fitted by a non-increasing curve; the estimate
    is where it falls to ``(1 - quantile) N``, geometric between the two edges around it
    (the lowest edge if the curve starts below, the highest if it never gets there). ``N``
    is ``num_examples`` where it is public, else the histogram's own (noisy) total."""
    e = check_edges(edges)
    h = torch.as_tensor(histogram, dtype=torch.float64).flatten()
    if h.numel() != e.numel() + 1 or not bool(torch.isfinite(h).all()):
        raise UsageError(f"histogram needs {e.numel() + 1} finite counts, got "
                         f"{h.numel()}")
    if not 0 < quantile < 1:
        raise UsageError(f"quantile must be in (0, 1), got {quantile}")
    total = float(h.sum()) if num_examples is None else float(num_examples)
    above = _non_increasing(h.flip(0).cumsum(0).flip(0)[1:])  # above[j]: count > e_j
    target = (1.0 - quantile) * max(total, 0.0)
    hits = torch.nonzero(above <= target).flatten()
    if hits.numel() == 0:
        return float(e[-1])
    j = int(hits[0])
    if j == 0:
        return float(e[0])
    a0, a1 = float(above[j - 1]), float(above[j])  # a0 > target >= a1
    t = (a0 - target) / (a0 - a1)
    return float(e[j - 1] * (e[j] / e[j - 1]) ** t)


def private_quantile(client_norms: Sequence[Tensor], search: ClipSearch,
                     noise_multiplier: float, *, num_examples: float | None = None,
                     generator: torch.Generator | None = None) -> float:
    """Both halves played in one process (the simulator's view of a federation): every
    client releases its noisy histogram for each stage (``search.stage_sigmas`` of
    ``noise_multiplier``), the server sums and estimates. The second stage's edges depend
    on the first stage's noisy estimate only."""
    if not client_norms:
        raise UsageError("private_quantile needs at least one client's norms")
    z_locate, z_fine = search.stage_sigmas(noise_multiplier)
    edges = search.first_edges()
    # a sum of one tensor or more (client_norms is not empty) is a tensor
    total = cast(Tensor, sum(noisy_norm_histogram(n, edges, z_locate, generator=generator)
                             for n in client_norms))
    centre = quantile_from_histogram(total, edges, search.locate_quantile,
                                     num_examples=num_examples)
    edges = search.fine_edges(centre)
    total = cast(Tensor, sum(noisy_norm_histogram(n, edges, z_fine, generator=generator)
                             for n in client_norms))
    return quantile_from_histogram(total, edges, search.quantile, num_examples=num_examples)


def plan_clip_noise(target_epsilon: float, delta: float, search: ClipSearch,
                    calibration: Sequence[ReleasePlan] = (ONE_SHOT,), kind: str = "rdp"
                    ) -> tuple[float, list[float]]:
    """Noise multipliers for the clip's release and for the ``calibration`` releases, in one
    plan whose composition stays within ``target_epsilon``: (z of the clip's release, split
    between its stages by ``search.stage_sigmas``; z of each calibration plan in order). The
    clip's release is calibrated alone to ``search.share * target_epsilon``."""
    for p in calibration:
        if p.share == search.share:
            raise UsageError(f"release plan {p.name!r} has the clip's budget share "
                             f"{search.share}: give the clip another share")
    plans = [*calibration, ReleasePlan(QUANTILE_RELEASE, 1.0, 1, share=search.share)]
    sigmas = plan_noise(target_epsilon, delta, plans, kind)
    return sigmas[-1], sigmas[:-1]


def composed_epsilon(clip_sigma: float, search: ClipSearch,
                     calibration: Sequence[tuple[ReleasePlan, float]], delta: float,
                     kind: str = "rdp") -> float:
    """Epsilon of the clip's two stages and the calibration releases ((plan, z) pairs)
    composed in opacus' accountant."""
    history = [(z, 1.0, 1) for z in search.stage_sigmas(clip_sigma)]
    history += [(z, p.sample_rate, p.steps) for p, z in calibration]
    return compute_epsilon(history, kind, delta)


def feature_norms(features: Callable[[Tensor], Tensor], batches: Iterable[Any]) -> Tensor:
    """L2 norms (float64, on the CPU) of ``features(x)`` over ``batches``: one tensor of
    inputs, or an iterable of tensors x or of tuples/lists whose first item is x (a
    DataLoader's (x, y) batches), without gradients. Put the model in eval mode first."""
    if isinstance(batches, Tensor):  # one tensor of inputs: its rows are samples, not batches
        batches = batches.split(FEATURE_BATCH)
    out = []
    with torch.no_grad():
        for batch in batches:
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            if not isinstance(x, Tensor):
                raise UsageError(f"a batch must be a tensor or (x, ...), got {type(x).__name__}")
            z = features(x)
            out.append(z.reshape(z.shape[0], -1).double().norm(dim=1).cpu())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


@dataclass(frozen=True)
class ClipChoice:
    """A privately chosen clip: ``clip``, the noise multiplier of the clip's releases
    (``clip_sigma``) and of each calibration plan (``sigmas``, in the order given), the
    composed ``epsilon`` (<= the target), the ``search`` that made it, and each calibration
    plan's epsilon alone at its multiplier (``release_epsilons``): what a call that plans its
    own noise from an epsilon (``privfedcal.privatize_statistics``) must be given so that
    its noise is at least this plan's."""

    clip: float
    clip_sigma: float
    sigmas: list[float]
    epsilon: float
    search: ClipSearch
    release_epsilons: list[float]


def private_feature_clip(features: Callable[[Tensor], Tensor],
                         client_batches: Sequence[Iterable[Any]], *, epsilon: float,
                         delta: float, search: ClipSearch | None = None,
                         calibration: Sequence[ReleasePlan] = (ONE_SHOT,),
                         num_examples: float | None = None, kind: str = "rdp",
                         generator: torch.Generator | None = None) -> ClipChoice:
    """Choose the feature clip of a calibration release privately, within one budget.

    ``features``: the model's feature map (``model.features`` for privfedcal's models, or a
    hook on the head's input), in eval mode, taking the batches as they come (move them to
    the model's device inside it); ``client_batches``: one iterable of inputs per client (a
    tensor of inputs, or a DataLoader's batches). Plans the noise of the clip's releases and of the
    ``calibration`` releases together (``plan_clip_noise``), releases every client's noisy
    norm histograms (one per stage) and returns the clip with the noise
    multipliers the calibration release must then use: using another multiplier, or
    releasing more, leaves the ``epsilon`` reported here. ``generator``: tests only.
    """
    search = search if search is not None else ClipSearch()
    if not (math.isfinite(epsilon) and epsilon > 0) or not 0 < delta < 1:
        raise UsageError(f"need epsilon > 0 and 0 < delta < 1, got {epsilon}, {delta}")
    clip_sigma, sigmas = plan_clip_noise(epsilon, delta, search, calibration, kind)
    norms = [feature_norms(features, batches) for batches in client_batches]
    clip = private_quantile(norms, search, clip_sigma, num_examples=num_examples,
                            generator=generator)
    planned = list(zip(calibration, sigmas, strict=True))
    spent = composed_epsilon(clip_sigma, search, planned, delta, kind)
    alone = [compute_epsilon([(z, p.sample_rate, p.steps)], kind, delta) for p, z in planned]
    return ClipChoice(clip, clip_sigma, sigmas, spent, search, alone)


__all__ = ["MAX_BINS", "ONE_SHOT", "QUANTILE_RELEASE", "SENSITIVITY", "STAGES", "ClipChoice",
           "ClipSearch", "check_edges", "composed_epsilon", "feature_norms",
           "geometric_edges", "noisy_norm_histogram", "norm_histogram", "plan_clip_noise",
           "private_feature_clip", "private_quantile", "quantile_from_histogram"]
