"""The typed results (privfedcal/results/): every record the writers write reads as its type
in strict mode (no unknown key, no missing required key, every value of its type), on
tiny real runs, attacks and DP audits; the check itself on generated values; the docs
section generated from the types; mypy --strict on the types and the API."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import privfedcal
from privfedcal import results as R
from privfedcal.errors import Diverged, UsageError
from privfedcal.results import markdown
from privfedcal.results.check import keys_of, nested, required, strip, validate

ROOT = Path(__file__).resolve().parents[2]
FAST = dict(clients=3, rounds=2, local_epochs=1, device="cpu", threads=1)

#: runs whose files are checked, with a key their summary must have (so that each variant
#: exercises the writer it is here for)
VARIANTS: dict[str, tuple[dict[str, typing.Any], str]] = {
    "ccvr": (dict(method="ccvr"), "calibration"),
    "ccvr-dp": (dict(method="ccvr", dp_eps=8), "privacy.epsilon_spent"),
    "ccvr-secagg": (dict(method="ccvr", secagg=True), "privacy.whole_run"),
    "fedavg": (dict(method="fedavg"), "rejected_uploads"),
    "creff": (dict(method="creff"), "creff_release_rounds"),
    "creff-dp-secagg": (dict(method="creff", dp_eps=8, secagg=True, hide_counts=True),
                        "privacy.secagg"),
    "dp-train": (dict(method="fedavg", dp_eps=8, dp_train=True), "privacy.releases"),
    "secagg-updates": (dict(method="fedavg", secagg_updates=True), "privacy.secagg_updates"),
    "oracle": (dict(method="fedavg", calibrate="oracle"), "calibration"),
    "seeded-noise": (dict(method="ccvr", dp_eps=8, insecure_seeded_noise=True),
                     "privacy.insecure"),
    "user-dp": (dict(method="ccvr", dp_eps=8, dp_updates=True), "privacy.user_dp"),
    "user-dp-adaptive": (dict(method="fedavg", dp_eps=8, dp_updates=True,
                              dp_adaptive_clip=True), "privacy.user_dp.adaptive_clip.lr"),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Each variant's run, trained on first use and kept for the module's tests."""
    runs: dict[str, privfedcal.Run] = {}
    base = tmp_path_factory.mktemp("runs")

    def get(name: str) -> privfedcal.Run:
        if name not in runs:
            runs[name] = privfedcal.train(out=base / name, **FAST, **VARIANTS[name][0])
        return runs[name]

    return get


def _has(record: dict, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(record, dict) or part not in record:
            return False
        record = record[part]
    return True


#: the longest variant runs with the slow tests (CKKS keys per round); its keys are the others'
SLOW = {"creff-dp-secagg"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in VARIANTS])
def test_a_runs_summary_and_metrics_read_as_their_types(trained, name):
    run = trained(name)
    for folder in (run.path, run.server_view):
        raw = json.loads((folder / "summary.json").read_text())
        summary = R.summary_from_dict(raw, where=str(folder / "summary.json"))
        assert summary is raw  # the same dict, typed: files and API agree
    assert _has(run.summary, VARIANTS[name][1])
    lines = (run.path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == FAST["rounds"]
    for i, line in enumerate(lines):
        R.metrics_row_from_dict(json.loads(line), where=f"metrics.jsonl:{i + 1}")


def test_a_diverged_runs_summary_reads_as_a_summary(tmp_path):
    with pytest.raises(Diverged):
        privfedcal.train(method="fedavg", lr=1e6, out=tmp_path / "div", **FAST)
    summary = R.summary_from_dict(json.loads((tmp_path / "div" / "summary.json").read_text()))
    assert summary["accuracy"] is None and summary["diverged"]["round"] == 1
    assert "loss" not in summary  # a diverged run's summary has no final evaluation


@pytest.mark.flower
def test_a_flower_runs_summary_reads_as_a_summary(tmp_path):
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict

    from privfedcal.flower.client_app import app as client_app
    from privfedcal.flower.grid import InProcessGrid
    from privfedcal.flower.records import FlowerOptions, to_run_config
    from privfedcal.flower.server_app import run_server

    cfg = privfedcal.RunConfig.of(method="ccvr", transcript=False, **{**FAST, "clients": 2,
                                                                   "rounds": 1})
    run_config = to_run_config(cfg.replace(out=str(tmp_path / "flower")),
                               FlowerOptions(hold=0.01))
    grid = InProcessGrid(client_app, run_config, cfg.data.clients, node_config={"data-seed": 0})
    run_server(grid, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                             run_config=run_config))
    summary = R.summary_from_dict(json.loads((tmp_path / "flower" / "summary.json").read_text()))
    assert summary["dropped_clients"] == [] and summary["flower_holds"]["sent"] > 0


