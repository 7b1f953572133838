"""What a calibrator releases, declared next to the calibrator (``releases`` class attribute).

A ``ReleaseSpec`` is the one declaration of a release: its label (its name in the
transcript, the accountant, ``summary.json``, the reports and ``audit dp``'s channels), the
payload keys it may carry, each key's L2 sensitivity to one example and the bound on each
key's aggregate entries (for CKKS parameters), who is asked for it and how often, the
payload task a client runs for it, what each payload key holds (its row in docs/threat-model.md's table
of client fields, ``privacy/client_fields.py``), how the noise budget is split between the
keys, and which keys are symmetric matrices (packed as their upper triangle under CKKS,
their noise symmetrised). The DP noise (``dp_accounting.py``), the CKKS bounds and layout
(``secagg_stage.py``), the symmetrisation (``stages.py``), the Flower task registry and the
attacker's noise model (``attacks/view.py``) read only these declarations, so a new
calibrator declares its releases in its own file and touches nothing else.

Sensitivities and bounds are products of symbols, written as strings so the declarations
stay plain data: ``1``, ``R`` (feature clip ``--dp-clip``), ``G`` (gradient clip
``--dp-grad-clip``), ``N`` (training examples in the federation), ``K`` (clients), each
optionally squared (``R^2``), joined by ``*`` (``R^2*N``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from privfedcal.errors import UsageError

#: the labels of the releases the uplink makes itself (a calibrator's releases are labelled
#: in its ``ReleaseSpec``): the transcript and the accountant key on these
DPSGD_RELEASE = "dp-sgd"         # the model updates' DP-SGD (accountant only)
UPDATE_RELEASE = "model-update"  # a participant's model state after local training
USER_DP_RELEASE = "dp-fedavg"    # the clipped, noised sum of model updates (accountant only)
ROUND_RECORD = "round"           # the global state sent at the start of a round

PARTICIPANTS = ("all", "selected")  # all clients once after training, or each round's


@dataclass(frozen=True)
class ReleaseSpec:
    label: str
    sensitivity: Mapping[str, str]  # payload key -> L2 sensitivity (symbols)
    magnitude: Mapping[str, str]    # payload key -> bound on |aggregate entry| (symbols)
    participants: str = "all"       # "all": once, every client; "selected": every round
    #: the payload task a client runs for this release (a frozen dataclass with
    #: ``compute(model, x, y, bound)``); under Flower it travels by this release's label
    #: (flower/tasks.py builds its registry from the calibrators' declarations)
    task: type | None = None
    #: payload key -> what it carries, with its shape (the "holds" column of the client
    #: fields' table; a release that reaches a client must describe every key)
    holds: Mapping[str, str] = field(default_factory=dict)
    #: payload key -> its share of the release's noise budget (``dp.noise_stds``), normalised
    #: over the keys a payload carries; empty: equal shares. Every declared key needs one.
    noise_share: Mapping[str, float] = field(default_factory=dict)
    #: payload keys whose last two dimensions hold symmetric matrices (CCVR's second moments):
    #: under CKKS only their upper triangle travels (privacy/packing.py), and their DP noise
    #: is symmetrised after it is drawn (privacy/stages.py ``symmetrise``)
    symmetric: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if set(self.sensitivity) != set(self.magnitude):
            raise ValueError(f"release {self.label!r}: sensitivity and magnitude keys differ")
        if self.participants not in PARTICIPANTS:
            raise ValueError(f"release {self.label!r}: participants must be one of "
                             f"{PARTICIPANTS}")
        unknown = set(self.holds) - set(self.sensitivity)
        if unknown:
            raise ValueError(f"release {self.label!r}: holds describes undeclared payload "
                             f"key(s) {sorted(unknown)}")
        if self.noise_share and (set(self.noise_share) != set(self.sensitivity) or not all(
                math.isfinite(w) and w > 0 for w in self.noise_share.values())):
            raise ValueError(f"release {self.label!r}: noise_share needs a positive share for "
                             f"each payload key, got {dict(self.noise_share)}")
        object.__setattr__(self, "symmetric", frozenset(self.symmetric))
        if not self.symmetric <= set(self.sensitivity):
            raise ValueError(f"release {self.label!r}: symmetric names undeclared payload "
                             f"key(s) {sorted(self.symmetric - set(self.sensitivity))}")
        for expr in (*self.sensitivity.values(), *self.magnitude.values()):
            evaluate(expr, {"R": 1.0, "G": 1.0, "N": 1.0, "K": 1.0})  # parses

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.sensitivity)

    def sensitivities(self, keys, *, clip: float, grad_clip: float) -> dict[str, float]:
        env = {"R": clip, "G": grad_clip, "N": 1.0, "K": 1.0}
        out = {}
        for k in keys:
            if k not in self.sensitivity:
                raise UsageError(f"release {self.label!r} declares no sensitivity for payload "
                                 f"key {k!r} (declared: {', '.join(self.keys)}); refusing to "
                                 "release it")
            out[k] = evaluate(self.sensitivity[k], env)
        return out

    def budget(self) -> dict[str, float] | None:
        """The split of the noise budget between the keys (``dp.noise_stds``'s ``budget``;
        None: equal shares)."""
        return dict(self.noise_share) if self.noise_share else None

    def bounds(self, *, clip: float, grad_clip: float, examples: float,
               clients: float) -> dict[str, float]:
        env = {"R": clip, "G": grad_clip, "N": examples, "K": clients}
        return {k: evaluate(v, env) for k, v in self.magnitude.items()}


def evaluate(expr: str, env: Mapping[str, float]) -> float:
    """Value of a product of symbols (``R^2*N``) under ``env``."""
    value = 1.0
    for factor in str(expr).split("*"):
        factor = factor.strip()
        base, _, power = factor.partition("^")
        if base == "1" and not power:
            continue
        if base not in env or power not in ("", "2"):
            raise ValueError(f"cannot read {factor!r} in {expr!r}: use 1, R, G, N, K, X^2, *")
        value *= env[base] ** (2 if power else 1)
    if not math.isfinite(value):
        raise UsageError(f"{expr} overflows at {dict(env)}")
    return value


__all__ = ["ReleaseSpec", "evaluate"]
