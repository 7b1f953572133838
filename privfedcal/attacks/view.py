"""A finished run as an attacker sees it: the model it sent and the transcript it recorded.

``load_run`` reads the server's view only (``RUN/server/``: the public ``config.json``, the
transcript, ``summary.json``) and rebuilds from it the server's experiment (the model
object and the public test set; no training samples, no partition). The clients' data is
the experimenter's: when the attacked folder is a whole run folder, its top-level
``config.json`` (with the data seed) rebuilds it into ``RunView.truth_exp``, used only to
SCORE reconstructions and for the hypothetical baselines no server sees. A copy of
``server/`` alone is attacked unscored.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from privfedcal.calibration.transforms import relu_tukey
from privfedcal.errors import UsageError
from privfedcal.models.feature_classifier import FeatureClassifier
from privfedcal.privacy.transcript import TASK_PREFIX


@dataclass(frozen=True, eq=False)
class Release:
    """One calibration release as the server saw it."""

    round: int
    label: str
    state: dict[str, Tensor] | None
    uploads: dict[int, dict[str, Tensor]]
    aggregate: dict[str, Tensor] | None
    ciphertext_bytes: dict[int, int]
    #: public tensors the server sent with the release besides the model (CReFF: the head
    #: ``head.weight`` / ``head.bias`` the clients differentiated); empty in older runs
    task: dict[str, Tensor] = field(default_factory=dict)

    @property
    def sent_state(self) -> dict[str, Tensor]:
        """The model state the server sent with the release (``RunView.release`` returns
        only releases that sent one)."""
        if self.state is None:
            raise UsageError(f"the {self.label!r} release of round {self.round} sent no "
                             "model state")
        return self.state


class UploadedFeatures(FeatureClassifier):
    """The features a CCVR client summed: ``clip_R(relu_tukey(f(x)))`` when the run applied
    the Tukey transform / a DP clip bound, else ``f(x)``; the attack inverts through this."""

    def __init__(self, model: FeatureClassifier, tukey_lambda: float | None,
                 clip: float | None) -> None:
        super().__init__()
        self.inner, self.tukey_lambda, self.clip = model, tukey_lambda, clip
        self.feature_dim, self.num_classes = model.feature_dim, model.num_classes
        self.classifier = model.classifier

    def features(self, x: Tensor) -> Tensor:
        z = self.inner.features(x)
        if self.tukey_lambda is not None:
            z = relu_tukey(z, self.tukey_lambda)
        if self.clip is not None:
            norm = z.norm(dim=-1, keepdim=True)
            z = z * torch.clamp(self.clip / norm.clamp_min(1e-30), max=1.0)
        return z


@dataclass(eq=False)
class RunView:
    """A finished run rebuilt for attacking: the public config, summary and transcript of
    the server's view, the server's experiment (``exp``: model and test set, no partition)
    and, when the experimenter's side is at hand, ``truth_exp`` (the clients' data, to
    score with; None: unscored)."""

    run_dir: Path
    cfg: Any  # RunConfig, public (no data seed)
    summary: dict[str, Any]
    exp: Any  # federation.setup.Experiment of the server
    entries: list[dict[str, Any]]
    truth_exp: Any = None  # federation.setup.Experiment of the experimenter, or None

    @property
    def scored(self) -> bool:
        return self.truth_exp is not None

    @property
    def model(self):  # noqa: ANN201 - FeatureClassifier
        return self.exp.model

    def load_state(self, state: dict[str, Tensor]) -> None:
        self.model.load_state_dict({k: v.to(self.exp.device) for k, v in state.items()})
        self.model.eval()

    def client_indices(self, client: int) -> Tensor | None:
        """The client's training indices (experimenter's side; None when unscored)."""
        return None if self.truth_exp is None else self.truth_exp.parts[client]

    def truth(self, client: int | None, cls: int) -> Tensor | None:
        """Global training indices of class ``cls`` held by ``client`` (None: by anyone);
        None when the experimenter's side is not at hand."""
        if self.truth_exp is None:
            return None
        parts = self.truth_exp.parts
        idx = torch.cat(parts) if client is None else parts[client]
        return idx[self.truth_exp.data.y_train[idx] == cls]

    def pixels(self, idx: Tensor) -> Tensor:
        d = self.truth_exp.data
        return d.denormalize(d.x_train[idx]).clamp(0, 1).cpu()

    def prior(self, labels: Tensor) -> Tensor:
        """Test-set mean image of each label: a guess needing no client data."""
        d = self.exp.data
        means = torch.stack([d.x_test[d.y_test == c].mean(0) if bool((d.y_test == c).any())
                             else torch.zeros_like(d.x_test[0]) for c in range(d.num_classes)])
        return d.denormalize(means).clamp(0, 1).cpu()[labels.cpu()]

    def noise_stds(self, label: str, keys: Sequence[str]) -> dict[str, float]:
        """Per-key std of the DP noise on a release (0 without DP): the noise multiplier and
        clips from summary.json, the sensitivities and budget split from the release's
        declaration (``ReleaseSpec``), as the run's noise stage drew it."""
        from privfedcal.privacy.dp import noise_stds

        p = self.summary.get("privacy", {})
        z = p.get("noise_multipliers", {}).get(label)
        if z is None:
            return dict.fromkeys(keys, 0.0)
        spec = release_spec(label)
        sens = spec.sensitivities(keys, clip=p["feature_clip"], grad_clip=p["grad_clip"])
        return noise_stds(sens, float(z), budget=spec.budget())

    def releases(self, label: str) -> list[Release]:
        groups: dict[int, dict[str, Any]] = {}
        for e in self.entries:
            if e["label"] != label:
                continue
            g = groups.setdefault(e["round"], {"state": None, "uploads": {}, "agg": None, "ct": {}})
            if e["view"] == "model-state":
                sent = e.get("tensors")
                g["state"] = None if sent is None else {
                    k: v for k, v in sent.items() if not k.startswith(TASK_PREFIX)}
                g["task"] = {} if sent is None else {
                    k[len(TASK_PREFIX):]: v for k, v in sent.items() if k.startswith(TASK_PREFIX)}
            elif e["view"] == "plain-upload":
                g["uploads"][int(e["client"])] = e["tensors"]
            elif e["view"] == "aggregate":
                g["agg"] = e["tensors"]
            elif e["view"] == "ciphertext":
                g["ct"][int(e["client"])] = int(e.get("bytes", 0))
        return [Release(r, label, g["state"], g["uploads"], g["agg"], g["ct"], g.get("task", {}))
                for r, g in sorted(groups.items())]

    def release(self, label: str, round_: int | None) -> Release:
        made = [r for r in self.releases(label) if r.state is not None]
        if not made:
            kinds = sorted({e["label"] for e in self.entries}) or ["none"]
            raise UsageError(f"the transcript of {self.run_dir} holds no {label!r} release "
                             f"(it has: {', '.join(kinds)})")
        rels = [r for r in made if r.uploads or r.aggregate is not None]
        if not rels:
            raise UsageError(f"every {label!r} release of {self.run_dir} was skipped (see "
                             "skipped_releases in summary.json): nothing reached the server")
        if round_ is None:
            return rels[-1]
        for r in rels:
            if r.round == round_:
                return r
        raise UsageError(f"no {label!r} release in round {round_}; rounds: "
                         f"{', '.join(str(r.round) for r in rels)}")


