"""The contract between the simulator and calibrators (CCVR, CReFF, oracle).

A calibrator never sees client data. It asks the simulator to run a ``PayloadTask`` on some
clients; each client's result is a dict of named tensors that are **sums over its local
samples** (plus counts), so that the server side only ever needs their sum over clients.
Every upload travels through the uplink (bound -> noise -> wire, privacy/uplink.py); the
calibrator receives the cross-client sum and cannot tell which stages ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.privacy.bound import Bound, Payload
from privfedcal.registry import Registry
from privfedcal.settings.floors import PrivacyOptions
from privfedcal.tensors import State

FeatureTransform = Callable[[Tensor], Tensor]


class PayloadTask(Protocol):
    """Computes one client's upload. Must be picklable (runs in worker processes).

    ``model`` holds the state the calibrator asked for, in eval mode; ``x, y`` are all of
    the client's training samples (no augmentation), on the compute device.
    The returned dict must have the same keys and shapes for every client (so that a
    client's label set is not revealed by the shape of its upload).
    """

    def compute(self, model: FeatureClassifier, x: Tensor, y: Tensor, bound: Bound) -> Payload: ...


class ServerContext(Protocol):
    """What the simulator offers a calibrator on the server side."""

    round: int                     # 1-based round just finished (0 before training)
    model: FeatureClassifier       # a server-side model object (scratch: load states into it)
    global_state: State            # the current global model state (after aggregation)
    sent_state: State              # the global state the clients of this round received
    num_classes: int
    device: torch.device
    selected: list[int]            # clients that took part in this round
    num_clients: int
    generator: torch.Generator     # server randomness, seeded per (seed, round)

    def collect(self, task: PayloadTask, clients: list[int], state: State,
                label: str) -> Payload:
        """Run ``task`` on each client with the model in ``state``; return the cross-client
        sum of the payloads (after the uplink). ``label`` names the release in the
        transcript and accountant (e.g. ``"ccvr-stats"``)."""
        ...

    def centralized_features(self, state: State, per_class: int | None) -> tuple[Tensor, Tensor]:
        """Real training features (oracle only: an upper bound, not a federated protocol)."""
        ...

    def evaluate(self, state: State, transform: FeatureTransform | None = None) -> dict[str, Any]:
        """Top-1 accuracy, per-class accuracy and loss of ``state`` on the test set, with
        ``transform`` applied to features before the classifier when given."""
        ...


class Calibrator:
    """Adjusts the classifier from client payloads. Override only the hooks you need."""

    name: ClassVar[str] = "none"
    #: the releases it makes (privacy/releases.py ``ReleaseSpec``): label, payload keys,
    #: sensitivities, magnitudes, participants. The privacy code reads only these.
    releases: ClassVar[tuple] = ()
    protectable: ClassVar[bool] = True  # False: reads raw data, cannot run under DP

    # ---- the calibrator's privacy policy (read by the planner, privfedcal/privacy/planner.py) --
    # the planner and the experiment pass these hooks the run's ``PrivacyOptions``
    # (privfedcal/settings/floors.py: rounds, the protections, ``calibration_params``)
    @classmethod
    def privacy_options(cls, privacy: PrivacyOptions, options: dict[str, Any]
                        ) -> dict[str, Any]:
        """``options`` with the defaults that depend on the run's protection filled in
        (CReFF's weighting under DP); as given by default."""
        return options

    @classmethod
    def privacy_hints(cls, privacy: PrivacyOptions) -> list[str]:
        """Advice printed with the run's notes about this calibrator under the run's
        protection; none by default."""
        return []

    @classmethod
    def release_rounds(cls, privacy: PrivacyOptions, spec: Any) -> tuple[int, ...]:
        """The rounds in which the per-round release ``spec`` (``participants="selected"``)
        is made, a function of the public config alone: the planner counts each client's
        releases over these rounds. Every round by default."""
        return tuple(range(1, privacy.rounds + 1))

    def after_round(self, ctx: ServerContext) -> None:
        """Every round, after aggregation (CReFF)."""

    def after_training(self, ctx: ServerContext) -> dict[str, Any]:
        """Once, after the last round (CCVR, oracle). Returns extra summary fields."""
        return {}

    def eval_state(self, global_state: State) -> State:
        """The model the run evaluates and returns (CReFF: extractor + re-trained head)."""
        return global_state

    def feature_transform(self) -> FeatureTransform | None:
        """A transform applied to features before the classifier at inference (CCVR's
        ReLU + Tukey option), or None."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@dataclass(frozen=True)
class CalibrationSpec:
    """``--calibrate`` parsed: a calibrator name plus an optional integer argument."""

    name: str = "none"
    arg: int | None = None


CALIBRATORS: Registry[type[Calibrator]] = Registry("calibrator")
CALIBRATORS.register("none")(Calibrator)