def test_the_progress_records_of_evaluated_rounds_are_metrics_rows(tmp_path):
    from privfedcal.experiment import build_simulator

    cfg = privfedcal.RunConfig.of(method="creff", out=str(tmp_path / "p"), **FAST)
    rows: list[dict] = []
    build_simulator(cfg, tmp_path / "p").run(progress=rows.append)
    assert [r["round"] for r in rows] == [1, 2]
    for row in rows:
        R.metrics_row_from_dict(row)


def _records_read_back(records: list[dict], tmp_path: Path) -> list[dict]:
    """``records`` as ``attack.json`` holds them (``attacks/reconstruction/scoring.py`` ``write_records``)."""
    from privfedcal.attacks.reconstruction.scoring import write_records

    path = write_records(records, tmp_path / "attack.json")
    return json.loads(path.read_text())


def _check_records(records: list[dict], tmp_path: Path) -> set[str]:
    assert records
    for form in (records, _records_read_back(records, tmp_path)):
        for i, record in enumerate(form):
            R.attack_record_from_dict(record, where=f"record {i}")
    return {r["target"] for r in records}


def test_an_attack_on_ccvr_statistics_gives_inversion_records(trained, tmp_path):
    records = privfedcal.attack(trained("ccvr"), "stats", steps=5, restarts=1, clients=[0])
    assert _check_records(records, tmp_path) == {"raw-feature", "class-mean", "class-stats"}
    assert all("psnr" in r for r in records)  # scored: the clients' data are at hand


def test_class_inference_gives_class_set_records_scored_and_unscored(trained, tmp_path):
    run = trained("ccvr")
    assert _check_records(privfedcal.attack(run, "classes"), tmp_path) == {"class-set"}
    view = shutil.copytree(run.server_view, tmp_path / "view")
    unscored = privfedcal.attack(view, "classes")
    assert _check_records(unscored, tmp_path) == {"class-set"}
    assert all(r["scored"] is False for r in unscored)
    aggregate = privfedcal.attack(trained("ccvr-secagg"), "classes")
    assert _check_records(aggregate, tmp_path) == {"class-set"}
    assert [r["view"] for r in aggregate] == ["aggregate"]  # the federation's set only


def test_attacks_on_creff_give_gradient_and_update_records(trained, tmp_path):
    run = trained("creff")
    grads = privfedcal.attack(run, "gradients", steps=5, restarts=1, clients=[1])
    assert _check_records(grads, tmp_path) >= {"class-gradient"}
    updates = privfedcal.attack(run, "updates", steps=2, restarts=1, clients=[1])
    assert _check_records(updates, tmp_path) == {"model-update"}


def test_an_unscored_inversion_reads_as_an_inversion_record(trained, tmp_path):
    view = shutil.copytree(trained("ccvr").server_view, tmp_path / "view")
    records = privfedcal.attack(view, "stats", steps=3, restarts=1, clients=[0])
    _check_records(records, tmp_path)
    assert all(r["scored"] is False and "psnr" not in r for r in records)


def test_disaggregation_records_read_as_their_type(trained, tmp_path):
    from privfedcal.attacks.reconstruction.disaggregate_attack import disaggregate_run
    from privfedcal.attacks.reconstruction.runner import load_run

    records, _ = disaggregate_run(load_run(trained("secagg-updates").path))
    assert _check_records(records, tmp_path) == {"disaggregate"}


