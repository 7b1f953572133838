"""One run, many canaries, under DP-SGD: the one-run bound on a whole training run.

The run is the configuration's real training (``Simulator`` over every round, DP-SGD on
every client, the run's schedule and accountant), with canary examples added to the
clients' data: ``m`` random inputs with random labels (mislabelled outliers, the canaries of
Jagielski et al. 2020 and Steinke et al. 2023), each dealt to one client and included with
probability 1/2 by a coin from OS entropy. The auditor sees what the server sees at the end,
the global model, and knows every canary and the initial model (public: the code, the
config, the seed). A canary's score is how much the run lowered its loss; the surest
``guesses / 2`` at each end are guessed in and out, and the count of right guesses bounds
epsilon (``privacy/empirical.one_run_epsilon``). The claim is the run's own: the worst
client's epsilon, which covers each canary as one example of its client.

Under a time budget (``audit dp --budget-s``) the training stops after the round in which
the budget ran out; the canaries are then scored on that round's global model against the
accountant's charge for the rounds trained, and the row is marked ``stopped``.

The neighbouring datasets the claim covers differ in one example; a canary is one, so the
bound is directly comparable. The score reads the final model only (a weaker view than every
round's updates), so the bound is lower than what an auditor of the whole transcript could
certify; it is the black-box one-run audit of Steinke et al., section 6.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from privfedcal.attacks.distinguishing.channels import Faults
from privfedcal.attacks.distinguishing.games import BUDGET_STOP, budget_spent
from privfedcal.attacks.distinguishing.one_run import guess_membership
from privfedcal.errors import UsageError
from privfedcal.privacy.empirical import one_run_epsilon
from privfedcal.settings.messages import SettingError

#: canaries' input scale, in units of the normalised data's (unit variance) scale
CANARY_INPUT_SCALE = 3.0


def add_canaries(exp: Any, per_client: int, generator: torch.Generator
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Append ``per_client`` canaries per client to ``exp.data``'s training split (random
    inputs of the data's shape and scale ``CANARY_INPUT_SCALE``, random labels) and add the
    included ones (a fair coin each) to their client's indices in ``exp.parts``. Returns
    (inputs, labels, owner client, included) of every canary."""
    data, clients = exp.data, len(exp.parts)
    m = per_client * clients
    x = CANARY_INPUT_SCALE * torch.randn((m, *data.x_train.shape[1:]), generator=generator)
    y = torch.randint(0, data.num_classes, (m,), generator=generator)
    member = torch.randint(0, 2, (m,), generator=generator).bool()
    owner = torch.arange(m) % clients
    x, y = x.to(data.x_train), y.to(data.y_train)
    first = data.x_train.shape[0]
    extra = {"x_train": torch.cat([data.x_train, x]), "y_train": torch.cat([data.y_train, y])}
    if data.domains_train is not None:
        extra["domains_train"] = torch.cat([data.domains_train,
                                            data.domains_train.new_zeros(m)])
    if data.users_train is not None:  # read by the partition only, which is already drawn
        extra["users_train"] = torch.cat([data.users_train, data.users_train.new_zeros(m)])
    exp.data = dataclasses.replace(data, **extra)
    ids = torch.arange(first, first + m)
    for k in range(clients):
        mine = ids[(owner == k) & member].to(exp.parts[k].device)
        exp.parts[k] = torch.sort(torch.cat([exp.parts[k], mine])).values
    return x, y, owner, member


def _losses(model: Any, state: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(x), y, reduction="none").double().cpu()


class _BudgetSpent(Exception):
    """Raised between two rounds when the audit's time budget is spent."""


