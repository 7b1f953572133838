"""Privacy accounting over opacus: composition of Gaussian releases and noise planning.

Every release is a (Poisson-)subsampled Gaussian mechanism ``(noise_multiplier z,
sample_rate q, steps T)``; composition uses opacus's RDP accountant (Mironov 2017; Mironov,
Talwar & Zhang 2019, default) or its PRV accountant (Gopi, Lee & Wutschitz 2021), which
reports an upper bound that is markedly tighter for few, un-subsampled releases such as
CCVR's one-shot statistics (q = 1, T = 1). Histories reach opacus through its public
accountant API (``load_state_dict`` of (z, q, steps) triples, then ``get_epsilon``); RDP
composes cached one-step curves from the analysis functions ``RDPAccountant`` itself calls,
and ``_adapter`` proves once per process that this equals the accountant, raising
``OpacusMismatch`` on an opacus that behaves otherwise (tested: ``OPACUS_TESTED``).

Sample rates: the amplification in both accountants assumes each example (here: each
client's upload, hence each of its examples) takes part in a step independently with
probability q (Poisson sampling). privfedcal's round loop samples a FIXED number of clients
per round, which this analysis does not exactly cover. ``sample_rate`` is therefore always
an explicit argument: pass ``q = participation`` to accept the Poisson approximation (as
most FL papers do), or ``q = 1`` for a bound that holds whatever the client sampling.

``plan_noise`` chooses noise multipliers so that the whole plan composes to at most the
target epsilon; ``PrivacyAccountant.check_release`` refuses a release that would exceed it.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from privfedcal.errors import PrivacyBudgetError, UsageError

ACCOUNTANT_KINDS = ("rdp", "prv")
SIGMA_MIN, SIGMA_MAX = 0.01, 1e4
Entry = tuple[float, float, int]  # (noise_multiplier, sample_rate, steps), opacus's history


def _check_kind(kind: str) -> None:
    if kind not in ACCOUNTANT_KINDS:
        raise UsageError(f"unknown accountant {kind!r}; valid choices: "
                         f"{', '.join(ACCOUNTANT_KINDS)}")


def _check_entry(noise_multiplier: float, sample_rate: float, steps: int) -> Entry:
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(f"noise multiplier must be finite and > 0, got {noise_multiplier}")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps}")
    return float(noise_multiplier), float(sample_rate), int(steps)


class OpacusMismatch(UsageError):
    """The installed opacus does not behave as the adapter below was written for (the CLI
    prints it as one line; the fix is installing a tested opacus)."""


# The adapter below was written for, and is tested against, these opacus releases.
OPACUS_TESTED = ("1.6",)
_CHECK_STEPS = ((1.3, 0.25), (1.3, 0.25), (2.0, 1.0))  # two releases, one merged
_CHECK_HISTORY = [(1.3, 0.25, 2), (2.0, 1.0, 1)]


def _mismatch(what: str) -> OpacusMismatch:
    import opacus

    return OpacusMismatch(
        f"opacus {opacus.__version__} does not match privfedcal's accountant adapter "
        f"(written for opacus {', '.join(OPACUS_TESTED)}): {what}; install "
        f"'opacus>={OPACUS_TESTED[0]},<1.7' or update privfedcal/privacy/accounting.py")


def _load_history(kind: str, history: list[Entry]) -> Any:
    """An opacus accountant of ``kind`` holding ``history`` through its public
    ``load_state_dict`` (the form its own ``state_dict`` writes: (z, q, steps) triples)."""
    from opacus.accountants import create_accountant

    acc = create_accountant(kind)
    acc.load_state_dict({"history": list(history), "mechanism": acc.mechanism()})
    return acc


@functools.lru_cache(maxsize=1)
def _adapter() -> tuple[Callable[..., Any], Callable[..., Any], tuple[float, ...]]:
    """Check, once per process, that the installed opacus behaves as this module assumes;
    return ``compute_rdp``, ``get_privacy_spent`` and the RDP accountant's default orders.

    Assumptions: (1) an accountant's history, as its ``state_dict`` writes it and its
    ``load_state_dict`` reads it, is a list of (z, q, steps) triples with consecutive equal
    steps merged; (2) ``RDPAccountant.get_epsilon`` is the sum over that history of
    ``compute_rdp(q, z, 1) * steps`` converted by ``get_privacy_spent`` at ``DEFAULT_ALPHAS``.
    ``RDPAccountant.get_epsilon`` recomputes every entry's curve on every call (about 0.2 s
    per subsampled entry) while noise planning and per-round reporting ask for hundreds of
    epsilons, so (2) lets ``_rdp_curve`` cache one curve per (z, q). Any departure raises
    ``OpacusMismatch`` (one line) instead of a silently different epsilon.
    """
    try:
        from opacus.accountants import RDPAccountant, create_accountant
        from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

        orders = tuple(float(a) for a in RDPAccountant.DEFAULT_ALPHAS)
    except (ImportError, AttributeError) as exc:
        raise _mismatch(f"RDP analysis not found ({exc})") from None
    with warnings.catch_warnings(), np.errstate(divide="ignore", over="ignore",
                                                invalid="ignore"):
        warnings.simplefilter("ignore", UserWarning)
        try:
            for kind in ACCOUNTANT_KINDS:
                acc = create_accountant(kind)
                for z, q in _CHECK_STEPS:
                    acc.step(noise_multiplier=z, sample_rate=q)
                state = acc.state_dict()
                if [tuple(h) for h in state.get("history", [])] != _CHECK_HISTORY:
                    raise _mismatch(f"the {kind} accountant's history is not (z, q, steps) "
                                    f"triples: {state.get('history')!r}")
                loaded = _load_history(kind, _CHECK_HISTORY)
                if [tuple(h) for h in loaded.state_dict()["history"]] != _CHECK_HISTORY:
                    raise _mismatch(f"the {kind} accountant does not load its own history")
                if kind == "rdp":
                    ref = float(acc.get_epsilon(delta=1e-5))
            rdp = sum(np.asarray(compute_rdp(q=q, noise_multiplier=z, steps=1, orders=orders))
                      * t for z, q, t in _CHECK_HISTORY)
            ours = float(get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)[0])
        except OpacusMismatch:
            raise
        except Exception as exc:  # any API change: one clear line, not a traceback
            raise _mismatch(f"{type(exc).__name__}: {exc}") from None
    if not math.isclose(ours, ref, rel_tol=1e-12):
        raise _mismatch(f"cached RDP composition gives {ours!r}, the stepped accountant "
                        f"{ref!r}")
    return compute_rdp, get_privacy_spent, orders


@functools.lru_cache(maxsize=4096)
def _rdp_curve(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """RDP of ONE subsampled Gaussian step at opacus's default orders (cached: composition
    only scales and adds these curves, and the fractional orders are slow to evaluate)."""
    compute_rdp, _, orders = _adapter()
    curve = np.asarray(compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                   orders=orders), dtype=np.float64)
    curve.setflags(write=False)
    return curve


def _opacus_epsilon(history: list[Entry], kind: str, delta: float) -> float:
    if kind == "rdp":
        # Equal to RDPAccountant.get_epsilon on this history (checked by _adapter):
        # the sum of the one-step curves times their steps, converted at the same orders.
        _, get_privacy_spent, orders = _adapter()
        rdp = sum(_rdp_curve(z, q) * t for z, q, t in history)
        eps, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
        return float(eps)
    return float(_load_history(kind, history).get_epsilon(delta=delta))


def compute_epsilon(history: list[Entry], kind: str, delta: float) -> float:
    """Epsilon of the composition of ``history`` at ``delta`` by opacus's accountant.

    Entries with equal (z, q) are merged first (composition is commutative, so this is exact
    and keeps PRV fast). Raises PrivacyBudgetError if the accountant cannot bound it.
    """
    _check_kind(kind)
    merged: dict[tuple[float, float], int] = {}
    for z, q, t in history:
        merged[(z, q)] = merged.get((z, q), 0) + t
    if not merged:
        return 0.0
    entries = [(z, q, t) for (z, q), t in merged.items()]
    _adapter()  # raises OpacusMismatch (not PrivacyBudgetError) on an untested opacus
    with warnings.catch_warnings(), np.errstate(divide="ignore", over="ignore",
                                                invalid="ignore"):
        # opacus warns when the best RDP order sits at the edge of its grid; the value is
        # still a valid upper bound, just not the tightest.
        warnings.simplefilter("ignore", UserWarning)
        try:
            eps = _opacus_epsilon(entries, kind, delta)
        except (RuntimeError, ValueError, OverflowError) as exc:
            raise PrivacyBudgetError(f"{kind} accountant cannot bound epsilon for "
                                     f"{entries}: {exc}") from exc
    if math.isnan(eps):
        raise PrivacyBudgetError(f"{kind} accountant returned NaN for {entries}")
    return eps


class PrivacyAccountant:
    """Records every DP release of a run and reports the epsilon spent at a fixed delta.

    ``state_dict`` holds the labelled history (JSON-friendly), so a resumed run reports and
    guards exactly the same budget.
    """

    def __init__(self, kind: str = "rdp", delta: float = 1e-5) -> None:
        _check_kind(kind)
        if not 0 < delta < 1:
            raise UsageError(f"delta must be in (0, 1), got {delta}")
        self.kind = kind
        self.delta = float(delta)
        self._history: list[tuple[float, float, int, str]] = []
        self._cache: float | None = None  # epsilon of the current history

    def __len__(self) -> int:
        return len(self._history)

    def record(self, noise_multiplier: float, sample_rate: float, steps: int = 1,
               label: str = "") -> None:
        """Append a release; consecutive releases with equal (z, q, label) are merged."""
        z, q, t = _check_entry(noise_multiplier, sample_rate, steps)
        if self._history and self._history[-1][:2] == (z, q) and self._history[-1][3] == label:
            self._history[-1] = (z, q, self._history[-1][2] + t, label)
        else:
            self._history.append((z, q, t, label))
        self._cache = None

    def _entries(self) -> list[Entry]:
        return [(z, q, t) for z, q, t, _ in self._history]

    def epsilon(self) -> float:
        """Epsilon spent so far (0 before any release)."""
        if self._cache is None:
            self._cache = compute_epsilon(self._entries(), self.kind, self.delta)
        return self._cache

    def epsilon_if(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> float:
        """Epsilon that would be spent after recording this release (nothing is recorded)."""
        entry = _check_entry(noise_multiplier, sample_rate, steps)
        return compute_epsilon(self._entries() + [entry], self.kind, self.delta)

    def check_release(self, noise_multiplier: float, sample_rate: float, steps: int = 1, *,
                      target: float) -> float:
        """Raise PrivacyBudgetError if recording this release would exceed ``target``;
        otherwise return the epsilon it would leave spent. Call before every release."""
        eps = self.epsilon_if(noise_multiplier, sample_rate, steps)
        if eps > target:
            raise PrivacyBudgetError(f"release (z={noise_multiplier:.4g}, q={sample_rate:.4g}, "
                                     f"steps={steps}) would spend epsilon {eps:.4f} > budget "
                                     f"{target:.4f} (delta={self.delta:.3g})")
        return eps

    @property
    def releases(self) -> list[dict[str, Any]]:
        """One summary row per recorded release group."""
        return [{"label": lab, "noise_multiplier": z, "sample_rate": q, "steps": t}
                for z, q, t, lab in self._history]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "delta": self.delta,
                "history": [[z, q, t, lab] for z, q, t, lab in self._history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind or state.get("delta") != self.delta:
            raise UsageError(f"checkpoint accountant ({state.get('kind')}, delta="
                             f"{state.get('delta')}) differs from the configured one "
                             f"({self.kind}, delta={self.delta})")
        history = []
        for z, q, t, lab in state["history"]:
            history.append((*_check_entry(z, q, t), str(lab)))
        self._history = history
        self._cache = None


@dataclass(frozen=True)
class ReleasePlan:
    """A planned group of releases: ``steps`` Gaussian releases at sample rate ``q``.

    ``share=None`` puts the plan in the uploads group, which takes what the budget leaves;
    ``share=s`` (DP-SGD) calibrates the plans carrying the same ``s`` alone to ``s * target``.
    """

    name: str
    sample_rate: float
    steps: int = 1
    share: float | None = None

    def __post_init__(self) -> None:
        try:
            _check_entry(1.0, self.sample_rate, self.steps)
        except ValueError as exc:
            raise UsageError(f"release plan {self.name!r}: {exc}") from None
        if self.share is not None and not 0 < self.share < 1:
            raise UsageError(f"release plan {self.name!r}: share must be in (0, 1), "
                             f"got {self.share}")


def _smallest_sigma(eps_at: Callable[[float], float], target: float, rtol: float) -> float:
    """Smallest z in [SIGMA_MIN, SIGMA_MAX] (to relative precision rtol) with
    ``eps_at(z) <= target``; epsilon decreases in z.

    Brackets from z = 1 by doubling/halving (slow evaluations at extreme z happen only when
    needed), then refines with guarded secant steps on log(eps) against log(z), where eps is
    nearly linear: each step probes just below and just above the estimated root, so a good
    estimate closes the bracket to rtol in two evaluations; bisection is the fallback.
    """

    def eps(z: float) -> float:
        try:
            return eps_at(z)
        except PrivacyBudgetError:  # the accountant cannot bound it: treat as infeasible
            return math.inf

    bracket = _bracket(eps, target)
    if bracket is None:
        return SIGMA_MIN
    return _refine(eps, target, rtol, *bracket)


def _bracket(eps: Callable[[float], float], target: float
             ) -> tuple[float, float, float, float] | None:
    """``(lo, eps(lo), hi, eps(hi))`` with ``eps(lo) > target >= eps(hi)``, from z = 1 by
    halving or doubling; None when ``SIGMA_MIN`` already meets ``target``. Raises
    ``PrivacyBudgetError`` when not even ``SIGMA_MAX`` does."""
    lo, hi, e_lo, e_hi = None, 1.0, math.inf, eps(1.0)
    if e_hi <= target:
        while lo is None:
            if hi <= SIGMA_MIN:
                return None
            cand = max(hi / 2, SIGMA_MIN)
            e = eps(cand)
            if e <= target:
                hi, e_hi = cand, e
            else:
                lo, e_lo = cand, e
        return lo, e_lo, hi, e_hi
    lo, e_lo = 1.0, e_hi
    upper: float | None = None
    while upper is None:
        cand = min(lo * 2, SIGMA_MAX)
        e = eps(cand)
        if e <= target:
            upper, e_hi = cand, e
        elif cand >= SIGMA_MAX:
            raise PrivacyBudgetError(
                f"no noise multiplier in [{SIGMA_MIN}, {SIGMA_MAX:g}] meets epsilon "
                f"{target:.4g}; raise the budget or release less")
        else:
            lo, e_lo = cand, e
    return lo, e_lo, upper, e_hi


def _refine(eps: Callable[[float], float], target: float, rtol: float, lo: float,
            e_lo: float, hi: float, e_hi: float) -> float:
    """The bracket ``[lo, hi]`` narrowed to relative width ``rtol`` by guarded secant steps
    on log(eps) against log(z) (bisection as the fallback); its upper end."""
    half = math.sqrt(1 + rtol * 0.9)  # probes at root/half and root*half: ratio < 1 + rtol
    recent = [(lo, e_lo), (hi, e_hi)]  # the last two evaluations feed the secant
    secant_steps = 0
    while hi / lo > 1 + rtol:
        probes = [math.sqrt(lo * hi)]
        (z1, e1), (z2, e2) = recent[-2:]
        if secant_steps < 8 and all(map(math.isfinite, (e1, e2))) and min(e1, e2) > 0 \
                and e1 != e2:
            secant_steps += 1
            root = z2 * (z1 / z2) ** (math.log(e2 / target) / math.log(e2 / e1))
            if lo * half < root < hi / half:
                probes = [root / half, root * half]
        for z in probes:
            if not lo < z < hi:  # the first probe already moved the bracket past this one
                continue
            e = eps(z)
            recent.append((z, e))
            if e <= target:
                hi, e_hi = z, e
            else:
                lo, e_lo = z, e
    return hi


def plan_noise(target_epsilon: float, delta: float, releases: list[ReleasePlan],
               kind: str = "rdp", *, rtol: float = 1e-3) -> list[float]:
    """Noise multipliers (one per plan, in order) whose composition spends <= target.

    Plans with a ``share`` are grouped by share and each group gets one z calibrated alone to
    ``share * target``; the plans without a share then get one common z, the smallest (to
    ``rtol``) for which the composition of EVERYTHING stays <= target. Raises
    PrivacyBudgetError when no z in [0.01, 1e4] meets a target: the run must not start.
    """
    _check_kind(kind)
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise UsageError(f"target epsilon must be finite and > 0, got {target_epsilon}")
    if not releases:
        raise UsageError("plan_noise needs at least one release plan")
    shares = sorted({p.share for p in releases if p.share is not None})
    rest = [p for p in releases if p.share is None]
    if rest and sum(shares) >= 1:
        raise UsageError(f"budget shares {shares} leave nothing for {[p.name for p in rest]}")
    # A hair of slack so that recording the plan in another order (float sums) never trips
    # check_release.
    target = target_epsilon * (1 - 1e-9)
    sigma_of: dict[float | None, float] = {}
    fixed: list[Entry] = []
    for s in shares:
        group = [p for p in releases if p.share == s]

        def eps_group(z: float, group=group) -> float:
            return compute_epsilon([(z, p.sample_rate, p.steps) for p in group], kind, delta)

        sigma_of[s] = _smallest_sigma(eps_group, s * target, rtol)
        fixed += [(sigma_of[s], p.sample_rate, p.steps) for p in group]
    if rest:
        def eps_all(z: float) -> float:
            return compute_epsilon(fixed + [(z, p.sample_rate, p.steps) for p in rest], kind,
                                   delta)

        sigma_of[None] = _smallest_sigma(eps_all, target, rtol)
    else:
        total = compute_epsilon(fixed, kind, delta)
        if total > target:
            raise PrivacyBudgetError(f"groups calibrated to shares {shares} compose to "
                                     f"epsilon {total:.4f} > {target_epsilon:.4f}")
    return [sigma_of[p.share] for p in releases]
