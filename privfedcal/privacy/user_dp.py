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
With ``--dp-adaptive-clip`` the clip follows a quantile of the update norms through a noised
count released in the same round (privacy/adaptive_clip.py, central noise only).

Arithmetic: a round lays the floating entries of each update end to end in one float64
vector (``UpdateLayout``): the norm, the clip, the noise and the sum are one operation each
on it, not one per entry. float64 keeps the clip exact to the last bits of a float32 model
and the sum of hundreds of clipped updates free of float32 rounding. The noise is drawn in
float64 too: torch draws float32 normals from 24-bit uniforms, so their tails stop near 5.8
standard deviations (Box-Muller's largest radius, ``sqrt(2 ln 2^24)``), while the Gaussian
mechanism's guarantee assumes the whole tail; float64 draws reach beyond 8 standard
deviations, a truncation far below any delta used here, and the draw is once per round on
the server (about a millisecond for 50,000 coordinates).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from privfedcal.errors import UsageError
from privfedcal.privacy.accounting import ReleasePlan, compute_epsilon
from privfedcal.privacy.adaptive_clip import AdaptiveClip, count_noise_std, update_multiplier
from privfedcal.privacy.noise import noise_generator
from privfedcal.privacy.release_journal import SERVER, ReleaseJournal, charge_of
from privfedcal.privacy.releases import UPDATE_RELEASE, USER_DP_RELEASE
from privfedcal.privacy.transcript import Transcript, record_model_updates
from privfedcal.privacy.update_stage import UpdateRound, UpdateStage
from privfedcal.settings.messages import SettingError
from privfedcal.tensors import nonfinite_key

if TYPE_CHECKING:
    from privfedcal.privacy.dp_accounting import DPAccounting
    from privfedcal.privacy.plan import UserDPPlan

State = dict[str, Tensor]

#: default L2 bound S of a client's update (the digits MLP's two-epoch updates have norms
#: of a few units: 1.0 clips most of them, as DP-FedAvg intends)
DEFAULT_UPDATE_CLIP = 1.0

#: what the user-level guarantee assumes (summary.json, docs/threat-model.md)
USER_DP_ASSUMPTIONS = [
    "user level: neighbouring federations differ in one client's whole data, present or "
    "absent (zero-out adjacency; replace-one doubles the sensitivity)",
    "no amplification by client sampling: the selection comes from the public seed, so each "
    "round a client takes part in is a full Gaussian release (q = 1)",
    "the average divides by the public number of clients asked per round, never by a count "
    "or size that depends on the data",
    "central noise: the server is trusted with the clipped updates; distributed noise "
    "(--secagg-updates): the key holder does not collude with the server",
    "noise drawn from OS entropy (no --insecure-seeded-noise)",
]


def floating_keys(state: State) -> list[str]:
    """The entries an update carries: every floating-point tensor (integer buffers such as
    BatchNorm's counters are not averaged under DP and keep the global value)."""
    return [k for k, v in state.items() if v.is_floating_point()]


def model_delta(state: State, reference: State) -> State:
    """``state - reference`` on the floating entries, in float64."""
    return {k: state[k].detach().to(torch.float64) - reference[k].detach().to(torch.float64)
            .to(state[k].device) for k in floating_keys(reference)}


def update_norm(delta: State) -> float:
    """The L2 norm of the whole update (every entry flattened into one vector)."""
    return math.sqrt(sum(float(v.double().pow(2).sum()) for v in delta.values()))


def vector_norm(delta: Tensor) -> float:
    """The L2 norm of a flat float64 update. Its square cannot overflow (a float32 entry's
    square is below 1e78), so it is finite exactly when every entry is."""
    return float(torch.linalg.vector_norm(delta))


def clip_factor(norm: float, clip: float) -> float:
    """``min(1, S / ||delta||)``: the factor that scales an update of norm ``norm`` into the
    ball of radius ``clip`` (1 for an update already inside)."""
    if not (math.isfinite(clip) and clip > 0):
        raise UsageError(f"update clip must be a finite number > 0, got {clip}")
    return 1.0 if norm <= clip else clip / norm


def clip_update(delta: State, clip: float) -> State:
    """``delta * min(1, S / ||delta||)``: the whole update scaled into the ball of radius
    ``clip``; an update already inside comes back unchanged."""
    factor = clip_factor(update_norm(delta), clip)
    if factor == 1.0:
        return dict(delta)
    return {k: v * factor for k, v in delta.items()}


def gaussian_vector(n: int, std: float, generator: torch.Generator) -> Tensor:
    """``n`` independent ``N(0, std^2)`` draws in float64, on the generator's device."""
    return torch.randn(n, generator=generator, dtype=torch.float64,
                       device=generator.device).mul_(std)


def gaussian_noise(like: State, std: float, generator: torch.Generator) -> State:
    """Independent ``N(0, std^2)`` for every coordinate of ``like`` (float64): one
    ``gaussian_vector`` split into ``like``'s entries in their order, so a flat update of
    the same layout gets the same draws from the same generator."""
    sizes = [v.numel() for v in like.values()]
    flat = gaussian_vector(sum(sizes), std, generator)
    return {k: piece.view(v.shape).to(v.device)
            for (k, v), piece in zip(like.items(), flat.split(sizes), strict=True)}


class UpdateLayout:
    """Where each floating entry of a model state sits in one flat float64 vector (the
    entries in the reference state's order), and the way back to entries."""

    def __init__(self, reference: State) -> None:
        self.keys = floating_keys(reference)
        self.shapes = [reference[k].shape for k in self.keys]
        self.sizes = [reference[k].numel() for k in self.keys]
        self.dtypes = [reference[k].dtype for k in self.keys]
        self.device = reference[self.keys[0]].device if self.keys else torch.device("cpu")
        self.numel = sum(self.sizes)

    def flatten(self, state: State, out: Tensor | None = None) -> Tensor:
        """``state``'s entries end to end in float64 (written into ``out`` when given)."""
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float64, device=self.device)
        for piece, key, shape in zip(out.split(self.sizes), self.keys, self.shapes,
                                     strict=True):
            piece.view(shape).copy_(state[key].detach())
        return out

    def unflatten(self, flat: Tensor, cast: bool = False) -> State:
        """The entries of ``flat``: views of it, or (``cast``) copies in each entry's own
        dtype that no later change of ``flat`` reaches."""
        return {key: (piece.view(shape).to(dtype, copy=True) if cast else piece.view(shape))
                for piece, key, shape, dtype in zip(flat.split(self.sizes), self.keys,
                                                    self.shapes, self.dtypes, strict=True)}


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
    adaptive: AdaptiveClip | None = None  # --dp-adaptive-clip: ``clip`` moves every round
    #: each party's journal of its releases (privacy/release_journal.py): a round redone
    #: after a stop re-sends the noised updates, sums and counts it sent, never fresh draws
    journal: ReleaseJournal | None = None
    label = USER_DP_RELEASE
    name = "dp-fedavg"
    takes = True
    top_level_key = "user_dp"

    @classmethod
    def of(cls, p: UserDPPlan, dp: DPAccounting | None) -> UserDP:
        """DP-FedAvg of plan ``p`` (the planner's ``user_dp_plan``), charged to ``dp``."""
        assert dp is not None, "DP-FedAvg is planned with a noise plan"
        return cls(dp, p.clip, denominator=p.denominator, distributed=p.distributed,
                   seed=p.seed, seeded=p.seeded,
                   adaptive=None if p.adaptive_quantile is None
                   else AdaptiveClip(p.adaptive_quantile))

    def __post_init__(self) -> None:
        self.initial_clip = self.clip
        if self.adaptive is not None and self.distributed:
            raise SettingError("{dp_adaptive_clip} runs with central noise only: under "
                             "{secagg_updates} its count would leave the ciphertexts")
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

    @property
    def count_std(self) -> float | None:
        """Std of the noise on the count of updates within the clip (adaptive clip only)."""
        if self.adaptive is None:
            return None
        return count_noise_std(self.noise_multiplier, self.denominator)

    @property
    def update_multiplier(self) -> float:
        """The updates' own multiplier: ``z``, or more where the count shares the round."""
        count = self.count_std
        return self.noise_multiplier if count is None else update_multiplier(
            self.noise_multiplier, count)

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

    def receive(self, rnd: UpdateRound, average: Callable[..., State] | None
                ) -> tuple[list, State, int, list]:
        return self.receive_round(rnd.trainer, rnd.jobs, rnd.global_state, rnd.selected,
                                  rnd.round_, rnd.transcript, rnd.recipe, average)

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
        """Server side, adaptive clip: the count noised, the clip moved for the next round."""
        if self.adaptive is None:
            return
        std = self.count_std
        assert std is not None  # adaptive
        g = noise_generator(self.seed, round_, -1, 303, seeded=self.seeded)
        count = within + std * torch.randn((1,), generator=g, dtype=torch.float64)
        noisy = float(self.released(round_, f"{self.label}/count", SERVER, count))
        self.clip = self.adaptive.next_clip(self.clip, noisy / self.denominator)

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
        g = noise_generator(self.seed, round_, -1, 302, seeded=self.seeded)
        total.add_(gaussian_vector(total.numel(), self.std, g).to(total.device))
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
        """The new global state: ``global + total / m`` in float64 (``base``: the global
        state flattened by ``layout``; integer buffers: the global ones). BatchNorm running
        variances are clamped at 0 after the noise (post-processing: the guarantee is
        unchanged, and a negative variance would make evaluation NaN)."""
        new = total.div(self.denominator).add_(base)
        out = dict(global_state)
        for k, v in layout.unflatten(new).items():
            if k.endswith("running_var"):
                v = v.clamp_min(0.0)
            out[k] = v.to(global_state[k].dtype, copy=True)
        return out

    def receive_round(self, trainer: Any, jobs: list, global_state: State,
                      selected: list[int], round_: int, transcript: Transcript,
                      recipe: dict[str, Any], secure_average: Callable[..., State] | None
                      ) -> tuple[list, State, int, list]:
        """One round under DP-FedAvg: returns (results, new global state, bytes uploaded,
        results for the divergence check). No training loss leaves a client (it is
        data-dependent); a non-finite local model is reported by the divergence check and
        not summed. ``secure_average`` is the updates' wire's average
        (``Uplink.average_updates``) under --secagg-updates, else None."""
        self.admit_round(selected)
        layout = UpdateLayout(global_state)
        # float64, as every update below
        uploads = _RoundUploads(self, layout, layout.flatten(global_state), selected, round_)
        if secure_average is None:
            results, new = self._sum_in_clear(trainer, jobs, global_state, uploads,
                                              transcript, recipe)
        else:
            results, new = self._sum_securely(trainer, jobs, global_state, uploads,
                                              transcript, secure_average)
        self.charge_round(selected)
        self.adapt(uploads.within, round_)
        results = [r._replace(loss=None) for r in results]
        checked = [r._replace(state=m) for r, m in zip(results, uploads.markers, strict=True)]
        return results, new, uploads.sent_bytes, checked

    def _sum_in_clear(self, trainer: Any, jobs: list, global_state: State,
                      uploads: _RoundUploads, transcript: Transcript,
                      recipe: dict[str, Any]) -> tuple[list, State]:
        """Each clipped update summed as it arrives (one client's at a time in memory),
        the server's noise added to the sum: (results, new global state)."""
        layout, base, selected, round_ = (uploads.layout, uploads.base, uploads.selected,
                                          uploads.round_)
        total = torch.zeros_like(base)  # the sum of the clipped updates
        work = torch.empty_like(base)  # one client's update at a time
        seen_flat = torch.empty_like(base)
        summed = 0

        def consume(state: State) -> None:
            nonlocal summed
            delta = uploads.take(state, work)
            if delta is None:
                return
            # what the server receives: the global state moved by the clipped update
            # (integer buffers are not sent: the global ones, for a complete state)
            seen = {**global_state,
                    **layout.unflatten(torch.add(base, delta, out=seen_flat), cast=True)}
            record_model_updates(transcript, round_, [selected[len(uploads.markers) - 1]],
                                 [seen], [1.0], recipe)
            total.add_(delta)
            summed += 1

        results = trainer.train(global_state, jobs, round_, consume=consume)
        if not summed:
            return results, dict(global_state)
        self.add_server_noise(total, round_)
        return results, self.apply(global_state, layout, base, total)

    def _sum_securely(self, trainer: Any, jobs: list, global_state: State,
                      uploads: _RoundUploads, transcript: Transcript,
                      secure_average: Callable[..., State]) -> tuple[list, State]:
        """--secagg-updates: every clipped update (noise share included) through the
        uplink's CKKS average, which the server sees only summed: (results, new state). A
        sum holds whole cohorts only, so a cohort left out (an upload rejected) leaves fewer
        contributors than uploads, and a withheld sum (the whole-run check) none: the global
        state then stays."""
        layout, base, selected, round_ = (uploads.layout, uploads.base, uploads.selected,
                                          uploads.round_)
        results = trainer.train(global_state, jobs, round_)
        deltas = [uploads.take(r.state, None) for r in results]
        if any(d is None for d in deltas):  # the divergence check stops the run
            return results, dict(global_state)
        sent = [layout.unflatten(base + d, cast=True) for d in deltas]  # type: ignore[operator]
        before = len(transcript.entries)
        avg = secure_average(global_state, sent, [1.0] * len(sent), selected,
                             round_=round_, transcript=transcript)
        summed = [int(e["clients"]) for e in transcript.entries[before:]
                  if e["view"] == "aggregate" and e["label"] == UPDATE_RELEASE]
        if not summed:  # withheld or skipped: nothing was released this round
            return results, dict(global_state)
        # the secure average divides by the uploads summed (its contributors); DP-FedAvg by m
        total = layout.flatten(avg).sub_(base).mul_(summed[-1])
        return results, self.apply(global_state, layout, base, total)

    def state_dict(self) -> dict[str, Any]:
        return {"clip": self.clip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        clip = float(state.get("clip", self.clip))
        if not (math.isfinite(clip) and clip > 0):
            raise UsageError(f"a checkpoint's update clip must be > 0, got {clip}")
        self.clip = clip

    # ---- report ----------------------------------------------------------------------------
    def user_epsilon(self) -> float:
        """The largest epsilon any client has spent on its model updates alone (user level).
        Clients with the same history of releases have the same epsilon: it is computed
        once per distinct history (thousands of clients share a few)."""
        worst = 0.0
        known: dict[tuple, float] = {}
        for client, acc in self.dp.per_client.items():
            if client < 0:
                continue
            history = tuple((z, q, t) for z, q, t, lab in acc.state_dict()["history"]
                            if lab == self.label)
            if history:
                key = (acc.kind, acc.delta, history)
                if key not in known:
                    known[key] = compute_epsilon(list(history), acc.kind, acc.delta)
                worst = max(worst, known[key])
        return worst

    def summary(self) -> dict[str, Any]:
        eps = self.user_epsilon()
        where = ("distributed: each of the round's n clients adds 1/(n-1) of the variance before CKKS "
                 "encryption, the server sees only the noisy sum" if self.distributed else
                 "central: the server adds it to the sum of the clipped updates it received")
        against = ("every party but a key holder colluding with the server" if self.distributed
                   else "anyone who sees the global models, NOT the server (it receives each "
                   "clipped update: add --secagg-updates to hide them)")
        clip = (f"update clip {self.clip:g}" if self.adaptive is None else
                f"adaptive update clip ({self.initial_clip:g} -> {self.clip:.4g}, quantile "
                f"{self.adaptive.quantile:g})")
        statement = (f"model updates: ({eps:.3f}, {self.dp.delta:.2g})-DP at user level "
                     f"(one client's whole data) for the worst-off client, DP-FedAvg with "
                     f"{clip}, noise multiplier "
                     f"{self.noise_multiplier:.4g}, {where}; holds against {against}; no "
                     "amplification by client sampling")
        return {"statement": statement, "user_dp": {"epsilon_spent": eps, "delta": self.dp.delta,
                            "noise_multiplier": self.noise_multiplier,
                            "update_clip": self.clip, "noise_std_of_sum": self.std,
                            "denominator": self.denominator, "sample_rate": 1.0,
                            "noise": "distributed" if self.distributed else "central",
                            "adaptive_clip": None if self.adaptive is None else {
                                "quantile": self.adaptive.quantile, "lr": self.adaptive.lr,
                                "initial_clip": self.initial_clip,
                                "count_noise_std": self.count_std,
                                "update_noise_multiplier": self.update_multiplier},
                            "assumptions": USER_DP_ASSUMPTIONS, "statement": statement}}


@dataclass
class _RoundUploads:
    """One round's DP-FedAvg uploads as they arrive: each client's update clipped (and its
    noise share added) against ``base``, the flat global state; what the round reports
    (the divergence check's markers, the bytes sent, the clients within the clip)."""

    dp: UserDP
    layout: UpdateLayout
    base: Tensor
    selected: list[int]
    round_: int
    markers: list[State] = field(default_factory=list)
    sent_bytes: int = 0
    within: int = 0

    def take(self, state: State, out: Tensor | None) -> Tensor | None:
        """The client's clipped update (noise share included) as a flat float64 vector,
        or None for a non-finite local model (then its marker names the entry)."""
        i = len(self.markers)
        self.sent_bytes += sum(v.numel() * v.element_size() for v in state.values())
        delta = self.layout.flatten(state, out).sub_(self.base)
        norm = vector_norm(delta)
        bad = None if math.isfinite(norm) else nonfinite_key(state)
        self.markers.append({} if bad is None else {bad: torch.tensor(float("nan"))})
        if bad is not None:
            return None
        client = self.selected[i]
        self.within += int(self.dp.clip_and_share(delta, norm, self.round_, client,
                                                  len(self.selected)))
        if self.dp.distributed:  # its noise share drawn: what it sends, once
            delta.copy_(self.dp.released(self.round_, self.dp.label, client, delta))
        return delta


__all__ = ["DEFAULT_UPDATE_CLIP", "USER_DP_ASSUMPTIONS", "UpdateLayout", "UserDP",
           "clip_factor", "clip_update", "distributed_share", "gaussian_noise",
           "gaussian_vector", "model_delta", "release_plan", "update_norm", "vector_norm"]