def release_spec(label: str) -> Any:
    """The declaration (``ReleaseSpec``) of release ``label`` by a registered calibrator;
    an undeclared label raises (its noise cannot be modelled)."""
    from privfedcal.attacks.release_attacks import declared_releases

    specs = declared_releases()
    for spec in specs:
        if spec.label == label:
            return spec
    raise UsageError(f"no registered calibrator declares release {label!r} (declared: "
                     f"{', '.join(sorted(s.label for s in specs)) or 'none'})")


def release_budget(label: str) -> dict[str, float] | None:
    """How the calibrator that declares release ``label`` splits its noise budget between
    its keys (``ReleaseSpec.noise_share``; None: equally), as the run's noise stage did."""
    return release_spec(label).budget()


def load_run(run_dir: Path, *, device: str = "cpu", exp: Any = None) -> RunView:
    """Rebuild a run for attacking from its server's view (``RUN/server/``, or a copy of it);
    ``exp`` reuses a built experiment of the run as the experimenter's truth."""
    from privfedcal.experiment import build_server_experiment
    from privfedcal.federation.runfolder import SUMMARY_FILE, TRANSCRIPT_DIR, server_view
    from privfedcal.federation.setup import server_dataset
    from privfedcal.privacy.transcript import load_transcript
    from privfedcal.settings.run_config import CONFIG_FILE, read_run_config

    run_dir = Path(run_dir)
    view_dir = server_view(run_dir)
    cfg = read_run_config(view_dir).replace(device=device, workers=1)
    if not (view_dir / TRANSCRIPT_DIR / "index.json").is_file():
        raise UsageError(f"{run_dir} has no transcript (trained with --no-transcript?): "
                         "there is nothing the server observed to attack")
    summary_file = view_dir / SUMMARY_FILE
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    truth = exp
    if truth is None and (run_dir / CONFIG_FILE).is_file():
        full = read_run_config(run_dir)
        if full.training.data_seed is not None:  # the experimenter's config: the partition is known
            from privfedcal.experiment import build_experiment

            truth = build_experiment(full.replace(device=device, workers=1))
    if truth is None:
        server = build_server_experiment(cfg)
    else:  # the same model object, seen through the server's public data only
        server = dataclasses.replace(truth, record=cfg.to_dict(),
                                     data=server_dataset(truth.data), parts=None, counts=None)
    return RunView(run_dir, cfg, summary, server, load_transcript(view_dir / TRANSCRIPT_DIR),
                   truth)
