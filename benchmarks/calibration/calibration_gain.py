"""Measured accuracy gains of classifier calibration on digits: CCVR (Luo et al., NeurIPS 2021,
Tables 1 and 5) and CReFF (Shang et al., IJCAI 2022, Table 1), mean and std over seeds.

(a) Dirichlet label skew, alpha in {0.5, 0.1, 0.05}: one FedAvg training per (alpha, seed),
    whose final model is calibrated post hoc twice, by CCVR and by the oracle (head re-trained
    on the real features of every training sample), so all three columns share one model.
(b) Long tail (``--partition longtail``, alpha 0.5 as in CReFF's CIFAR-10-LT table), IF in
    {10, 50, 100}: FedAvg, FedAvg + CCVR (post hoc, same model), the oracle on the kept
    (still long-tailed) real features, and CReFF (its own training run).

Every run uses the defaults of ``privfedcal train`` (10 clients, 30 rounds, 2 local epochs,
batch 32, lr 0.05, momentum 0.9, full participation, the digits MLP) on one CPU thread, unless
flags change them. A post-hoc calibration uses the generator ``Simulator.finish`` would give
it, so the "FedAvg + CCVR" numbers equal those of ``privfedcal train --method ccvr``.

    python benchmarks/calibration/calibration_gain.py [--seeds 0 1 2] [--alphas 0.5 0.1 0.05]
        [--ifs 10 50 100] [--parts a b] [--rounds 30] [--local-epochs 2]
        [--json calibration_gain.json]

Prints two markdown tables (accuracy in %, mean +- std over seeds, std with ddof=1) and the
machine line, and writes every number (per seed, per class, accuracy curves, CReFF's last
matching losses) to the JSON (``--json``, default ``calibration_gain.json``: the benchmarks'
common record of ``harness.py``, the numbers under ``results``).
For investigations: ``--match-steps/--retrain-steps/--features-per-class`` and
``--calib-param KEY=VALUE`` (any calibrator option, e.g. ``creff_match_reduction=mean``)
change the calibrators, ``--eval-every N`` records accuracy curves, and ``--diagnose`` (part b)
trains heads from CReFF's federated features and from CCVR's virtual features with either
method's re-training recipe, on the same extractor, to tell the features from the recipe.
Results and their analysis: docs/results/fidelity.md ("Classifier calibration").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import harness  # noqa: E402

from privfedcal.experiment import build_calibrator, build_simulator, config_of
from privfedcal.federation.local import make_generator
from privfedcal.federation.simulator import RoundContext, Simulator
from privfedcal.settings.run_config import RunConfig

TAIL = 3  # "tail accuracy" = mean test accuracy of the TAIL classes with fewest training samples


def run_config(args: argparse.Namespace, **kw: Any) -> RunConfig:
    """The ``privfedcal train`` defaults, plus the benchmark's flags and ``kw``."""
    base: dict[str, Any] = dict(dataset="digits", clients=args.clients, device="cpu", threads=1,
                                transcript=False, eval_every=args.eval_every or args.rounds)
    for name in ("rounds", "local_epochs", "participation"):
        if getattr(args, name) is not None:
            base[name] = getattr(args, name)
    params = {k: getattr(args, k) for k in ("match_steps", "retrain_steps", "features_per_class")
              if getattr(args, k) is not None}
    for item in args.calib_param:
        key, _, value = item.partition("=")
        params[key] = parse_value(value)
    if params:
        base["calibration_params"] = params
    base.update(kw)
    return RunConfig.of(**base)


