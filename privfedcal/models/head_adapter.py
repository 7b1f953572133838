"""A user's own ``torch.nn.Module`` seen as privfedcal's ``FeatureClassifier``.

Flower-free (``privfedcal.api.ownloop`` uses it in a base install); the Flower plugin re-exports
it (``privfedcal.flower.plugin.HeadAdapter``).

privfedcal's calibrators (CCVR, CReFF) touch a model through ``features(x)`` and a linear
``classifier`` only (``models/feature_classifier.py``), and read and write the head in a model state as
``classifier.weight`` / ``classifier.bias`` (``calibration/retrain.py``). ``HeadAdapter``
gives any module whose head is a ``torch.nn.Linear`` that shape without changing it:

* ``features(x)`` runs the user's own ``forward`` with a forward pre-hook on the head that
  takes the head's input and stops the forward there (nothing after the head runs); the
  hook is removed again after every call, so the user's module keeps no hook;
* ``classifier`` is the user's head module itself (no copy, no renaming of the module);
* ``state_dict()`` is the user's state dict with the head's two keys under privfedcal's
  names, and ``load_state_dict`` maps them back, so the calibrators' states load into the
  user's own parameters: ``user_state`` and ``adapter_state`` convert between the two key
  sets, and the user's checkpoints and ``model.state_dict()`` keep their names.

The head is named (``head="fc3"``) or found: the last ``Linear`` module registered, which
must have ``num_classes`` outputs when that is given. ``check`` runs one batch and refuses
a head whose input is not one feature row per sample, or whose argmax disagrees with the
model's output (the named module is then not the output layer).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from privfedcal.errors import PrivfedcalError, UsageError
from privfedcal.models.feature_classifier import FeatureClassifier

__all__ = ["HEAD_PREFIX", "HeadAdapter", "find_head"]

#: where privfedcal's calibrators find the head in a state (calibration/retrain.py)
HEAD_PREFIX = "classifier."


class _Stop(PrivfedcalError):
    """Raised by the head's pre-hook once it holds the head's input: the forward stops."""


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n]


def find_head(model: nn.Module, head: str | None = None,
              num_classes: int | None = None) -> tuple[str, nn.Linear]:
    """The head's name and module: ``head`` if given, else the last ``Linear`` registered
    in ``model``; a one-line UsageError if it is absent, not a ``Linear``, or has another
    number of outputs than ``num_classes``."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    linears = _linears(model)
    names = ", ".join(n for n, _ in linears) or "none"
    if head is not None:
        if not isinstance(head, str) or not head:
            raise UsageError(f"head must be the name of a Linear submodule, got {head!r}")
        try:
            module = model.get_submodule(head)
        except AttributeError:
            raise UsageError(f"model {type(model).__name__} has no submodule {head!r}; its "
                             f"Linear modules: {names}") from None
        if not isinstance(module, nn.Linear):
            raise UsageError(f"head {head!r} is a {type(module).__name__}, not a "
                             f"torch.nn.Linear; the model's Linear modules: {names}")
    else:
        if not linears:
            raise UsageError(f"model {type(model).__name__} has no torch.nn.Linear module "
                             "to calibrate: its head must be one")
        head, module = linears[-1]
        same = [n for n, m in linears if m is module]
        if len(same) > 1:
            raise UsageError(f"the last Linear module is registered as {', '.join(same)}: "
                             "name the head with head=")
    if num_classes is not None and module.out_features != num_classes:
        raise UsageError(f"head {head!r} has {module.out_features} outputs, not num_classes="
                         f"{num_classes}: name the output layer with head= (Linear "
                         f"modules: {names})")
    return head, module


class HeadAdapter(FeatureClassifier):
    """``model`` as a ``FeatureClassifier`` (see the module docstring); ``model`` is held,
    not copied: loading a state into the adapter loads it into ``model``."""

    def __init__(self, model: nn.Module, head: str | None = None,
                 num_classes: int | None = None) -> None:
        nn.Module.__init__(self)
        name, module = find_head(model, head, num_classes)
        clash = [k for k in model.state_dict() if k.startswith(HEAD_PREFIX)]
        if name + "." != HEAD_PREFIX and clash:
            raise UsageError(f"model {type(model).__name__} has state keys {clash[0]!r}... "
                             f"under {HEAD_PREFIX!r} besides its head {name!r}: rename them "
                             "or name that module the head")
        self.net = model
        self.head_name = name
        self.feature_dim = module.in_features
        self.num_classes = module.out_features

    @property
    def classifier(self) -> nn.Linear:  # type: ignore[override]
        # find_head checked that it is a Linear when the adapter was built
        return cast(nn.Linear, self.net.get_submodule(self.head_name))

    # ---- features: the head's input, taken by a pre-hook -------------------------------
    def features(self, x: Tensor) -> Tensor:
        box: list[Tensor] = []

        def take(_module: nn.Module, args: tuple[Any, ...]) -> None:
            box.append(args[0])
            raise _Stop

        handle = self.classifier.register_forward_pre_hook(take)
        try:
            self.net(x)
        except _Stop:
            pass
        finally:
            handle.remove()
        if not box:
            raise UsageError(f"the head {self.head_name!r} was not called in "
                             f"{type(self.net).__name__}.forward: name the output layer "
                             "with head=")
        z = box[0]
        if not isinstance(z, Tensor) or z.dim() != 2 or z.shape[1] != self.feature_dim:
            shape = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
            raise UsageError(f"the head {self.head_name!r} receives {shape}, not one row of "
                             f"{self.feature_dim} features per sample")
        return z

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))

    def check(self, x: Tensor) -> None:
        """Refuse (UsageError) a head whose logits' argmax differs from the model's output
        on ``x`` (one batch): the head is then not the layer the model predicts with."""
        was = self.net.training
        self.net.eval()
        try:
            with torch.no_grad():
                out = self.net(x)
                logits = self.forward(x)
        finally:
            self.net.train(was)
        if not isinstance(out, Tensor) or out.shape != logits.shape \
                or not torch.equal(out.argmax(1), logits.argmax(1)):
            raise UsageError(f"the model's output is not its head {self.head_name!r}'s "
                             "(their argmax differ): name the output layer with head=")

    # ---- states: the user's keys outside, privfedcal's head keys inside -----------------
    def adapter_key(self, key: str) -> str:
        prefix = self.head_name + "."
        return HEAD_PREFIX + key[len(prefix):] if key.startswith(prefix) else key

    def user_key(self, key: str) -> str:
        return self.head_name + "." + key[len(HEAD_PREFIX):] if key.startswith(HEAD_PREFIX) \
            else key

    def adapter_state(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """A state of the user's model with the head's keys renamed for the calibrators."""
        return {self.adapter_key(k): v for k, v in state.items()}

    def user_state(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The inverse of ``adapter_state``: the user's own key names."""
        return {self.user_key(k): v for k, v in state.items()}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return OrderedDict(self.adapter_state(self.net.state_dict(*args, **kwargs)))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        return self.net.load_state_dict(self.user_state(state_dict), strict=strict,
                                        assign=assign)
