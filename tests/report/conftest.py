"""One tiny real run folder shared by the report tests (CCVR under DP on digits, half the
clients per round, evaluated every second round), plus a synthetic audit folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def train_run(path: Path, **overrides) -> Path:
    from privfedcal.experiment import build_simulator
    from privfedcal.settings.run_config import RunConfig

    base = dict(method="ccvr", dataset="digits", clients=4, alpha=0.5, rounds=3, local_epochs=1,
                batch_size=32, device="cpu", threads=1, seed=0, transcript=False,
                participation=0.5, eval_every=2, dp_eps=8.0, out=str(path))
    base.update(overrides)
    cfg = RunConfig.of(**base)
    build_simulator(cfg, path).run()
    return path


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    return train_run(tmp_path_factory.mktemp("report") / "ccvr")


AUDIT_CSV = """method,eps,secagg,accuracy,psnr,ssim,feature_cosine,class_inference_accuracy,epsilon_spent,prior_psnr,psnr_max,nearest_is_true,nearest_chance,targets,note
ccvr,1,off,0.61,9.5,0.05,0.2,0.55,0.99,10.1,11.0,0,0.01,4,
ccvr,inf,off,0.8,14.25,0.3,0.7,1,inf,10.1,19.5,0.5,0.01,4,
ccvr,inf,on,0.79,12.0,0.2,0.6,0.9,inf,10.1,13.5,0.25,0.01,4,
creff,1,off,,,,,,,,,,,,skipped: budget cannot be met
"""


@pytest.fixture
def audit_dir(tmp_path) -> Path:
    d = tmp_path / "audit"
    d.mkdir()
    (d / "audit.csv").write_text(AUDIT_CSV)
    setting = d / "runs" / "ccvr-epsinf-secagg-off"
    setting.mkdir(parents=True)
    records = [{"target": "class-stats", "view": "plain-upload", "client": c, "class": c,
                "n": 5, "psnr": p, "prior_psnr": 10.1, "ssim": 0.1, "feature_cosine": 0.5}
               for c, p in enumerate([12.0, 19.5, 15.0, 11.0])]
    records.append({"label": "ccvr-stats", "view": "plain-upload", "client": 0, "accuracy": 1.0,
                    "precision": 1.0, "recall": 1.0})
    (setting / "attack.json").write_text(json.dumps(records))
    return d
