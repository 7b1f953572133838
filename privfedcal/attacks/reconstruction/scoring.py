"""Scoring and presentation of attack results: metrics per target, attack.json, the PNG grid
of true vs reconstructed images, and rich summary tables.

Scoring (our choices): one rule for every target and for the controls. Reconstructions
are matched to the attacked individuals' true images (one client's class; under secure
aggregation the attacked client's, never the federation's): in order for per-image targets
(raw features), by best PSNR when one image stands for several (a class mean, a weighted-
mean class gradient), by the Hungarian assignment on MSE for a batch (class statistics,
rank-n features, a model update; ``metrics.matched_psnr``). The data-free prior (the
test-set mean image of the class) is matched to the same set by the same rule, so
``psnr`` / ``prior_psnr`` and their worst cases ``psnr_best`` / ``prior_psnr_best`` compare
in every row. ``feature_cosine`` compares the reconstructions' features with the TRUE
features of their matched images. ``nearest_is_true`` asks whether the nearest training
image of the whole training set (MSE) is the matched true one (``nearest_of_best``: for the
best reconstruction); for a single image standing for a set that means "is one of the
set", so ``nearest_chance`` gives the rate of a random image of the right class. Tables
and audit rows put the worst case over individuals first (``worst_case``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich import box
from rich.table import Table
from torch import Tensor

from privfedcal.attacks.reconstruction.metrics import (
    best_match,
    feature_cosine,
    matched_psnr,
    psnr,
    ssim,
)
from privfedcal.attacks.reconstruction.modes import eval_mode
from privfedcal.attacks.release_attacks import target_order
from privfedcal.report.style.plotstyle import colour, new_figure, save, styled

if TYPE_CHECKING:
    from privfedcal.attacks.view import RunView

@dataclass(frozen=True, eq=False)
class Attacked:
    """One scored target: the JSON record plus matched true / reconstructed images."""

    record: dict[str, Any]
    truth: Tensor
    recon: Tensor


def nearest_training_image(view: RunView, recon: Tensor, chunk: int = 4096) -> Tensor:
    """Index of the nearest (MSE) training image of every reconstruction, in chunks."""
    n = view.truth_exp.data.x_train.shape[0]
    best_idx = torch.zeros(recon.shape[0], dtype=torch.long)
    best_psnr = torch.full((recon.shape[0],), -math.inf)
    for start in range(0, n, chunk):
        idx, p = best_match(recon, view.pixels(torch.arange(start, min(n, start + chunk))))
        better = p > best_psnr
        best_idx = torch.where(better, idx + start, best_idx)
        best_psnr = torch.where(better, p, best_psnr)
    return best_idx


def _assign(images: Tensor, truth: Tensor, rule: str) -> Tensor:
    """Index into ``truth`` for every image under one matching rule: ``paired`` (in order),
    ``best`` (each image's best-PSNR true image), ``hungarian`` (one-to-one on MSE)."""
    if rule == "paired":
        return torch.arange(images.shape[0])
    if rule == "best":
        return best_match(images, truth)[0]
    return matched_psnr(images, truth)[1]


def matching_rule(n_images: int, n_truth: int, *, paired: bool) -> str:
    """The rule for ``n_images`` reconstructions of a set of ``n_truth`` true images."""
    if paired:
        return "paired"
    return "best" if n_images == 1 or n_images > n_truth else "hungarian"


def score(view: RunView, recon: Tensor, truth_idx: Tensor | None, *, paired: bool,
          inputs: Callable[[Tensor], Tensor] | None = None) -> tuple[dict[str, Any], Tensor]:
    """Metrics of ``recon`` (B,C,H,W pixels) against the training images ``truth_idx``.

    ``truth_idx`` is the attacked individuals' set (one client's class; never a whole
    federation's, so that an aggregate reconstruction gets no best-of-federation credit).
    The data-free prior is scored by the SAME rule against the same set, so ``psnr`` and
    ``prior_psnr`` (and their maxima) are comparable in every row. Worst case over the
    individuals: ``psnr_best`` (the best reconstruction), ``nearest_of_best`` (is ITS
    nearest training image its matched true image), ``prior_psnr_best``.

    ``inputs`` maps training indices to what the client differentiated when that is not
    the image itself (CReFF under DSA: the augmented image,
    ``gradients_attack.differentiated_inputs``): ``feature_cosine`` compares with those
    inputs' features, the pixel metrics with the images.

    Returns the metric dict and the matched true images (B,C,H,W) for the grid. Without the
    experimenter's side (``truth_idx`` None: a server view alone) nothing is scored: the
    record says ``"scored": false`` and no true images come back.
    """
    recon = recon.detach().cpu().float()
    if truth_idx is None or view.truth_exp is None:
        return {"scored": False}, recon[:0]
    truth = view.pixels(truth_idx)
    rule = matching_rule(recon.shape[0], truth.shape[0], paired=paired)
    index = _assign(recon, truth, rule)
    matched_idx = truth_idx.cpu()[index]
    matched = truth[index]
    d = view.truth_exp.data
    dev = d.x_train.device
    with eval_mode(view.model), torch.no_grad():
        x_true = (d.x_train[matched_idx.to(dev)] if inputs is None
                  else inputs(matched_idx.to(dev)))
        z_true = view.model.features(x_true)
        fc = feature_cosine(view.model, recon.to(dev), z_true, mean=d.mean, std=d.std)
    p = psnr(recon, matched)
    labels = d.y_train[matched_idx.to(dev)]
    prior = view.prior(labels)
    prior_p = psnr(prior, truth[_assign(prior, truth, rule)])
    nearest = nearest_training_image(view, recon)
    hit = nearest == matched_idx
    worst = int(p.argmax())
    class_size = torch.bincount(d.y_train.cpu(), minlength=d.num_classes).double()[labels.cpu()]
    hits = ((d.y_train[truth_idx].cpu()[None] == labels.cpu()[:, None]).sum(1)
            if rule == "best" else 1)
    return {
        "psnr": float(p.mean()),
        "ssim": float(ssim(recon, matched).mean()),
        "feature_cosine": float(fc.mean()),
        "nearest_is_true": float(hit.double().mean()),
        "nearest_chance": float((hits / class_size).mean()),
        "prior_psnr": float(prior_p.mean()),
        "psnr_best": float(p[worst]),
        "nearest_of_best": bool(hit[worst]),
        "prior_psnr_best": float(prior_p.max()),
        "matching": rule,
        "candidates": int(truth.shape[0]),
        "psnr_per_image": [round(float(v), 3) for v in p],
    }, matched


# ---- files ------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """JSON-safe: non-finite floats become null (strict JSON has no NaN / Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def write_records(records: Sequence[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(list(records)), indent=1, allow_nan=False))
    return path


def _show(ax, img: Tensor) -> None:
    img = img.detach().cpu().clamp(0, 1)
    if img.shape[0] == 1:
        ax.imshow(img[0].numpy(), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    else:
        ax.imshow(img.permute(1, 2, 0).numpy(), interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)


def save_grid(results: Sequence[Attacked], path: Path, *, max_targets: int = 16,
              max_images: int = 8, title: str | None = None) -> Path:
    """Two rows per target (true images on top, reconstructions below, matched pairs), at
    most ``max_images`` pairs per target and ``max_targets`` targets (the first ones)."""
    shown = list(results)[:max_targets]
    cols = max([min(max_images, r.recon.shape[0]) for r in shown] or [1])
    with styled():
        fig = new_figure(1.1 * cols + 1.8, 2.2 * max(1, len(shown)))
        axes = fig.subplots(2 * max(1, len(shown)), cols, squeeze=False)
        _draw_grid(fig, axes, shown, cols, title)
        return save(fig, path, dpi=110)


def _draw_grid(fig, axes, shown: Sequence[Attacked], cols: int, title: str | None) -> None:
    for ax in axes.flat:
        ax.axis("off")
    for i, res in enumerate(shown):
        r = res.record
        who = "all" if r["client"] is None else r["client"]
        cls = "" if r["class"] is None else f" c{r['class']}"
        for j in range(min(cols, res.recon.shape[0])):
            pairs = ((2 * i, res.truth[j] if j < res.truth.shape[0] else None),
                     (2 * i + 1, res.recon[j]))
            for row, img in pairs:
                if img is not None:  # unscored: no true image
                    axes[row, j].axis("on")
                    _show(axes[row, j], img)
        axes[2 * i, 0].set_ylabel(f"{r['target']}\nk{who}{cls} n={r['n']}\ntrue", fontsize=7)
        quality = "unscored" if r.get("psnr") is None else f"{r['psnr']:.1f} dB"
        axes[2 * i + 1, 0].set_ylabel(f"recon\n{quality}", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)


# ---- tables -----------------------------------------------------------------------------------
def _mean(values: Sequence[float | None]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def worst_case(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The most exposed individual over ``records``: the best reconstruction's PSNR
    (``psnr_max``), whether its nearest training image is its true image
    (``nearest_of_worst``), the client / class / target it came from, and the prior's
    best PSNR under the same rule (``prior_psnr_max``, the control at the worst case)."""
    scored = [r for r in records if r.get("psnr_best") is not None
              and math.isfinite(r["psnr_best"])]
    if not scored:
        return {"psnr_max": math.nan, "nearest_of_worst": None, "worst_client": None,
                "worst_class": None, "worst_target": None, "prior_psnr_max": math.nan}
    top = max(scored, key=lambda r: r["psnr_best"])
    return {"psnr_max": top["psnr_best"], "nearest_of_worst": top["nearest_of_best"],
            "worst_client": top["client"], "worst_class": top["class"],
            "worst_target": top["target"],
            "prior_psnr_max": max(r["prior_psnr_best"] for r in scored)}


def summarise(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (target kind, view): the worst case over its individuals and the means
    of the metrics over its records."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["target"], r["view"]), []).append(r)
    order = {t: i for i, t in enumerate(target_order())}  # the attacks' declared targets
    rows = []
    for (target, view), rs in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 99),
                                                                     kv[0][1])):
        ns = [r["n"] or 0 for r in rs]
        rows.append({"target": target, "view": view, "targets": len(rs),
                     "n": f"{min(ns)}" if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}",
                     **worst_case(rs),
                     **{k: _mean([r.get(k) for r in rs]) for k in
                        ("psnr", "prior_psnr", "ssim", "feature_cosine", "nearest_is_true")},
                     "converged": sum(bool(r.get("converged")) for r in rs)})
    return rows


VIEW_NAMES = {"hypothetical": "baseline", "plain-upload": "upload", "aggregate": "aggregate",
              "simulated-update": "simulated"}


def _who(row: dict[str, Any]) -> str:
    client = "all" if row["worst_client"] is None else row["worst_client"]
    cls = "-" if row["worst_class"] is None else row["worst_class"]
    return f"k{client}/c{cls}"


def records_table(records: Sequence[dict[str, Any]], title: str) -> Table:
    """Worst case first (``max PSNR``: the best reconstruction of any individual, ``NN@max``
    whether its nearest training image is its true one, ``worst``: client/class, ``prior
    max``: the control under the same rule), then means over targets; ``conv``: how many
    inversions met the convergence criterion."""
    table = Table(title=title, box=box.SIMPLE_HEAD)
    widths = {"#": 2, "n": 7, "feat cos": 5, "NN": 4}
    cols = ("target", "view", "#", "n", "max PSNR", "NN@max", "worst", "prior max",
            "PSNR", "prior", "SSIM", "feat cos", "NN", "conv")
    for col in cols:
        if col in ("target", "view", "worst"):
            table.add_column(col, no_wrap=True)
        else:
            table.add_column(col, justify="right", min_width=widths.get(col, 5))
    for row in summarise(records):
        nn_worst = row["nearest_of_worst"]
        table.add_row(row["target"], VIEW_NAMES.get(row["view"], row["view"]),
                      str(row["targets"]), row["n"], f"{row['psnr_max']:.2f}",
                      "-" if nn_worst is None else ("yes" if nn_worst else "no"), _who(row),
                      f"{row['prior_psnr_max']:.2f}",
                      *(f"{row[k]:.2f}" for k in ("psnr", "prior_psnr", "ssim",
                                                  "feature_cosine", "nearest_is_true")),
                      f"{row['converged']}/{row['targets']}")
    return table


def classes_table(records: Sequence[dict[str, Any]], title: str) -> Table:
    """One row per (release label, view): mean presence accuracy, precision, recall, count MAE."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["label"], r["view"]), []).append(r)
    table = Table(title=title)
    for col in ("release", "view", "uploads", "accuracy", "precision", "recall", "count MAE"):
        table.add_column(col, justify="left" if col in ("release", "view") else "right")
    for (label, view), rs in sorted(groups.items()):
        mae = _mean([r.get("count_mae") for r in rs])
        table.add_row(label, view, str(len(rs)),
                      *(f"{_mean([r.get(k) for r in rs]):.3f}" for k in ("accuracy",
                                                                         "precision", "recall")),
                      "n/a" if math.isnan(mae) else f"{mae:.2f}")
    return table


def plot_class_sets(records: Sequence[dict[str, Any]], path: Path) -> Path:
    """True class counts per client (shade) with the inferred class sets of each client's
    last release on top: dot = found, x = false positive, open circle = missed."""
    last: dict[Any, dict[str, Any]] = {}
    for r in records:
        last[(r["label"], r["client"])] = r  # records come in release order
    rows = list(last.values())
    width = max(max(len(r["true_counts"] or []) for r in rows),
                1 + max((c for r in rows for c in r["present"]), default=0))
    # unscored (a server view alone): no shade, and every found class counts as found
    counts = torch.tensor([r["true_counts"] or [0] * width for r in rows], dtype=torch.float64)
    found, wrong, missed = colour(2), colour(5), colour(1)
    with styled():
        fig = new_figure(0.45 * counts.shape[1] + 2.5, 0.35 * len(rows) + 1.6)
        ax = fig.add_subplot()
        ax.imshow(counts.numpy(), cmap="Greys", aspect="auto", alpha=0.6)
        ax.grid(False)
        for i, r in enumerate(rows):
            pred = set(r["present"])
            true = pred if r["true_classes"] is None else set(r["true_classes"])
            for c in pred & true:
                ax.plot(c, i, "o", color=found, ms=5)
            for c in pred - true:
                ax.plot(c, i, "x", color=wrong, ms=7)
            for c in true - pred:
                ax.plot(c, i, "o", mfc="none", color=missed, ms=7)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{r['label']} k{'all' if r['client'] is None else r['client']}"
                            for r in rows], fontsize=7)
        ax.set_xticks(range(counts.shape[1]))
        ax.set_xlabel("class")
        ax.set_title("class sets: shade = true count; dot found, x false positive, o missed",
                     fontsize=8)
        return save(fig, path, dpi=110)
