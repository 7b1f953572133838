"""Scoring and presentation of attack results: metrics per target, attack.json, the PNG grid
of true vs reconstructed images, and rich summary tables.

Scoring (our choices): reconstructions are matched to the true images behind their target:
in order for per-image targets (raw features), by best PSNR when one image stands for
several (a class mean, a class gradient), by the Hungarian assignment on MSE for a batch
(class statistics, a model update; ``metrics.matched_psnr``). ``feature_cosine`` compares
the reconstructions' features with the TRUE features of their matched images (what the
attack really recovered; ``target_cosine`` in a record is the agreement with what the
attacker optimised). ``nearest_is_true`` asks whether the nearest training image of the
whole training set (MSE) is the matched true one; for a single image standing for a set
that means "is one of the set", so ``nearest_chance`` gives the rate of a random image of
the right class (set size / class size; 1 / class size for matched targets). ``prior_psnr`` is the PSNR of a guess
that needs no client data, the test-set mean image of the class: an attack at or below it
has learnt nothing visual about the client's images.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from rich import box  # noqa: E402
from rich.table import Table  # noqa: E402
from torch import Tensor  # noqa: E402

from privfedcal.attacks.metrics import (  # noqa: E402
    best_match,
    feature_cosine,
    matched_psnr,
    psnr,
    ssim,
)

if TYPE_CHECKING:
    from privfedcal.attacks.runner import Attacked, RunView

TARGET_ORDER = ("raw-feature", "class-mean", "class-stats", "class-gradient", "model-update")


def nearest_training_image(view: RunView, recon: Tensor, chunk: int = 4096) -> Tensor:
    """Index of the nearest (MSE) training image of every reconstruction, in chunks."""
    n = view.exp.data.x_train.shape[0]
    best_idx = torch.zeros(recon.shape[0], dtype=torch.long)
    best_psnr = torch.full((recon.shape[0],), -math.inf)
    for start in range(0, n, chunk):
        idx, p = best_match(recon, view.pixels(torch.arange(start, min(n, start + chunk))))
        better = p > best_psnr
        best_idx = torch.where(better, idx + start, best_idx)
        best_psnr = torch.where(better, p, best_psnr)
    return best_idx


def score(view: RunView, recon: Tensor, truth_idx: Tensor, *,
          paired: bool) -> tuple[dict[str, Any], Tensor]:
    """Metrics of ``recon`` (B,C,H,W pixels) against the training images ``truth_idx``.

    Returns the metric dict and the matched true images (B,C,H,W) for the grid.
    """
    recon = recon.detach().cpu().float()
    truth = view.pixels(truth_idx)
    single = not paired and (recon.shape[0] == 1 or recon.shape[0] > truth.shape[0])
    if paired:
        index = torch.arange(recon.shape[0])
    elif single:
        index, _ = best_match(recon, truth)
    else:
        _, index = matched_psnr(recon, truth)
    matched_idx = truth_idx.cpu()[index]
    matched = truth[index]
    d = view.exp.data
    dev = d.x_train.device
    with torch.no_grad():
        z_true = view.model.features(d.x_train[matched_idx.to(dev)])
        fc = feature_cosine(view.model, recon.to(dev), z_true, mean=d.mean, std=d.std)
    p = psnr(recon, matched)
    labels = d.y_train[matched_idx.to(dev)]
    nearest = nearest_training_image(view, recon)
    class_size = torch.bincount(d.y_train.cpu(), minlength=d.num_classes).double()[labels.cpu()]
    hits = (d.y_train[truth_idx].cpu()[None] == labels.cpu()[:, None]).sum(1) if single else 1
    return {
        "psnr": float(p.mean()),
        "ssim": float(ssim(recon, matched).mean()),
        "feature_cosine": float(fc.mean()),
        "nearest_is_true": float((nearest == matched_idx).double().mean()),
        "nearest_chance": float((hits / class_size).mean()),
        "prior_psnr": float(psnr(view.prior(labels), matched).mean()),
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


def save_grid(results: Sequence[Attacked], path: Path, *, max_targets: int = 16,
              max_images: int = 8, title: str | None = None) -> Path:
    """Two rows per target (true images on top, reconstructions below, matched pairs), at
    most ``max_images`` pairs per target and ``max_targets`` targets (the first ones)."""
    shown = list(results)[:max_targets]
    cols = max([min(max_images, r.recon.shape[0]) for r in shown] or [1])
    fig, axes = plt.subplots(2 * max(1, len(shown)), cols, squeeze=False,
                             figsize=(1.1 * cols + 1.8, 2.2 * max(1, len(shown))))
    for ax in axes.flat:
        ax.axis("off")
    for i, res in enumerate(shown):
        r = res.record
        who = "all" if r["client"] is None else r["client"]
        cls = "" if r["class"] is None else f" c{r['class']}"
        for j in range(min(cols, res.recon.shape[0])):
            for row, img in ((2 * i, res.truth[j]), (2 * i + 1, res.recon[j])):
                axes[row, j].axis("on")
                _show(axes[row, j], img)
        axes[2 * i, 0].set_ylabel(f"{r['target']}\nk{who}{cls} n={r['n']}\ntrue", fontsize=7)
        axes[2 * i + 1, 0].set_ylabel(f"recon\n{r['psnr']:.1f} dB", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- tables -----------------------------------------------------------------------------------
def _mean(values: Sequence[float | None]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def summarise(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (target kind, view): means of the metrics over its records."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["target"], r["view"]), []).append(r)
    order = {t: i for i, t in enumerate(TARGET_ORDER)}
    rows = []
    for (target, view), rs in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 99),
                                                                     kv[0][1])):
        ns = [r["n"] for r in rs]
        rows.append({"target": target, "view": view, "targets": len(rs),
                     "n": f"{min(ns)}" if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}",
                     **{k: _mean([r.get(k) for r in rs]) for k in
                        ("psnr", "prior_psnr", "ssim", "feature_cosine", "nearest_is_true")}})
    return rows


VIEW_NAMES = {"hypothetical": "baseline", "plain-upload": "upload", "aggregate": "aggregate",
              "simulated-update": "simulated"}


def records_table(records: Sequence[dict[str, Any]], title: str) -> Table:
    """Grouped means; ``prior`` is the data-free guess's PSNR, ``NN`` nearest_is_true."""
    table = Table(title=title, box=box.SIMPLE_HEAD)
    widths = {"#": 2, "n": 7, "feat cos": 5, "NN": 4}
    for col in ("target", "view", "#", "n", "PSNR", "prior", "SSIM", "feat cos", "NN"):
        if col in ("target", "view"):
            table.add_column(col, no_wrap=True)
        else:
            table.add_column(col, justify="right", min_width=widths.get(col, 5))
    for row in summarise(records):
        table.add_row(row["target"], VIEW_NAMES.get(row["view"], row["view"]),
                      str(row["targets"]), row["n"],
                      *(f"{row[k]:.2f}" for k in ("psnr", "prior_psnr", "ssim",
                                                  "feature_cosine", "nearest_is_true")))
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
        mae = _mean([r["count_mae"] for r in rs])
        table.add_row(label, view, str(len(rs)),
                      *(f"{_mean([r[k] for r in rs]):.3f}" for k in ("accuracy", "precision",
                                                                      "recall")),
                      "n/a" if math.isnan(mae) else f"{mae:.2f}")
    return table


