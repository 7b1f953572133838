"""Base class of a federated method: a local objective plus optional server rule.

A method is an object with a few hooks (Flower's strategies and pfl-research's algorithms
are the model): the simulator never branches on a method's name.

Client side, in one worker process, for each selected client::

    algo.begin_client(model, global_state, client_state, ctx)  # model holds global_state
    for x, y in batches: loss = algo.local_loss(model, x, y); loss.backward(); step
    new_client_state = algo.end_client(model)

Server side, once per round::

    new_global, server_state = algo.server_update(global_state, averaged_state, server_state)
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.registry import Registry
from privfedcal.tensors import State


def hyper(default: Any, help: str) -> Any:
    """A hyperparameter field of a method's ``Params``: its name, type and default are the
    field's, its range is checked in the class's ``__post_init__``, and ``help`` is the text
    of its ``--flag`` and of the docs' settings table (``privfedcal/settings/catalogue.py`` derives
    the flags of every registered method from these fields)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class NoParams:
    """Methods without hyperparameters."""


@dataclasses.dataclass(frozen=True)
class ClientContext:
    """What a method may know of the client it trains on, beyond its batches: computed on
    the client from its own data, never sent anywhere (a method that uses it keeps it in
    its local loss). ``label_counts[c]``: the client's training examples of class ``c``."""

    client: int
    label_counts: Tensor


class Algorithm:
    """A federated method. Subclasses override only the hooks they need."""

    name: ClassVar[str] = "base"
    Params: ClassVar[type] = NoParams
    #: keys of the model state that are not averaged (kept from the global model)
    frozen_prefixes: ClassVar[tuple[str, ...]] = ()
    #: whether the local loss is a mean of per-sample terms, so that DP-SGD (``--dp-train``)
    #: can clip and noise it per example; a loss with batch-level terms (contrastive,
    #: variance, proximal to a global model) is refused under ``--dp-train``
    dp_sgd: ClassVar[bool] = False
    #: the loss in the vectorised trainer's form (``--client-batch K``): a
    #: ``vector_loss.VectorLoss``; None: the built-in form of the method's name
    #: (federation/vector_losses.py), FedAvg's when the method keeps FedAvg's client hooks,
    #: else the method trains with ``--client-batch 1`` only
    vector_loss: ClassVar[Any] = None

    def __init__(self, params: Any = None, *, num_classes: int) -> None:
        self.params = params if params is not None else self.Params()
        self.num_classes = num_classes

    # ---- model setup -------------------------------------------------------------------
    def configure_model(self, model: FeatureClassifier, generator: torch.Generator) -> None:
        """Called once on every freshly built model (server and workers alike), before the
        first global state is taken from it. Example: freeze or re-parametrise the classifier.
        Must be deterministic given ``generator``."""

    # ---- client side -------------------------------------------------------------------
    def begin_client(self, model: FeatureClassifier, global_state: State,
                     client_state: State | None, ctx: ClientContext | None = None) -> None:
        """``model`` already holds ``global_state``; remember what the loss needs (from
        ``ctx`` too: the client's label counts, for label-skew methods)."""

    def local_loss(self, model: FeatureClassifier, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(model(x), y)

    def end_client(self, model: FeatureClassifier) -> State | None:
        """Per-client state to persist until this client is selected again (or None)."""
        return None

    # ---- server side -------------------------------------------------------------------
    def server_update(self, global_state: State, averaged: State,
                      server_state: State | None) -> tuple[State, State | None]:
        """Turn the sample-weighted average of the client models into the new global model."""
        return averaged, server_state


ALGORITHMS: Registry[type[Algorithm]] = Registry("method")


def client_context(client: int, y: Tensor, num_classes: int) -> ClientContext:
    """The context of a client whose training labels are ``y``."""
    return ClientContext(client, torch.bincount(y, minlength=num_classes))


def register(cls: type[Algorithm]) -> type[Algorithm]:
    ALGORITHMS.register(cls.name)(cls)
    return cls


def create_algorithm(name: str, *, num_classes: int, **overrides: Any) -> Algorithm:
    """Build a registered method; ``overrides`` (None values ignored) replace Params defaults.

    Unknown hyperparameters for the method raise a UsageError naming the valid ones.
    """
    from privfedcal.errors import UsageError

    cls = ALGORITHMS.get(name)
    fields = {f.name for f in dataclasses.fields(cls.Params)}
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - fields)
    if unknown:
        valid = ", ".join(sorted(fields)) or "none"
        raise UsageError(f"method {name!r} takes no {', '.join(unknown)}; its hyperparameters: {valid}")
    hints = typing.get_type_hints(cls.Params)
    for k, v in given.items():  # an integer where a float is declared (TOML's mu = 1)
        if isinstance(v, int) and not isinstance(v, bool) and float in _types(hints[k]):
            given[k] = float(v)
    return cls(cls.Params(**given), num_classes=num_classes)


def _types(annotation: Any) -> tuple[Any, ...]:
    return typing.get_args(annotation) or (annotation,)
