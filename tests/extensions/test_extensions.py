"""Extensions are one file each: a toy local method, a toy calibrator with payload keys no
other file names, a toy protection stage with its own set-up and resume state, a toy
protection of the model updates (its own test: test_toy_update.py), and a toy attack, each defined in one file of this folder, run through ``privfedcal.train``,
``privfedcal.attack``, ``privfedcal.audit_dp`` and the report with nothing else changed.

The toys are imported in a child process: they register themselves in the package's
registries, which the rest of the suite reads (tests parametrised over every method, the
settings table), so this process never imports them.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import privfedcal

HERE = Path(__file__).resolve().parent
PACKAGE = Path(privfedcal.__file__).resolve().parent
#: each toy's file and who writes it
TOYS = ("toy_method", "toy_calibrator", "toy_stage", "toy_update", "toy_attack")


def _present(name: str) -> bool:
    return (HERE / f"{name}.py").is_file()


def _need(*names: str) -> None:
    """Every toy must be there: a missing one fails (it would otherwise prove nothing)."""
    missing = [f"tests/extensions/{n}.py" for n in names if not _present(n)]
    assert not missing, f"{', '.join(missing)} missing"


def declared_names(path: Path) -> list[str]:
    """The string constants a toy assigns to module-level UPPER_CASE names (its method,
    calibrator, release, payload key, stage and attack names)."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and all(
                isinstance(t, ast.Name | ast.Tuple) for t in node.targets):
            names = [n.id for t in node.targets
                     for n in (t.elts if isinstance(t, ast.Tuple) else [t])
                     if isinstance(n, ast.Name)]
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            out += [v.value for n, v in zip(names, values, strict=False)
                    if n.isupper() and isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return out


@pytest.mark.parametrize("toy", TOYS)
def test_no_package_file_names_the_toy(toy):
    _need(toy)
    names = declared_names(HERE / f"{toy}.py")
    assert names, f"{toy}.py declares no NAME constants"
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        found = [n for n in names if n in text]
        assert not found, f"{path.relative_to(PACKAGE.parent)} names {found}"


def test_declared_names_reads_module_constants(tmp_path):
    src = tmp_path / "t.py"
    src.write_text('NAME = "a"\nX, Y = "b", "c"\nlower = "d"\nN = 3\n')
    assert declared_names(src) == ["a", "b", "c"]


# ---- the end-to-end run, in a child process -------------------------------------------------

CHILD = r"""
import json, sys, tempfile
from pathlib import Path

sys.path.insert(0, sys.argv[1])
present = set(sys.argv[2].split(","))
import privfedcal
import toy_calibrator
import toy_method

out = {}
base = dict(dataset="digits", clients=4, alpha=0.5, rounds=2, local_epochs=1, batch_size=32,
            threads=1, seed=0, data_seed=0, progress=False)
# the method, trained one client after another and vectorised (its declared vector loss)
quick = {**base, "rounds": 1, "transcript": False}
out["train_losses"] = [
    [m["train_loss"] for m in privfedcal.train(method=toy_method.NAME, client_batch=k,
                                               method_params={"smoothing": 0.2}, **quick).metrics]
    for k in (1, 2)]
settings = {}
if "toy_stage" in present:
    import toy_stage
    settings.update(toy_stage.SETTINGS)
with tempfile.TemporaryDirectory() as tmp:
    # the calibrator under DP (with the stage, once written), through the API
    run = privfedcal.train(method=toy_method.NAME, calibrate=toy_calibrator.NAME, dp_eps=8.0,
                           out=Path(tmp) / "run", **base, **settings)
    summary = run.summary
    out["calibration"] = dict(summary["calibration"])
    out["noise_multipliers"] = dict(summary["privacy"]["noise_multipliers"])
    index = json.loads((run.server_view / "transcript" / "index.json").read_text())
    out["transcript"] = sorted({(e["label"], e["view"]) for e in index})
    if "toy_stage" in present:  # its state is saved with the checkpoint and restored
        # (without DP: a DP run's rounds are fixed by its budget, it cannot be extended)
        staged = privfedcal.train(method=toy_method.NAME, calibrate=toy_calibrator.NAME,
                                  out=Path(tmp) / "staged", transcript=False, **base,
                                  **settings)
        privfedcal.resume(staged, rounds=3)
        out["stage"] = toy_stage.evidence(staged.path)
    if "toy_attack" in present:
        import toy_attack
        out["attack"] = [dict(r) for r in privfedcal.attack(run, toy_attack.NAME, steps=20)]
        # the same attack from the command line: its flag and options come from the registry
        from privfedcal.cli.main import main
        try:
            main(["attack", "invert", f"--{toy_attack.NAME}", str(run.path), "--steps", "20",
                  "--restarts", "1", "--toy-samples", "1", "--threads", "1", "--quiet"])
            out["cli_exit"] = 0
        except SystemExit as exc:
            out["cli_exit"] = exc.code
        cli_json = run.path / f"attack-{toy_attack.NAME}" / "attack.json"
        out["cli_attack"] = json.loads(cli_json.read_text()) if cli_json.is_file() else []
        audit = privfedcal.audit_dp(method=toy_method.NAME, calibrate=toy_calibrator.NAME,
                                    dp_eps=8.0, trials=500, budget_s=1, one_run=False,
                                    channels=[toy_calibrator.TOY_RELEASE], **base)
        out["audit"] = [dict(r) for r in audit.rows]
    out["report"] = Path(privfedcal.write_report(run)).read_text()
print(json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def child():
    _need("toy_method", "toy_calibrator")
    present = ",".join(t for t in TOYS if _present(t))
    env = {**os.environ, "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(HERE), present],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_toy_method_trains_plain_and_vectorised(child):
    plain, vectorised = child["train_losses"]
    assert len(plain) == 1 and all(v > 0 for v in plain)
    assert vectorised == pytest.approx(plain, rel=1e-4)


def test_the_toy_calibrator_runs_under_dp_from_its_declaration(child):
    """Its release is planned, noised, recorded in the server's view and reported, with
    its label and keys declared in its own file only."""
    label = "toy-moments"
    assert label in declared_names(HERE / "toy_calibrator.py")
    calibration = child["calibration"]
    assert calibration["name"] == label and calibration["retrain_steps"] == 0
    assert len(calibration["mean_feature_norm"]) == 10  # one per digit class
    assert child["noise_multipliers"][label] > 0
    assert [label, "plain-upload"] in child["transcript"]
    assert f"client_release_limits.{label}" in child["report"]


def test_the_toy_stage_runs_and_resumes(child):
    """``toy_stage.evidence(run_dir)`` reads the run folder: the stage ran in every round
    and its own state came back from the checkpoint when the run was resumed."""
    _need("toy_stage")
    assert child["stage"]["ran"] and child["stage"]["resumed"], child["stage"]


def test_the_toy_attack_attacks_and_audits_the_toy_release(child):
    _need("toy_attack")
    assert child["attack"]
    assert [r["channel"] for r in child["audit"]] == ["toy-moments"]


def test_the_toy_attack_runs_from_the_cli_into_the_report(child):
    """``privfedcal attack invert --toy_attack RUN`` (its flag and ``--toy-samples`` from the
    registry) writes RUN/attack-toy_attack/, and the run's report shows the toy's section
    (its table's column and its note, from ``toy_attack.section``)."""
    _need("toy_attack")
    assert child["cli_exit"] == 0
    records = child["cli_attack"]
    assert records and {r["target"] for r in records} == {"toy-class-mean"}
    # --toy-samples 1: one class per attacked client (the API's default of 2 gives more)
    per_client = [r["client"] for r in records]
    assert len(per_client) == len(set(per_client))
    assert len(child["attack"]) > len(records)
    report = child["report"]
    assert "<h3>attack-toy_attack</h3>" in report
    assert "mean PSNR (dB)" in report
    assert "mean feature inverted into one image" in report
