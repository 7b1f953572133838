"""What a calibration upload shows the server: whose payload to attack (each client's plain
upload, or the aggregate under secure aggregation) and which classes it holds; and
``infer_class_sets``, the class-set inference over every declared calibration release."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from privfedcal.attacks.attack_options import attack_option
from privfedcal.attacks.reconstruction.class_inference import (
    infer_classes,
    key_tests,
    score_class_sets,
)
from privfedcal.attacks.reconstruction.runner import InversionOptions, Plan
from privfedcal.attacks.release_attacks import declared_releases
from privfedcal.attacks.view import Release, RunView, release_spec
from privfedcal.errors import UsageError
from privfedcal.settings.messages import SettingError


@dataclasses.dataclass(frozen=True)
class ClassesOptions:
    """``attack classes``: the class-set inference's false-positive rate."""

    false_positive_rate: float = attack_option(1e-3, "Per-class false-positive rate under DP "
                                               "noise.")

    def __post_init__(self) -> None:
        if not 0 < self.false_positive_rate < 1:
            raise SettingError(f"{{false_positive_rate}} must be in (0, 1), got "
                             f"{self.false_positive_rate}")


def sources(view: RunView, rel: Release, clients: Sequence[int] | None, plan: Plan,
             default_clients: int) -> list[tuple[int, dict[str, Tensor], str]]:
    """``(client, payload, view)`` per attacked client. Under secure aggregation every
    attacked client gets the aggregate as payload: the reconstruction is then scored
    against that client's images, exactly as its plain upload would be (report.score)."""
    if rel.uploads:
        seen = sorted(rel.uploads)
        chosen = list(clients) if clients else seen[:default_clients]
        missing = [c for c in chosen if c not in rel.uploads]
        if missing:
            raise UsageError(f"client(s) {missing} uploaded nothing in round {rel.round}; "
                             f"clients with uploads: {', '.join(map(str, seen))}")
        return [(c, rel.uploads[c], "plain-upload") for c in chosen]
    senders = sorted(rel.ciphertext_bytes) or list(range(view.cfg.data.clients))
    chosen = list(clients) if clients else senders[:default_clients]
    bad = [c for c in chosen if not 0 <= c < view.cfg.data.clients]
    if bad:
        raise UsageError(f"client(s) {bad} out of range 0..{view.cfg.data.clients - 1}")
    if rel.aggregate is None:
        raise UsageError(f"round {rel.round} of {rel.label!r} holds neither per-client uploads "
                         "nor an aggregate")
    plan.notes.append(f"secure aggregation: round {rel.round} has no per-client uploads "
                      f"({len(rel.ciphertext_bytes)} ciphertexts); attacking the aggregate (the "
                      "statistics of the whole federation) and scoring it against the images "
                      f"of client(s) {', '.join(map(str, chosen))} only, like the per-client "
                      "rows")
    aggregate = rel.aggregate
    return [(c, aggregate, "aggregate") for c in chosen]


def classes_to_attack(view: RunView, client: int | None, payload: dict[str, Tensor], stds: dict,
             wanted: Sequence[int] | None, opts: InversionOptions,
             plan: Plan, *, label: str) -> list[tuple[int, bool]]:
    """``(class, inferred)`` pairs to attack: classes the upload shows present (and the
    client holds: a false positive cannot be scored), plus, with ``known_classes``, held
    classes the upload hides (``inferred`` False: the attacker's side knowledge)."""
    present, _ = infer_classes(payload, tests=key_tests(release_spec(label)), noise_std=stds,
                               false_positive_rate=opts.false_positive_rate)
    who = "the federation" if client is None else f"client {client}"
    if opts.known_classes and not view.scored:
        plan.notes.append("--known-classes needs the clients' class sets (the experimenter's "
                          "side of the run folder): not available here")
    out = []
    for c in (wanted if wanted else range(present.shape[-1])):
        if not 0 <= c < present.shape[-1]:
            raise UsageError(f"class {c} out of range 0..{present.shape[-1] - 1}")
        truth = view.truth(client, c)
        held = None if truth is None else truth.numel() > 0  # None: unknown (unscored)
        if bool(present[c]) and held is False:
            # without DP noise a class can only look present when the upload is an
            # aggregate that another client's data is in
            noisy = any(s > 0 for s in stds.values())
            why = "DP noise" if noisy else "another client's class in the aggregate"
            plan.notes.append(f"class {c} looks present for {who} ({why}) but is not held: "
                              "a false positive, nothing to reconstruct")
        elif bool(present[c]) or (held and opts.known_classes):
            out.append((c, bool(present[c])))
        elif wanted:
            plan.notes.append(f"class {c}: not visible in the upload of {who}; skipped")
    if not bool(present.any()):
        plan.notes.append(f"no class is detectably present in the upload of {who} (noise): "
                          + ("attacking its held classes as side knowledge"
                             if opts.known_classes else "nothing to invert (see --known-classes)"))
    return out


def infer_class_sets(view: RunView, opts: ClassesOptions | InversionOptions) -> tuple[list[dict[str, Any]], list[str]]:
    """Every client's class set (and counts, when uploaded) from every calibration release,
    scored against the partition; under secure aggregation only the federation's."""
    records: list[dict[str, Any]] = []
    notes: list[str] = []
    truth = None if view.truth_exp is None else torch.as_tensor(view.truth_exp.counts,
                                                                 dtype=torch.float64)
    if truth is None:
        notes.append("unscored: the clients' class counts are on the experimenter's side of "
                     "the run folder, not in the server's view")
    specs = declared_releases()  # every calibrator's, by calibrator name
    labels = [spec.label for spec in specs]
    for spec in specs:
        label = spec.label
        for rel in view.releases(label):
            shown: list[tuple[int | None, dict[str, Tensor], str, Tensor | None]]
            if rel.uploads:
                shown = [(c, p, "plain-upload", None if truth is None else truth[c])
                           for c, p in sorted(rel.uploads.items())]
            elif rel.aggregate is not None:
                shown = [(None, rel.aggregate, "aggregate",
                            None if truth is None else truth.sum(0))]
                note = (f"{label}: secure aggregation hides per-client class sets; the aggregate "
                        "only tells which classes the federation holds")
                if note not in notes:
                    notes.append(note)
            else:
                continue
            for client, payload, seen, true_counts in shown:
                stds = view.noise_stds(label, list(payload))
                pred = infer_classes(payload, tests=key_tests(spec), noise_std=stds,
                                     false_positive_rate=opts.false_positive_rate)
                records.append({
                    "target": "class-set", "client": client, "class": None,
                    "n": None if true_counts is None else int(true_counts.sum()), "round": rel.round,
                    "label": label, "view": seen, "dp": any(s > 0 for s in stds.values()),
                    **({"scored": False} if true_counts is None
                       else score_class_sets(pred, true_counts)),
                    "present": torch.nonzero(pred[0]).flatten().tolist(),
                    "true_classes": (None if true_counts is None
                                     else torch.nonzero(true_counts > 0).flatten().tolist()),
                    "counts": None if pred[1] is None else [round(float(v), 2) for v in pred[1]],
                    "true_counts": None if true_counts is None else [int(v) for v in true_counts],
                })
    if not records:
        raise UsageError(f"the transcript of {view.run_dir} holds no calibration uploads "
                         f"({' or '.join(labels)})")
    return records, notes

