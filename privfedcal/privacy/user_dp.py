"""User-level differential privacy of the model updates: DP-FedAvg.

McMahan, Ramage, Talwar & Zhang, "Learning Differentially Private Recurrent Language
Models" (ICLR 2018), Algorithm 1 with the fixed-denominator estimator: each participant's
model update ``Delta_k = state_k - global`` is clipped to L2 norm ``<= S`` (all floating
entries of the state together, buffers included), the clipped updates are summed, Gaussian
noise ``N(0, (z S)^2 I)`` is added to the sum, and the sum is divided by a PUBLIC
denominator ``m`` (the clients asked per round, from the config), never by the number that
arrived or by client sizes (weights are uniform: sizes never leave a client).

Sensitivity: neighbouring federations differ in ONE client's whole data, present or absent
(an absent client's update is zero: "zero-out" adjacency, as add/remove one example is at
sample level). The sum of clipped updates then moves by at most ``S``, so one round is a
Gaussian mechanism with noise multiplier ``z`` (docs/privacy/dp-updates.md, "User-level DP on model
updates"). Under replace-one adjacency the sensitivity is ``2 S``.

Accounting (no amplification by client sampling): privfedcal selects each round's clients
from the public seed (``cohorts.select_clients``), so anyone holding the config knows who
takes part; subsampling amplification assumes a selection secret from the adversary
(Poisson sampling on hidden coins), which does not hold here. Each round a client takes part
in is charged to that client's accountant as a full Gaussian release (q = 1), through the
run's ``DPAccounting`` (its per-client accountants and ledgers, shared with the calibration
releases), and the noise is planned over the most rounds any client takes part in.

Where the noise is added:
- central (default): the server adds the noise to the sum of clipped updates. The server
  itself sees every clipped update (the transcript records them): the guarantee holds for
  the global models it publishes (to the clients, to the model's users), not against it.
- distributed (``--secagg-updates``): each of the round's ``n`` participants (public; ``n``
  may exceed ``m`` where cohorts are selected whole) adds its share ``1/(n - 1)`` of the
  variance (``n - 1`` shares already carry the full variance, so the key holder's node,
  which knows its own share, cannot bring the sum below it) before CKKS encryption; the
  server sees only the noisy sum, and the guarantee holds against it too, provided the key
  holder does not collude with it.
Noise comes from OS entropy (privacy/noise.py); with ``--insecure-seeded-noise`` nothing holds.

The stage keeps its clip, noise, journal and charge here; the round's receipt is
privacy/dp_fedavg_round.py, the flat-vector arithmetic privacy/update_vectors.py (its names
re-exported here), the report privacy/user_dp_summary.py. A stage may move the clip
between rounds through ``use_clip_policy`` (``ClipPolicy``): the adaptive clip
(``--dp-adaptive-clip``, privacy/adaptive_clip.py, its own registered stage) does, from a
noised count released in the same round.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Generator, Tensor

from privfedcal.errors import UsageError
from privfedcal.privacy.accounting import ReleasePlan
from privfedcal.privacy.dp_fedavg_round import ClipPolicy, receive_round
from privfedcal.privacy.noise import noise_generator
from privfedcal.privacy.release_journal import SERVER, ReleaseJournal, charge_of
from privfedcal.privacy.releases import USER_DP_RELEASE
from privfedcal.privacy.update_stage import Received, State, UpdateRound, UpdateStage
from privfedcal.privacy.update_vectors import (
    UpdateLayout,
    clip_factor,
    clip_update,
    gaussian_noise,
    gaussian_vector,
    model_delta,
    moved_state,
    update_norm,
    vector_norm,
)
from privfedcal.privacy.user_dp_summary import (
    USER_DP_ASSUMPTIONS,
    user_dp_summary,
    worst_user_epsilon,
)
from privfedcal.settings.messages import SettingError

if TYPE_CHECKING:
    from privfedcal.privacy.dp_accounting import DPAccounting
    from privfedcal.privacy.plan import UserDPPlan
    from privfedcal.privacy.transcript import Transcript

#: default L2 bound S of a client's update (the digits MLP's two-epoch updates have norms
#: of a few units: 1.0 clips most of them, as DP-FedAvg intends)
DEFAULT_UPDATE_CLIP = 1.0

def distributed_share(clients: int) -> float:
    """Each client's share of the noise variance under secure aggregation: ``1/(n - 1)``
    of the ``n`` clients taking part, so that any ``n - 1`` shares carry the full variance."""
    return 1.0 if clients <= 2 else 1.0 / (clients - 1)


def release_plan(steps: int, share: float | None) -> ReleasePlan:
    """The accountant's plan of the updates: ``steps`` Gaussian releases at q = 1 (the most
    rounds any client takes part in), with a ``share`` of the budget beside calibration
    releases (None: alone, it takes the whole budget)."""
    return ReleasePlan(USER_DP_RELEASE, 1.0, steps, share=share)


@dataclass
class UserDP(UpdateStage):
    """DP-FedAvg's clipping, noise and charge for one run; ``dp`` holds the noise plan and
    the per-client accountants and ledgers (privacy/dp_accounting.py). An update stage
    (privacy/update_stage.py) that takes the round: it clips each update as it arrives,
    sums them (through the updates' wire where there is one), noises the sum and divides it
    by the public denominator."""

    dp: DPAccounting
    clip: float
    denominator: int  # clients asked per round: public
    distributed: bool  # --secagg-updates: the clients add the noise, in shares
    seed: int = 0
    seeded: bool = False
    adaptive: ClipPolicy | None = None  # what moves ``clip`` every round (None: fixed)
    #: each party's journal of its releases (privacy/release_journal.py): a round redone
    #: after a stop re-sends the noised updates, sums and counts it sent, never fresh draws
    journal: ReleaseJournal | None = None
    #: (round, size, future) of the server noise drawn ahead (``draw_ahead``)
    _ahead: tuple[int, int, Any] | None = field(default=None, init=False, repr=False,
                                                 compare=False)
    label = USER_DP_RELEASE
    name = "dp-fedavg"
    takes = True
    top_level_key = "user_dp"

    @classmethod
    def of(cls, p: UserDPPlan, dp: DPAccounting | None) -> UserDP:
        """DP-FedAvg of plan ``p`` (the planner's ``user_dp_plan``), charged to ``dp``."""
        assert dp is not None, "DP-FedAvg is planned with a noise plan"
        return cls(dp, p.clip, denominator=p.denominator, distributed=p.distributed,
                   seed=p.seed, seeded=p.seeded)

    def __post_init__(self) -> None:
        self.initial_clip = self.clip
        if self.adaptive is not None:
            self.adaptive.check(self)
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise SettingError(f"{{dp_update_clip}} must be a finite number > 0, got {self.clip}")
        if self.denominator < 1:
            raise UsageError(f"DP-FedAvg needs >= 1 client per round, got {self.denominator}")
        if self.label not in self.dp.sigmas:
            raise SettingError("the noise plan has no model-update release: {dp_updates} was "
                             "not planned")

    @property
    def noise_multiplier(self) -> float:
        return self.dp.sigmas[self.label]

    def draw_ahead(self, n: int, round_: int) -> None:
        """Start drawing round ``round_``'s server noise (``n`` standard normals) on a
        background thread while the clients train: the draw depends on no data, so it leaves
        the round's critical path; ``add_server_noise`` scales it by the round's std then
        (the same numbers as a draw at that point: ``x * 1.0`` is exact). Nothing to draw
        when the clients add the noise."""
        if self.distributed:
            return
        from privfedcal.privacy.noise import draw_in_background

        self._ahead = (round_, n, draw_in_background(
            lambda: gaussian_vector(n, 1.0, self._sum_generator(round_))))

    def _drawn(self, n: int, round_: int, std: float) -> Tensor:
        """Round ``round_``'s server noise of std ``std``: the draw started by
        ``draw_ahead`` for this round and size, or a draw now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[:2] == (round_, n):
            return ahead[2].result().mul_(std)
        return gaussian_vector(n, std, self._sum_generator(round_))

    def _sum_generator(self, round_: int) -> Generator:
        """The generator of round ``round_``'s noise on the sum (stream 302)."""
        return noise_generator(self.seed, round_, -1, 302, seeded=self.seeded)

    def use_clip_policy(self, policy: ClipPolicy) -> None:
        """Let ``policy`` move the clip after every round (a stage's ``join``: the adaptive
        clip's, privacy/adaptive_clip.py)."""
        policy.check(self)
        self.adaptive = policy

    @property
    def count_std(self) -> float | None:
        """Std of the noise on the clip policy's own release (the adaptive clip's count of
        updates within the clip); None with a fixed clip."""
        return None if self.adaptive is None else self.adaptive.count_std(self)

    @property
    def update_multiplier(self) -> float:
        """The updates' own multiplier: ``z``, or more where the clip policy's release
        shares the round."""
        return (self.noise_multiplier if self.adaptive is None
                else self.adaptive.update_multiplier(self))

    @property
    def std(self) -> float:
        """Std of the noise on the SUM of clipped updates: ``z * S`` (``z_u * S`` adaptive)."""
        return self.update_multiplier * self.clip

    def client_share(self, participants: int | None = None) -> float:
        """Variance share each client adds: 0 with central noise; distributed, ``1/(n - 1)``
        for the round's ``n`` participants (public: the selection comes from the config;
        under cohorts a round may select more than ``m``), default ``m``."""
        if not self.distributed:
            return 0.0
        return distributed_share(self.denominator if participants is None else participants)

    # ---- the update stage's hooks ----------------------------------------------------------
    @property
    def noises_updates(self) -> bool:
        return True

    @property
    def hides_loss(self) -> bool:
        """No training loss leaves a client: it is data-dependent and outside the budget."""
        return True

    @property
    def accounting(self) -> DPAccounting:
        return self.dp

    def attach_journal(self, journal: ReleaseJournal, noised: bool) -> None:
        self.journal = journal

    def client(self, state: State, rnd: UpdateRound) -> State:
        """A node's half (the Flower apps): the global state moved by the node's update
        clipped to the clip (integer buffers keep the global values). The server clips
        again and adds the noise to the sum (central noise), so a node that skips its clip
        still cannot move the sum by more than the clip."""
        delta, _ = self.client_update(rnd.global_state, state, rnd.round_, rnd.client)
        out = dict(rnd.global_state)
        for key, value in delta.items():
            out[key] = (rnd.global_state[key].double() + value).to(state[key].dtype)
        return out

    def receive(self, rnd: UpdateRound, average: Callable[..., State] | None) -> Received:
        return self.receive_round(rnd.trainer, rnd.jobs, rnd.global_state, rnd.selected,
                                  rnd.round_, rnd.transcript, rnd.recipe, average)

    def receive_round(self, trainer: Any, jobs: list, global_state: State,
                      selected: list[int], round_: int, transcript: Transcript,
                      recipe: dict[str, Any], secure_average: Callable[..., State] | None
                      ) -> Received:
        """One round under DP-FedAvg (privacy/dp_fedavg_round.py ``receive_round``):
        (results, new global state, bytes uploaded, results for the divergence check);
        ``secure_average`` is the updates' wire's average under --secagg-updates, else
        None."""
        return receive_round(self, trainer, jobs, global_state, selected, round_,
                             transcript, recipe, secure_average)

    # ---- one round -----------------------------------------------------------------------
    def admit_round(self, clients: list[int]) -> None:
        """Before training: the server's budget check, then each client's own ledger."""
        self.dp.check(self.label, clients)
        self.dp.admit(self.label, clients)

    def charge_round(self, clients: list[int]) -> None:
        self.dp.record(self.label, clients)

    def client_update(self, global_state: State, state: State, round_: int, client: int,
                      participants: int | None = None) -> tuple[State, bool]:
        """Client side: its clipped update, plus its noise share when distributed (of a
        round with ``participants`` clients, default ``m``), and whether its norm was within
        the clip (the adaptive clip's bit)."""
        layout = UpdateLayout(global_state)
        delta = layout.flatten(state).sub_(layout.flatten(global_state))
        within = self.clip_and_share(delta, vector_norm(delta), round_, client, participants)
        return layout.unflatten(delta), within

    def clip_and_share(self, delta: Tensor, norm: float, round_: int, client: int,
                       participants: int | None = None) -> bool:
        """``client_update`` on a flat float64 update of norm ``norm``, in place: scaled by
        ``min(1, S / norm)``, then its noise share added when distributed. Returns whether
        the norm was within the clip."""
        factor = clip_factor(norm, self.clip)
        if factor != 1.0:
            delta.mul_(factor)
        share = self.client_share(participants)
        if share > 0:
            g = noise_generator(self.seed, round_, client, 301, seeded=self.seeded)
            delta.add_(gaussian_vector(delta.numel(), self.std * math.sqrt(share), g)
                       .to(delta.device))
        return norm <= self.clip

    def adapt(self, within: int, round_: int) -> None:
        """Server side, after the round: the clip policy moves the clip for the next round
        (``within``: the round's updates within the clip); a fixed clip stays."""
        if self.adaptive is not None:
            self.clip = self.adaptive.moved_clip(self, within, round_)

    def server_noise(self, total: State, round_: int) -> State:
        """Server side, central noise: ``N(0, (z S)^2)`` on the sum (none when distributed);
        the entries' form of ``add_server_noise``, which draws it (float64)."""
        if self.distributed:
            return total
        layout = UpdateLayout(total)
        flat = layout.flatten(total)
        self.add_server_noise(flat, round_)
        return {**total, **layout.unflatten(flat)}

    def add_server_noise(self, total: Tensor, round_: int) -> None:
        """``server_noise`` on the flat sum, in place (the same draws for the same layout)."""
        if self.distributed:
            return
        total.add_(self._drawn(total.numel(), round_, self.std).to(total.device))
        total.copy_(self.released(round_, self.label, SERVER, total))

    def released(self, round_: int, label: str, party: int | str, value: Tensor) -> Tensor:
        """``value`` as released by ``party``: journaled before it leaves, or the journaled
        one where a stop made the round be redone (no journal: ``value``)."""
        if self.journal is None:
            return value
        return self.journal.once(round_, label, party, {"value": value},
                                 charge=charge_of(self.dp, self.label))["value"]

    def apply(self, global_state: State, layout: UpdateLayout, base: Tensor,
              total: Tensor) -> State:
        """The new global state ``global + total / m`` (update_vectors.py ``moved_state``)."""
        return moved_state(global_state, layout, base, total, self.denominator)

    def state_dict(self) -> dict[str, Any]:
        return {"clip": self.clip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        clip = float(state.get("clip", self.clip))
        if not (math.isfinite(clip) and clip > 0):
            raise UsageError(f"a checkpoint's update clip must be > 0, got {clip}")
        self.clip = clip

    # ---- report ----------------------------------------------------------------------------
    def user_epsilon(self) -> float:
        """The largest epsilon any client has spent on its model updates alone (user level)."""
        return worst_user_epsilon(self.dp.per_client, self.label)

    def summary(self) -> dict[str, Any]:
        return user_dp_summary(
            eps=self.user_epsilon(), delta=self.dp.delta,
            noise_multiplier=self.noise_multiplier, clip=self.clip,
            clip_words=(f"update clip {self.clip:g}" if self.adaptive is None
                        else self.adaptive.describe(self)),
            std=self.std, denominator=self.denominator, distributed=self.distributed,
            adaptive=None if self.adaptive is None else self.adaptive.clip_summary(self))


__all__ = ["DEFAULT_UPDATE_CLIP", "USER_DP_ASSUMPTIONS", "ClipPolicy", "UpdateLayout", "UserDP",
           "clip_factor", "clip_update", "distributed_share", "gaussian_noise",
           "gaussian_vector", "model_delta", "release_plan", "update_norm", "vector_norm"]
