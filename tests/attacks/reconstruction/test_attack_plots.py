"""The audit and attack plots use the shared colour-blind-safe style (plotstyle.py): the
first method's markers are drawn in the palette's first colour, not matplotlib's default."""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

from privfedcal.attacks.reconstruction.leakage_sweep import plot_audit
from privfedcal.attacks.reconstruction.runner import Attacked
from privfedcal.attacks.reconstruction.scoring import plot_class_sets, save_grid
from privfedcal.report.style.palette import rgb

MPL_DEFAULT_C0 = (0x1F, 0x77, 0xB4)


def _has(path, colour, tol=6) -> bool:
    px = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3).astype(int)
    return bool((np.abs(px - np.array(colour)).max(axis=1) <= tol).any())


def test_plot_audit_uses_the_palette(tmp_path):
    row = dict(method="ccvr", eps=math.inf, secagg=False, accuracy=0.9, psnr_max=40.0,
               psnr=30.0, class_inference_accuracy=1.0, prior_psnr_max=15.0)
    dp = {**row, "eps": 1.0, "accuracy": 0.8, "psnr_max": 8.0, "psnr": 7.0}
    path = plot_audit([row, dp], tmp_path / "audit.png")
    assert _has(path, rgb(0)) and not _has(path, MPL_DEFAULT_C0)


def test_class_sets_and_grid_plots(tmp_path):
    recs = [{"label": "ccvr-stats", "client": 0, "present": [0, 2], "true_classes": [0, 1],
             "true_counts": [3, 2, 0]}]
    path = plot_class_sets(recs, tmp_path / "classes.png")
    assert _has(path, rgb(2)) and _has(path, rgb(5)) and _has(path, rgb(1))  # found, fp, missed
    img = torch.rand(2, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    att = Attacked({"client": 0, "class": 1, "target": "class-stats", "n": 2, "psnr": 20.0},
                   img, img)
    grid = save_grid([att], tmp_path / "grid.png", title="t")
    assert Image.open(grid).size[0] > 0
