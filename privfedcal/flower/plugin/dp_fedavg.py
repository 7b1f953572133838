"""DP-FedAvg of a Flower user's own strategy, in the same budget as the plugin's calibration.

    strategy = PrivateUpdates(FedAvg(...), context)     # ServerApp, around your strategy
    result = strategy.start(grid=grid, initial_arrays=..., num_rounds=...)
    model.load_state_dict(result.arrays.to_torch_state_dict())
    summary = calibrate(grid, model, context, head="fc3", test_data=..., updates=strategy)

and on the nodes Flower's own ``fixedclipping_mod`` on the ``train`` handler
(``@app.train(mods=[fixedclipping_mod])``), next to ``CalibrationClient``.

The run config says ``privfedcal.dp-updates = true`` and ``privfedcal.rounds`` (the
strategy's rounds), beside ``privfedcal.dp-eps``: with them privfedcal's planner
(``protection.noise_plan``, the same as ``privfedcal train --dp-updates``) plans DP-FedAvg's
rounds (user level, q = 1 for every round a node takes part in) and the calibration release
in one budget, on the server and on every node alike (the settings digest covers them).

What each side does, and why it holds:

* the node: Flower's ``fixedclipping_mod`` clips the node's update (the returned arrays
  minus the arrays it was sent) to the clip the server's message carries (Flower's
  ``KEY_CLIPPING_NORM``), ``dp-update-clip``;
* the server (``aggregate_train``): every update clipped again against the arrays it sent
  (a node that skips the mod still moves the sum by at most the clip), summed with equal
  weights, Gaussian noise ``N(0, (z S)^2)`` added to the sum by ``UserDP``
  (privacy/user_dp.py: float64 draws from OS entropy), divided by the PUBLIC number of
  nodes asked per round (``UserDP.denominator``), never by sizes or arrivals. Central noise:
  the guarantee holds against everyone who sees the models, not against the server, which
  sees each clipped update (as Flower's own DP wrappers; docs/flower.md);
* the charges: before a round the ledger's budget check and each node's planned count
  (``UserDP.admit_round``), after it the release recorded (``UserDP.charge_round``), in a
  ``DPAccounting`` planned exactly as the calibration's. ``calibrate(..., updates=...)``
  takes this ledger over, so summary.json's one ``epsilon_spent`` covers the rounds and
  the calibration release together (``privacy.user_dp`` gives the rounds' own).

A round whose replies are not exactly the nodes asked (a lost node, an error) releases
nothing: the global arrays stay and the nodes asked are charged all the same. A non-finite
update is summed as zero (an absent node's update, which the sensitivity covers).

Accuracy: the noise on the average is ``z S / m`` on every coordinate, so user-level DP
needs many nodes per round; with the three nodes of the quickstart at epsilon 8 it leaves
the model at chance (docs/results/flower.md).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from privfedcal.errors import UsageError
from privfedcal.flower.link import GridLink
from privfedcal.flower.plugin.plugin_settings import PluginSettings, gather, resolve
from privfedcal.privacy.user_dp import UpdateLayout, UserDP, vector_norm

__all__ = ["PrivateUpdates", "private_average"]

log = logging.getLogger("privfedcal.flower")


def plan_updates(s: PluginSettings, examples: int) -> Any:
    """The server's uplink for settings ``s`` and ``examples`` in all, as ``calibrate``
    plans it (``server_calibration._server_side``): its ``user_dp`` and ``DPAccounting``."""
    from privfedcal.experiment import calibrator_class
    from privfedcal.privacy.executor import execute_plan
    from privfedcal.privacy.planner import plan_for_run
    from privfedcal.settings.floors import PrivacyOptions

    preset = s.auto_clip.preset() if s.auto_clip is not None else None
    return execute_plan(plan_for_run(PrivacyOptions.of(s.cfg), calibrator_class(s.cfg),
                                     examples, preset))


def private_average(user_dp: Any, state: dict[str, torch.Tensor],
                    locals_: list[dict[str, torch.Tensor]], round_: int
                    ) -> dict[str, torch.Tensor]:
    """The new global state: ``state`` plus the sum of the nodes' updates (``locals_``
    minus ``state``), each clipped to ``user_dp.clip`` here whatever the node did, with
    ``user_dp``'s Gaussian noise, divided by ``user_dp.denominator`` (public). A
    non-finite update is summed as zero (an absent node's)."""
    layout = UpdateLayout(state)
    base = layout.flatten(state)
    total = torch.zeros_like(base)
    for local in locals_:
        delta = layout.flatten(local).sub_(base)
        norm = vector_norm(delta)
        if not math.isfinite(norm):
            log.warning("round %d: a non-finite update left out of the sum", round_)
            continue
        user_dp.clip_and_share(delta, norm, round_, -1)
        total.add_(delta)
    user_dp.add_server_noise(total, round_)
    return user_dp.apply(state, layout, base, total)


class PrivateUpdates(Strategy):
    """``strategy``'s training under DP-FedAvg, planned and charged by privfedcal (module
    docstring); evaluation is ``strategy``'s own. ``context``: the ServerApp's Context (its
    run config's ``privfedcal.*`` keys override the keyword ``settings``)."""

    def __init__(self, strategy: Strategy, context: Context | None = None,
                 **settings: Any) -> None:
        super().__init__()
        self.strategy = strategy
        self.run_config = dict(context.run_config) if context is not None else {}
        self.keywords = settings
        self.uplink: Any = None       # planned on the first round (the grid's nodes)
        self.settings: PluginSettings | None = None
        self.client_of: dict[int, int] = {}  # SuperNode id -> partition id
        self._sent: dict[int, tuple[ArrayRecord, list[int]]] = {}  # round -> arrays, clients

    @property
    def user_dp(self) -> Any:
        """The uplink's DP-FedAvg stage (privacy/user_dp.py), once planned."""
        return None if self.uplink is None else self.uplink.find(UserDP)

    def _plan(self, grid: Grid) -> None:
        """The settings, each node's partition (``query.hello``, its settings checked)
        and the plan, once."""
        from privfedcal.flower.plugin.server_calibration import _hello

        nodes = len(list(grid.get_node_ids()))
        s = resolve(gather(self.keywords, self.run_config), clients=nodes or None)
        if not s.cfg.privacy.dp_updates:
            raise UsageError("PrivateUpdates needs privfedcal.dp-updates = true and "
                             "privfedcal.dp-eps in the run config (dp_updates=True, dp_eps= "
                             "as keywords)")
        if s.method != "ccvr":
            raise UsageError("PrivateUpdates runs with method ccvr: privfedcal.rounds is "
                             "then the strategy's rounds (CReFF's rounds are its own)")
        link = GridLink(grid, s.cfg.data.clients, s.options)
        sizes = _hello(link, s)
        self.client_of = {node: client for client, node in link.node_of.items()}
        self.settings = s
        self.uplink = plan_updates(s, s.examples or sum(sizes.values()))

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3,
              *args: Any, **kwargs: Any) -> Any:
        """``Strategy.start``, refused where it would run more rounds than planned."""
        self._plan(grid)
        planned = self.settings.cfg.training.rounds  # type: ignore[union-attr]
        if num_rounds > planned:
            raise UsageError(f"num_rounds {num_rounds} is more than privfedcal.rounds "
                             f"{planned}, the rounds DP-FedAvg was planned for")
        return super().start(grid, initial_arrays, num_rounds, *args, **kwargs)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """The strategy's train messages with the clip for ``fixedclipping_mod``, after the
        budget check and each node's count (``UserDP.admit_round``)."""
        config[KEY_CLIPPING_NORM] = self.user_dp.clip
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        clients = sorted(self.client_of[m.metadata.dst_node_id] for m in messages)
        if messages and len(clients) != self.user_dp.denominator:
            raise UsageError(f"the strategy asked {len(clients)} nodes in round "
                             f"{server_round}, DP-FedAvg divides by "
                             f"{self.user_dp.denominator}: match privfedcal.participation "
                             "to the strategy's fraction_train")
        if messages:
            self.user_dp.admit_round(clients)
            self._sent[server_round] = (arrays, clients)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The noisy average of the clipped updates (module docstring); None where the
        replies are not exactly the nodes asked. Train metrics stay on the server's side
        unreleased (they are the nodes' own numbers)."""
        sent, clients = self._sent.pop(server_round)
        replies = list(replies)
        self.user_dp.charge_round(clients)  # asked: charged, whatever comes back
        got = sorted(self.client_of.get(r.metadata.src_node_id, -1) for r in replies
                     if not r.has_error())
        if got != clients:
            log.warning("round %d: DP-FedAvg got %d of %d updates: nothing released",
                        server_round, len(got), len(clients))
            return None, None
        locals_: list[dict[str, torch.Tensor]] = [
            next(iter(r.content.array_records.values())).to_torch_state_dict() for r in replies]
        new = private_average(self.user_dp, sent.to_torch_state_dict(), locals_, server_round)
        log.info("round %d: DP-FedAvg of %d clipped updates, epsilon %.4f spent so far",
                 server_round, len(replies), self.user_dp.dp.epsilon())
        return ArrayRecord(new), None

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord,
                           config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()

    def hand_over(self, settings: PluginSettings, dp: Any) -> None:
        """``calibrate(..., updates=self)``: the rounds' charges into the calibration's
        ``DPAccounting`` ``dp``, planned from the same ``settings`` (checked), so that one
        ledger and one epsilon cover both."""
        if self.user_dp is None or self.settings is None:
            raise UsageError("calibrate(updates=...) was given a PrivateUpdates that has "
                             "not trained: call its start first")
        if self.settings.digest() != settings.digest() or \
                dict(self.user_dp.dp.sigmas) != dict(dp.sigmas):
            raise UsageError("calibrate(updates=...): the strategy was planned with other "
                             "privfedcal settings than calibrate's: give both the same")
        dp.load_state_dict(self.user_dp.dp.state_dict())
