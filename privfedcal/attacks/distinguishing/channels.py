"""The channels of docs/threat-model.md as distinguishing games (``attacks/distinguishing/games.py``).

For a run configuration, one ``Channel`` per charged release the configuration makes:

* ``ccvr-stats`` (CCVR's class statistics, one release): D is client 0's features under the
  configured model, D' adds one canary feature ``16 R e_0`` of the client's rarest class, so
  that clipping to R is what keeps it at the sensitivity (count 1, sum R, outer R^2);
* ``creff-grad`` (CReFF's class gradients, one release per round the client takes part in,
  composed, the model held fixed): the same canary feature, whose head gradient is far
  above G before clipping, of a class the client holds fewest of (a new class moves
  ``count`` or ``holders`` too);
* ``dp-sgd`` (the model update of one round of ``--dp-train``): D is client 0's data, D'
  adds a mislabelled outlier (its largest input scaled by 10); the view is everything the
  client sends after training (the state, and the loss where one is sent).

The releases are the real code: ``StatsTask``/``GradTask.compute`` with the run's bound and
``NoiseStage.client`` with the run's planned noise for the payloads (many trials as one
batched payload), ``train_client`` with the run's DP-SGD spec for the updates. The feature
canaries go through the payload task on features directly (an identity feature map): the
guarantee is stated for any feature vector, so the worst one is the fair canary. A payload
view keeps only the coordinates the canary can move (its class; feature 0 of the CCVR
statistics; columns 0 and bias of CReFF's gradients): the other coordinates carry independent noise with weight zero in the
projection score, so the score's distribution is the same and the draw is far cheaper.

``Faults`` breaks a release on purpose (noise scaled, clipping off, a key sent in the clear);
only the tests of the audit pass them, to show that the audit catches each.

A calibration release's channel is built from its declaration (``ReleaseSpec``: label,
payload keys, participants) and from its attack's file (``stats_attack.py``,
``gradients_attack.py``: the client task with the run's options, what it clips, the entries
a canary moves); nothing here names a calibration release.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from privfedcal.attacks.distinguishing.games import Channel, Stats, Views
from privfedcal.attacks.release_attacks import attacks_on, declared_releases
from privfedcal.errors import UsageError
from privfedcal.privacy.bound import NoBound
from privfedcal.privacy.quantile import QUANTILE_RELEASE
from privfedcal.privacy.releases import DPSGD_RELEASE, USER_DP_RELEASE
from privfedcal.privacy.stages import BoundStage, NoiseStage, Release, symmetrise
from privfedcal.settings.messages import SettingError


def channel_fields() -> dict[str, tuple[str, ...]]:
    """Each channel's name -> the client fields (privacy/client_fields.py) its view carries:
    every attacked calibration release's payload keys (its declaration, read when asked,
    so a calibrator registered later has its channel), then DP-SGD's model update and loss,
    DP-FedAvg's update and the Flower plugin's clip search."""
    return {
        **{r.label: tuple(f"query.payload/payload/{k}" for k in r.keys)
           for r in declared_releases() if attacks_on(r.label)},
        DPSGD_RELEASE: ("train/local/*", "train/metrics/train-loss"),
        USER_DP_RELEASE: ("train/local/*",),  # --dp-updates (user_dp_channel.py)
        # the Flower plugin's dp-clip = "auto" search (clip_channel.py)
        QUANTILE_RELEASE: ("query.clip/histogram/counts",),
    }


def __getattr__(name: str) -> object:
    """``CHANNEL_FIELDS`` (``channel_fields()``) and ``CHANNELS`` (its names, in order),
    read from the registries when asked (PEP 562)."""
    if name == "CHANNEL_FIELDS":
        return channel_fields()
    if name == "CHANNELS":
        return tuple(channel_fields())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: the canary feature's norm in units of the clip bound: far outside the ball, so that
#: clipping is what keeps it at the sensitivity (CReFF's head gradient of a feature of norm
#: a is about 0.9 a, and with the per-class cap moves the release by half of it: at 4 x G,
#: clipping off moved CReFF's release too little to be caught with 100,000 trials)
CANARY_SCALE = 16.0


@dataclass(frozen=True)
class Faults:
    """A broken release, for the audit's own tests: noise scaled by ``noise_scale``,
    per-sample clipping off, or payload key ``clear_key`` sent without noise."""

    noise_scale: float = 1.0
    clip: bool = True
    clear_key: str | None = None


class FeatureMap(torch.nn.Module):
    """The identity feature map: the payload task's input rows are the features."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.feature_dim = dim

    def features(self, x: Tensor) -> Tensor:
        return x