def one_run_training(cfg: Any, *, per_client: int = 100, guesses: float = 0.1,
                     confidence: float = 0.95, faults: Faults = Faults(),
                     budget_s: float | None = None,
                     progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """The ``dp-sgd (one run)`` row of dp_audit.csv: train ``cfg`` (which must use
    ``--dp-train``) once with ``per_client`` canaries per client and bound epsilon from the
    final model's canary losses. ``faults`` (tests) scale DP-SGD's noise or turn its
    clipping off, as in ``attacks/distinguishing/channels.py``.

    ``budget_s``: the training stops after the round in which the budget ran out (at least
    one round); the canaries are scored on the model after the last round trained and the
    claim is what the accountant charged for those rounds (a run of fewer rounds is a
    mechanism of its own, whose claim that is), the row marked ``stopped`` = ``budget``.
    ``progress(round, rounds)`` after every round."""
    from privfedcal.experiment import build_parts
    from privfedcal.privacy.noise import noise_generator

    if not cfg.privacy.dp_train:
        raise SettingError("the one-run audit of training needs {dp_train} (DP-SGD): without it "
                         "the model updates carry no guarantee to audit")
    if not 0 < guesses <= 1 or per_client < 1:
        raise UsageError(f"need 0 < guesses <= 1 and per_client >= 1, got {guesses}, "
                         f"{per_client}")
    t0 = time.perf_counter()
    cfg = cfg.replace(transcript=False, out=None, workers=1)
    exp, calibrator, uplink = build_parts(cfg)
    exp.spec = dataclasses.replace(exp.spec, dp_sgd=_with_faults(exp.spec.dp_sgd, faults))
    x, y, _, member = add_canaries(exp, per_client, noise_generator())
    start, final, privacy, trained = _train(exp, calibrator, uplink, t0, budget_s, progress)
    dev = exp.device
    model = exp.model
    score = _losses(model, start, x.to(dev), y.to(dev)) - _losses(model, final, x.to(dev),
                                                                  y.to(dev))
    m = len(score)
    half, right = guess_membership(score, member, guesses)
    claim = float(privacy.get("epsilon_spent", float("nan")))
    delta = float(privacy.get("delta", 0.0))
    eps = one_run_epsilon(m, 2 * half, right, delta, confidence)
    planned = cfg.training.rounds
    rounds = (f"the whole run of {planned} round(s)" if trained == planned else
              f"{trained} of the run's {planned} rounds (time budget)")
    return {"channel": "dp-sgd (one run)", "claimed_eps": claim, "delta": delta,
            "eps_lower": eps, "confidence": confidence, "trials": 1,
            "canary": (f"{m} canaries ({cfg.data.clients} clients x {per_client}: random inputs "
                       f"x {CANARY_INPUT_SCALE:g}, random labels, each in with a fair coin), "
                       f"{rounds}, scored on the last global model; "
                       f"{2 * half} guesses, {right} right"),
            "stopped": "" if trained == cfg.training.rounds else BUDGET_STOP,
            "score": "loss drop", "false_pos": 2 * half - right, "false_neg": 0,
            "test_trials": 2 * half, "seconds": time.perf_counter() - t0}


def _with_faults(dp: Any, faults: Faults) -> Any:
    """DP-SGD's settings under ``faults`` (tests): clipping off keeps the noise's std
    (z times the bound) unchanged; ``noise_scale`` scales z."""
    if not faults.clip:
        dp = dataclasses.replace(dp, max_grad_norm=1e9,
                                 noise_multiplier=dp.noise_multiplier * dp.max_grad_norm / 1e9)
    if faults.noise_scale != 1.0:
        dp = dataclasses.replace(dp, noise_multiplier=dp.noise_multiplier * faults.noise_scale)
    return dp


def _train(exp: Any, calibrator: Any, uplink: Any, t0: float, budget_s: float | None,
           progress: Callable[[int, int], None] | None
           ) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Any], int]:
    """Train ``exp`` in a temporary folder, stopping after the round in which ``budget_s``
    ran out: (start and final global states, the privacy record, rounds trained)."""
    from privfedcal.federation.simulator import Simulator

    cfg = exp.loop
    trained = 0

    def on_round(record: dict[str, Any]) -> None:
        nonlocal trained
        trained = record["round"]
        if progress is not None:
            progress(trained, cfg.training.rounds)
        if trained < cfg.training.rounds and budget_spent(t0, budget_s):
            raise _BudgetSpent

    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulator(exp, Path(tmp), calibrator=calibrator, uplink=uplink)
        start = {k: v.clone() for k, v in sim.global_state.items()}  # public: seed
        try:
            privacy = sim.run(progress=on_round).get("privacy", {})
        except _BudgetSpent:  # the global model after the last round trained
            privacy = _spent(uplink)
        final = {k: v.clone() for k, v in sim.global_state.items()}
    return start, final, privacy, trained


def _spent(uplink: Any) -> dict[str, Any]:
    """``epsilon_spent`` and ``delta`` of a run stopped between rounds: its accountant's
    charge so far (the run's summary.json is not written)."""
    dp = next((s.dp for s in uplink.stages if getattr(s, "dp", None) is not None), None)
    return {} if dp is None else {"epsilon_spent": dp.epsilon(), "delta": dp.delta}


__all__ = ["CANARY_INPUT_SCALE", "add_canaries", "one_run_training"]