def plot_class_sets(records: Sequence[dict[str, Any]], path: Path) -> Path:
    """True class counts per client (shade) with the inferred class sets of each client's
    last release on top: dot = found, x = false positive, open circle = missed."""
    last: dict[Any, dict[str, Any]] = {}
    for r in records:
        last[(r["label"], r["client"])] = r  # records come in release order
    rows = list(last.values())
    counts = torch.tensor([r["true_counts"] for r in rows], dtype=torch.float64)
    fig, ax = plt.subplots(figsize=(0.45 * counts.shape[1] + 2.5, 0.35 * len(rows) + 1.6))
    ax.imshow(counts.numpy(), cmap="Greys", aspect="auto", alpha=0.6)
    for i, r in enumerate(rows):
        pred, true = set(r["present"]), set(r["true_classes"])
        for c in pred & true:
            ax.plot(c, i, "o", color="C2", ms=5)
        for c in pred - true:
            ax.plot(c, i, "x", color="C3", ms=7)
        for c in true - pred:
            ax.plot(c, i, "o", mfc="none", color="C1", ms=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['label']} k{'all' if r['client'] is None else r['client']}"
                        for r in rows], fontsize=7)
    ax.set_xticks(range(counts.shape[1]))
    ax.set_xlabel("class")
    ax.set_title("class sets: shade = true count; dot found, x false positive, o missed",
                 fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