class Unclipped(NoBound):
    """Clipping off (a fault): rows pass unchanged, and ``assumed`` keeps the bound the
    sensitivities assume, so that the canary is sized as in the correct run."""

    def __init__(self, assumed) -> None:
        self.assumed = assumed


def parse_channels(text: str | None) -> tuple[str, ...] | None:
    """``--channels a,b`` (None: every channel the configuration has)."""
    if text is None:
        return None
    out = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    names = tuple(channel_fields())
    bad = [c for c in out if c not in names]
    if bad or not out:
        raise SettingError("{channels} takes names among {names}, got {got!r}",
                           names=", ".join(names), got=text)
    return out


def run_parts(cfg, faults: Faults = Faults()):
    """(experiment, calibrator, noise stage or None, bound, planned noise stage) of ``cfg``,
    the noise and bound broken as ``faults`` says; the plan stays the correct run's."""
    from privfedcal.experiment import build_parts

    exp, calibrator, uplink = build_parts(cfg)
    noise = next((s for s in uplink.stages if isinstance(s, NoiseStage)), None)
    plan = noise  # the claims are those of the correct run, whatever the faults
    bound = next((s.bound for s in uplink.stages if isinstance(s, BoundStage)), NoBound())
    if noise is not None and faults.noise_scale != 1.0:
        dp = dataclasses.replace(noise.dp, sigmas={k: v * faults.noise_scale
                                                   for k, v in noise.dp.sigmas.items()})
        noise = dataclasses.replace(noise, dp=dp)
    if not faults.clip:
        bound = Unclipped(bound)
    return exp, calibrator, noise, bound, plan


def build_channels(cfg, names: tuple[str, ...] | None = None, faults: Faults = Faults(),
                   ) -> list[Channel]:
    """The channels of ``cfg`` (a ``RunConfig``) in the order of ``CHANNELS``: the
    calibrator's releases, DP-SGD with ``--dp-train``, DP-FedAvg with ``--dp-updates``, and,
    when ``names`` asks for it, the Flower plugin's clip search planned for this budget."""
    from privfedcal.experiment import config_of

    exp, calibrator, noise, bound, plan = run_parts(cfg, faults)
    cfg = config_of(exp)  # resolved
    labels = [r.label for r in calibrator.releases]
    labels += [DPSGD_RELEASE] if cfg.privacy.dp_train else []
    labels += [USER_DP_RELEASE] if cfg.privacy.dp_updates else []
    # the plugin's clip search for this budget and these releases: only when asked, since
    # privfedcal train itself does not run it
    if names is not None and QUANTILE_RELEASE in names and plan is not None \
            and calibrator.releases:
        labels.append(QUANTILE_RELEASE)
    wanted = [c for c in channel_fields() if c in labels and (names is None or c in names)]
    missing = [n for n in (names or ()) if n not in labels]
    if missing:
        raise UsageError(f"this configuration releases no {', '.join(missing)} (it has: "
                         f"{', '.join(labels) or 'no charged channel'})")
    if not wanted:
        raise SettingError("this configuration has no channel to audit: give a calibrator "
                         "({method} ccvr/creff), {dp_train} or {dp_updates}")
    specs = {r.label: r for r in calibrator.releases}

    def build(c: str) -> Channel:
        if c == DPSGD_RELEASE:
            return _dpsgd(cfg, exp, calibrator, noise, bound, faults, plan)
        if c == USER_DP_RELEASE:
            from privfedcal.attacks.distinguishing.user_dp_channel import user_dp_channel

            return user_dp_channel(cfg, noise, faults, claimed(plan, USER_DP_RELEASE, 1),
                                   CANARY_SCALE)
        if c == QUANTILE_RELEASE:
            from privfedcal.attacks.distinguishing.clip_channel import clip_channel

            return clip_channel(cfg, calibrator, plan, faults.noise_scale)
        return _release(specs[c], cfg, exp, calibrator, noise, bound, faults, plan)

    return [build(c) for c in wanted]