def test_a_partial_attack_json_reads_as_its_type(trained, tmp_path):
    import torch

    from privfedcal.attacks.reconstruction.resume import write_partial
    from privfedcal.attacks.reconstruction.scoring import Attacked

    records = privfedcal.attack(trained("ccvr"), "classes")
    done = {i: Attacked(r, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
            for i, r in enumerate(records[:2])}
    keys = [f"target {i}" for i in range(len(records))]
    write_partial(tmp_path / "attack.json", tmp_path / "images.safetensors",
                  {"attack": "classes", "steps": 5}, keys, done)
    partial = R.partial_attack_from_dict(json.loads((tmp_path / "attack.json").read_text()))
    assert partial["targets_done"] == 2 and partial["targets_planned"] == len(records)


def test_dp_audit_rows_read_as_their_type(tmp_path):
    from privfedcal.attacks.distinguishing.games import COLUMNS, read_csv
    from privfedcal.jobs import audit_dp

    audit = audit_dp(method="ccvr", dp_eps=8.0, **{**FAST, "rounds": 1}, trials=200,
                     budget_s=30, channels="ccvr-stats", out=tmp_path)
    for row in audit.rows:
        R.dp_audit_row_from_dict(row)
    assert [r["channel"] for r in audit.rows] == ["ccvr-stats", "ccvr-stats (one run)"]
    assert [r["trials"] for r in audit.rows] == [400, 1]
    # dp_audit.csv keeps the first keys of a row, in the type's order
    assert COLUMNS == tuple(keys_of(R.DPAuditRow))[:len(COLUMNS)]
    assert [set(r) for r in read_csv(tmp_path / "dp_audit.csv")] == [set(COLUMNS)] * 2


# ---- the check itself -----------------------------------------------------------------------

def _kinds() -> list[typing.Any]:
    found: list[typing.Any] = []
    for top, _, _ in markdown.TOP:
        found += [k for k in nested(top) if k not in found]
    return found


def _has_any(kind: typing.Any) -> bool:
    """Whether a key of ``kind`` is typed with ``Any`` somewhere (hypothesis draws no Any)."""
    return any("Any" in str(strip(ann)[0]) for ann in keys_of(kind).values())


KINDS = _kinds()


@pytest.mark.parametrize("kind", [k for k in KINDS if not _has_any(k)],
                         ids=lambda k: k.__name__)
@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_a_value_of_a_type_passes_and_any_change_to_its_keys_fails(kind, data):
    value = data.draw(st.from_type(kind))
    validate(kind, value, strict=True, where=kind.__name__)
    with_extra = {**value, "no_such_key": 1}
    with pytest.raises(UsageError, match="unknown key.s. no_such_key"):
        validate(kind, with_extra, strict=True, where=kind.__name__)
    validate(kind, with_extra, strict=False, where=kind.__name__)  # kept, untyped
    for key in required(kind):
        with pytest.raises(UsageError, match=f"misses key.s. {key}$"):
            validate(kind, {k: v for k, v in value.items() if k != key}, strict=False,
                     where=kind.__name__)
    key = data.draw(st.sampled_from(sorted(value)))
    if strip(keys_of(kind)[key])[0] is not typing.Any:
        with pytest.raises(UsageError, match=f"^{kind.__name__}: {key}"):
            validate(kind, {**value, key: object()}, strict=True, where=kind.__name__)


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s["privacy"]["secagg"].update(min_clients="two"),
     "summary.json: privacy.secagg.min_clients: expected int, got 'two'"),
    (lambda s: s["privacy"]["secagg"]["params"]["ccvr-stats"].update(extra=1),
     r"summary.json: privacy.secagg.params\['ccvr-stats'\]: unknown key\(s\) extra of "
     "CKKSParams"),
    (lambda s: s.update(rounds=True), "summary.json: rounds: expected int, got True"),
    (lambda s: s.update(rounds=2.0), "summary.json: rounds: expected int, got 2.0"),
    (lambda s: s["per_class_accuracy"].__setitem__(1, "x"),
     r"summary.json: per_class_accuracy\[1\]: expected float, got 'x'"),
    (lambda s: s.pop("notes"), "summary.json: Summary misses key.s. notes"),
])
def test_a_bad_summary_is_one_line_naming_the_path(trained, change, message):
    summary = json.loads((trained("ccvr-secagg").path / "summary.json").read_text())
    change(summary)
    with pytest.raises(UsageError, match=f"^{message}") as info:
        R.summary_from_dict(summary)
    assert "\n" not in str(info.value)


def test_an_attack_record_is_told_apart_by_its_target():
    record = {"target": "no-such-target", "client": 0, "class": None}
    with pytest.raises(UsageError, match="target='no-such-target' is none of InversionRecord"):
        R.attack_record_from_dict(record)
    with pytest.raises(UsageError, match="ClassSetRecord misses key"):
        R.attack_record_from_dict({"target": "class-set", "class": None})


def test_floats_take_ints_and_numbers_refuse_bools():
    validate(R.Evaluation, {"round": 1, "accuracy": 1}, strict=True, where="e")
    with pytest.raises(UsageError, match="accuracy: expected float, got False"):
        validate(R.Evaluation, {"round": 1, "accuracy": False}, strict=True, where="e")
    with pytest.raises(UsageError, match="round: expected int, got 1.5"):
        validate(R.Evaluation, {"round": 1.5, "accuracy": 1.0}, strict=True, where="e")


# ---- docs and types -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_every_key_and_type_is_documented(kind):
    docs = R.field_docs(kind)
    assert docs and all(text.strip() for text in docs.values()), docs
    assert (kind.__doc__ or "").strip()


def test_the_api_page_holds_the_generated_result_types():
    page = (ROOT / "docs" / "api.md").read_text()
    assert markdown.committed(page) == markdown.section(), (
        "docs/api.md's section 'Result types' differs from the types: run "
        "python -m privfedcal.results --write")


def test_the_section_is_replaced_in_place_and_appended_once(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Page\n\ntext\n")
    assert markdown.write(page)
    once = page.read_text()
    assert once.count(markdown.START) == 1 and once.startswith("# Page\n\ntext\n\n")
    page.write_text(once.replace("## Result types", "## Stale") + "\n## After\n")
    assert markdown.write(page) and not markdown.write(page)
    again = page.read_text()
    assert again.count("## Result types") == 1 and again.endswith("## After\n")
    out = subprocess.run([sys.executable, "-m", "privfedcal.results", "--markdown"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out == markdown.section()


def test_result_types_pass_mypy_strict():
    pytest.importorskip("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                           "--ignore-missing-imports", "--no-incremental",
                           "privfedcal/results/", "privfedcal/api/__init__.py", "privfedcal/api/run.py",
                           "privfedcal/api/attacking.py"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