def parse_value(text: str) -> Any:
    """A number, true/false, none (None: the default), or a string; quotes keep a string as
    it is (``creff_dsa='none'`` is the string "none", augmentation off)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def posthoc(sim: Simulator, calibrate: str, cfg: RunConfig) -> dict[str, Any]:
    """Calibrate the finished simulator's global model with ``calibrate`` and the calibration
    options of ``cfg`` (the benchmark's); test accuracy."""
    cfg = config_of(sim.exp).replace(calibration_params=cfg.calibration_params)
    calibrator = build_calibrator(cfg.replace(calibrate=calibrate), sim.exp)
    t = cfg.training
    ctx = RoundContext(sim, t.rounds, sim.global_state, sim.global_state,
                       list(range(cfg.data.clients)), make_generator(t.seed, t.rounds, 0, 5))
    t0 = time.perf_counter()
    calibrator.after_training(ctx)
    seconds = time.perf_counter() - t0
    ev = sim.evaluate(calibrator.eval_state(sim.global_state), calibrator.feature_transform())
    return {"accuracy": ev["accuracy"], "per_class_accuracy": ev["per_class_accuracy"],
            "seconds": round(seconds, 3)}


def train(cfg: RunConfig, run_dir: Path) -> tuple[Simulator, dict[str, Any]]:
    sim = build_simulator(cfg, run_dir)
    t0 = time.perf_counter()
    summary = sim.run()
    curve = [[h["round"], h["accuracy"]] for h in sim.history if "accuracy" in h]
    out = {"accuracy": summary["accuracy"], "per_class_accuracy": summary["per_class_accuracy"],
           "seconds": round(time.perf_counter() - t0, 3), "curve": curve}
    if "creff_dsa" in summary:
        out["creff_dsa"] = summary["creff_dsa"]
    info = sim.history[-1].get("calibration")
    if info:
        out["last_round"] = info
    return sim, out


def tail_classes(sim: Simulator) -> list[int]:
    held = np.asarray(sim.exp.counts).sum(axis=0)
    return [int(c) for c in np.argsort(held, kind="stable")[:TAIL]]


def setting_runs(cfg: RunConfig, tmp: Path, posthocs: list[str], creff: bool,
                 diagnose: bool = False) -> dict[str, Any]:
    """One FedAvg training calibrated by every name in ``posthocs``; CReFF as its own run.
    The FedAvg run itself takes no calibration options (a run without a calibrator refuses
    them); the post-hoc calibrations and CReFF get them."""
    sim, fedavg = train(cfg.replace(calibration_params={}), tmp / "fedavg")
    out: dict[str, Any] = {"fedavg": fedavg, "tail_classes": tail_classes(sim),
                           "train_counts": np.asarray(sim.exp.counts).sum(axis=0).tolist()}
    for name in posthocs:
        out[name] = posthoc(sim, name, cfg)
    if creff:
        creff_sim, out["creff"] = train(cfg.replace(method="creff"), tmp / "creff")
        if diagnose:
            out["diagnosis"] = diagnose_heads(creff_sim)
    return out


def diagnose_heads(sim: Simulator) -> dict[str, float]:
    """Which part makes CReFF and CCVR differ? Heads trained on the finished CReFF run's
    extractor (FedAvg's: CReFF does not change local training) from {CReFF's federated
    features S, CCVR's virtual features} by {CReFF's recipe: fresh head, J full-batch SGD
    steps at lr 0.1; CCVR's recipe: from the global head, ``RetrainParams`` defaults}."""
    from privfedcal.calibration import (
        CCVRParams,
        ClassStats,
        StatsTask,
        sample_virtual_features,
        virtual_counts,
    )
    from privfedcal.calibration.retrain import fresh_head, retrain_classifier, retrain_head_of

    cfg, creff = sim.loop, sim.calibrator
    ctx = RoundContext(sim, cfg.rounds, sim.global_state, sim.global_state,
                       list(range(cfg.clients)), make_generator(cfg.seed, cfg.rounds, 0, 5))
    c, p = creff.num_classes, creff.params
    payload = ctx.collect(StatsTask(c), list(range(cfg.clients)), sim.global_state, "diagnosis")
    stats = ClassStats.from_payload(payload)
    virtual = sample_virtual_features(stats, virtual_counts(stats.count, 100), ctx.generator)
    m = p.features_per_class
    federated = (creff.features.float(), torch.arange(c).repeat_interleave(m))
    out: dict[str, float] = {}
    for feats_name, (z, y) in (("federated", federated), ("virtual", virtual)):
        w0, b0 = fresh_head(c, z.shape[1], ctx.generator)
        heads = {
            "creff_recipe": retrain_classifier(w0, b0, z, y, steps=p.retrain_steps,
                                               lr=p.retrain_lr, batch_size=None,
                                               generator=ctx.generator),
            "ccvr_recipe": retrain_head_of(sim.global_state, z, y, CCVRParams(), ctx.generator),
        }
        for recipe, (w, b) in heads.items():
            state = dict(sim.global_state, **{"classifier.weight": w, "classifier.bias": b})
            out[f"{feats_name}+{recipe}"] = sim.evaluate(state)["accuracy"]
    return out


def stats(values: list[float]) -> tuple[float, float]:
    a = 100 * np.asarray(values, dtype=float)
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def fmt(values: list[float]) -> str:
    m, s = stats(values)
    return f"{m:.2f} ± {s:.2f}"


def tail_acc(run: dict[str, Any], classes: list[int]) -> float:
    pcs = [run["per_class_accuracy"][c] for c in classes]
    return float(np.mean([p for p in pcs if p is not None]))


def table(rows: dict[str, list[dict[str, Any]]], key: str, methods: list[str],
          tail: bool) -> str:
    """Markdown: one row per setting, mean ± std of every method (+ tail accuracy, gain)."""
    head = [key, *methods, "CCVR gain"] + ([f"tail-{TAIL} acc: " + " / ".join(methods)] if tail else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for setting, seeds in rows.items():
        cells = [setting]
        for m in methods:
            cells.append(fmt([r[m]["accuracy"] for r in seeds]))
        gains = [r["ccvr"]["accuracy"] - r["fedavg"]["accuracy"] for r in seeds]
        cells.append(f"{stats(gains)[0]:+.2f} ({sum(g > 0 for g in gains)}/{len(gains)} seeds > 0)")
        if tail:
            cells.append(" / ".join(
                f"{100 * np.mean([tail_acc(r[m], r['tail_classes']) for r in seeds]):.1f}"
                for m in methods))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--parts", nargs="+", default=["a", "b"], choices=["a", "b"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--alphas", nargs="+", type=float, default=[0.5, 0.1, 0.05])
    ap.add_argument("--ifs", nargs="+", type=float, default=[10, 50, 100])
    ap.add_argument("--lt-alpha", type=float, default=0.5)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--local-epochs", type=int, default=None)
    ap.add_argument("--participation", type=float, default=None)
    ap.add_argument("--match-steps", type=int, default=None)
    ap.add_argument("--retrain-steps", type=int, default=None)
    ap.add_argument("--features-per-class", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None, help="default: only the last round")
    ap.add_argument("--calib-param", action="append", default=[], metavar="KEY=VALUE",
                    help="extra calibrator option, e.g. creff_match_reduction=mean")
    ap.add_argument("--diagnose", action="store_true",
                    help="(b) only: heads from CReFF's / CCVR's features x recipes")
    ap.set_defaults(json=Path("calibration_gain.json"))
    args = harness.parse(ap)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    result: dict[str, Any] = {"dirichlet": {}, "longtail": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for part, settings, key in (("a", args.alphas, "dirichlet"), ("b", args.ifs, "longtail")):
            if part not in args.parts:
                continue
            for value in settings:
                runs = []
                for seed in args.seeds:
                    if part == "a":
                        cfg = run_config(args, alpha=value, seed=seed)
                    else:
                        cfg = run_config(args, partition="longtail", alpha=args.lt_alpha,
                                         imbalance_factor=value, seed=seed)
                    d = Path(tmp) / f"{key}-{value}-{seed}"
                    runs.append({"seed": seed, **setting_runs(
                        cfg, d, ["ccvr", "oracle"], creff=part == "b", diagnose=args.diagnose)})
                    last = runs[-1]
                    print(f"[{key} {value} seed {seed}] " + "  ".join(
                        f"{m} {100 * last[m]['accuracy']:.2f}"
                        for m in ("fedavg", "ccvr", "oracle", "creff") if m in last)
                        + "".join(f"  {k} {100 * v:.2f}"
                                  for k, v in last.get("diagnosis", {}).items()), flush=True)
                result[key][str(value)] = runs
    result["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    if result["dirichlet"]:
        print("\n(a) Dirichlet label skew, digits, accuracy % (mean ± std over seeds)\n")
        print(table({f"α={k}": v for k, v in result["dirichlet"].items()}, "setting",
                    ["fedavg", "ccvr", "oracle"], tail=False))
    if result["longtail"]:
        print(f"\n(b) long tail + Dirichlet α={args.lt_alpha}, digits, accuracy % "
              "(mean ± std over seeds)\n")
        print(table({f"IF={float(k):g}": v for k, v in result["longtail"].items()}, "setting",
                    ["fedavg", "ccvr", "creff", "oracle"], tail=True))
    diag = {k: [r["diagnosis"] for r in v] for k, v in result["longtail"].items()
            if v and "diagnosis" in v[0]}
    if diag:
        combos = list(next(iter(diag.values()))[0])
        print("\nDiagnosis: head accuracy % on CReFF's extractor, features + recipe (mean ± std)\n")
        print("| setting | " + " | ".join(combos) + " |\n|" + "---|" * (len(combos) + 1))
        for k, runs in diag.items():
            print(f"| IF={float(k):g} | " + " | ".join(fmt([r[c] for r in runs]) for c in combos)
                  + " |")
    print(f"\nwall time {result['wall_seconds']} s")
    harness.finish(args, result)


if __name__ == "__main__":
    main()