def claimed(plan, label: str, steps: int, sample_rate: float = 1.0) -> tuple[float, float]:
    """(epsilon, delta) the run's accountant charges for ``steps`` releases of ``label``
    alone at its planned noise (``plan``: the run's noise stage); (inf, 0) without DP."""
    if plan is None:
        return math.inf, 0.0
    from privfedcal.privacy.accounting import compute_epsilon

    dp = plan.dp
    return (compute_epsilon([(dp.sigmas[label], sample_rate, steps)], dp.accountant.kind,
                            dp.delta), dp.delta)


def client_features(exp, client: int = 0) -> tuple[Tensor, Tensor]:
    from privfedcal.calibration.ccvr import extract_features

    idx = exp.parts[client]
    x, y = exp.data.x_train[idx], exp.data.y_train[idx]
    exp.model.eval()
    return extract_features(exp.model, x, 1024).double().cpu(), y.cpu()


def _payload_channel(name, task, cfg, exp, noise, bound, faults, keep, steps, canary_text,
                     claim, clip) -> Channel:
    """A batched payload release: the task's payload of D or D' (features + canary row),
    restricted to ``keep(key, class)`` (an index), noised by the run's noise stage, ``steps``
    independent releases stacked on dimension 1."""
    z, y = client_features(exp)
    counts = torch.bincount(y, minlength=exp.data.num_classes)
    c = int(torch.argmin(counts))                       # the rarest class (absent if any)
    canary = torch.zeros(1, z.shape[1], dtype=z.dtype)
    canary[0, 0] = CANARY_SCALE * canary_scale(bound, clip)
    model = FeatureMap(z.shape[1])
    clean = [task.compute(model, z, y, bound),
             task.compute(model, torch.cat([z, canary]), torch.cat([y, torch.tensor([c])]),
                          bound)]
    clean = [{k: v[keep(k, c)].to(torch.float64) for k, v in p.items()} for p in clean]
    release = noiser(noise, name, faults)

    def draw(n: int, with_canary: bool) -> Views:
        base = clean[int(with_canary)]
        out = release({k: v.expand(n * steps, *v.shape).clone() for k, v in base.items()})
        return {k: v.reshape(n, steps, *base[k].shape) for k, v in out.items()}

    def stacked(p: Views) -> Views:
        return {k: v.unsqueeze(0).expand(steps, *v.shape) for k, v in p.items()}

    eps, delta = claim
    return Channel(name, channel_fields()[name], eps, delta, canary_text(c), draw,
                   reference=(stacked(clean[0]), stacked(clean[1])),
                   chunk=max(64, min(1 << 16, (1 << 23) // max(1, steps * sum(
                       v.numel() for v in clean[0].values())))))


def noiser(noise, label: str, faults: Faults = Faults()):
    """The server's view of a (batched) payload of release ``label``: the run's noise stage
    (client half, fresh OS-entropy noise per call), or the payload itself without DP. With
    ``--secagg`` the server sees the sum, which carries at least the full variance: one
    client's payload gets the full variance."""
    rel = Release(label, 1, [0], [0], {}, None, None, client=0)  # type: ignore[arg-type]

    def release(payload: Views) -> Views:
        if noise is None:
            out = payload
        elif noise.dp.distributed:
            from privfedcal.privacy.noise import noise_generator

            out = symmetrise(noise.dp.noise(payload, label, noise_generator(), 1.0),
                             noise.dp.symmetric(label))
        else:
            out = noise.client(payload, rel)
        if faults.clear_key is not None:
            out = {**out, faults.clear_key: payload[faults.clear_key]}
        return out

    return release


def canary_scale(bound, clip: str) -> float:
    """The canary feature's unit: the clip bound of what the release's task clips (``clip``,
    its attack's declaration: features for CCVR; for CReFF the gradient bound, since
    ||g|| ~ ||z|| for a large feature)."""
    bound = getattr(bound, "assumed", bound)
    if hasattr(bound, "bound_for"):
        return bound.bound_for(clip)
    return 10.0  # a run without any bound: any large feature


def _release(spec, cfg, exp, calibrator, noise, bound, faults, plan) -> Channel:
    """The channel of a calibration release: its attack's client task with the run's
    options and the entries a canary moves (``release_attacks.ReleaseAttack``); released
    once, or in every round the most selected client takes part in."""
    from privfedcal.privacy.planner import participation_counts

    attack = next((a for a in attacks_on(spec.label)
                   if a.task is not None and a.keep is not None), None)
    if attack is None or attack.task is None or attack.keep is None:
        raise UsageError(f"the attack on {spec.label!r} declares no audit channel")
    steps = 1 if spec.participants == "all" else max(participation_counts(
        exp.privacy, calibrator.release_rounds(exp.privacy, spec)).values(),
        default=0)  # as the planner counts them
    rounds = "" if spec.participants == "all" else f", in each of {steps} rounds"
    return _payload_channel(
        spec.label, attack.task(cfg, exp, calibrator), cfg, exp, noise, bound, faults,
        attack.keep, steps,
        lambda c: f"one feature {CANARY_SCALE:g} x clip on axis 0, class {c}{rounds}",
        claimed(plan, spec.label, steps), attack.clip)


def _dpsgd(cfg, exp, calibrator, noise, bound, faults, plan) -> Channel:
    from privfedcal.federation.local import clone_state, train_client

    spec = exp.spec
    dp = spec.dp_sgd
    if not faults.clip:  # clipping off, the noise's std (z times the bound) unchanged
        dp = dataclasses.replace(dp, max_grad_norm=1e9,
                                 noise_multiplier=dp.noise_multiplier * dp.max_grad_norm / 1e9)
    if faults.noise_scale != 1.0:  # the noise stage's sigmas are already scaled
        dp = dataclasses.replace(dp, noise_multiplier=dp.noise_multiplier * faults.noise_scale)
    spec = dataclasses.replace(spec, dp_sgd=dp, data=dataclasses.replace(spec.data, augment=False))
    idx = exp.parts[0]
    x, y = exp.data.x_train, exp.data.y_train
    model, start = exp.model, clone_state(exp.model)
    # the canary: the client's largest input, scaled by 10 and given another label
    i = int(idx[torch.argmax(x[idx].flatten(1).norm(dim=1))])
    x = torch.cat([x, 10 * x[i:i + 1]])
    y = torch.cat([y, (y[i:i + 1] + 1) % exp.data.num_classes])
    sides = (idx, torch.cat([idx, torch.tensor([len(x) - 1], device=idx.device)]))
    names = list(start)
    flat0 = torch.cat([start[k].flatten().double() for k in names])
    direction = _canary_direction(model, start, x[-1:], y[-1:], names)

    def draw(n: int, with_canary: bool) -> Views:
        ups, losses = [], []
        for t in range(n):
            r = train_client(model, exp.algo, start, None, x, y, sides[int(with_canary)],
                             spec, 1, t)
            ups.append(torch.cat([r.state[k].flatten().double() for k in names]) - flat0)
            losses.append(math.nan if r.loss is None else float(r.loss))
        return {"update": torch.stack(ups), "loss": torch.tensor(losses, dtype=torch.float64)}

    def reduce(v: Views) -> Stats:
        up = v["update"]
        out = {"canary-projection": (-(up @ direction)).numpy(),
               "update-norm": up.norm(dim=1).numpy()}
        loss = v["loss"].numpy()
        if not np.isnan(loss).all():  # a loss reached the server
            out["train-loss"] = loss
        return out

    # the accountant's plan of one round of DP-SGD: its sample rate and steps per round
    rate = next(p["sample_rate"] for p in plan.dp.planned if p["name"] == DPSGD_RELEASE)
    eps, delta = claimed(plan, DPSGD_RELEASE, plan.dp.steps[DPSGD_RELEASE], rate)
    return Channel(DPSGD_RELEASE, channel_fields()[DPSGD_RELEASE], eps, delta,
                   "one mislabelled example, the client's largest input x 10, one round",
                   draw, reduce=reduce, chunk=16)


def _canary_direction(model, start, x: Tensor, y: Tensor, names: list[str]) -> Tensor:
    """The unit direction, over the state's entries, of the canary's loss gradient at the
    start state (training on the canary moves the update against it); buffers get 0."""
    model.load_state_dict(start)
    params = dict(model.named_parameters())
    loss = torch.nn.functional.cross_entropy(model(x), y)
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
    flat = torch.cat([grads[k].flatten().double() if k in grads else
                      torch.zeros(start[k].numel(), dtype=torch.float64) for k in names])
    return flat / flat.norm().clamp_min(1e-30)


__all__ = ["CANARY_SCALE", "channel_fields", "FeatureMap", "Faults", "Unclipped",
           "build_channels", "canary_scale", "claimed", "client_features", "noiser",
           "parse_channels", "run_parts"]
