"""Each release is declared once: the calibrator's ``ReleaseSpec`` names the attack, the
attack's own file registers under that name, and everything else (the class-set inference,
the privacy audit's channels and fields, the audit sweep's list of attacked calibrators)
follows from the two. A new release with its attack is picked up without another edit."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest

from privfedcal.attacks import release_attacks
from privfedcal.attacks.attack_options import attack_option
from privfedcal.attacks.distinguishing.channels import CHANNEL_FIELDS, CHANNELS
from privfedcal.attacks.release_attacks import (
    RELEASE_ATTACKS,
    ReleaseAttack,
    attacked_calibrators,
    attacks_of,
    audit_params,
    declared_releases,
    release_attack,
    release_for,
    target_order,
)
from privfedcal.attacks.view import load_run
from privfedcal.errors import UsageError
from privfedcal.privacy.quantile import QUANTILE_RELEASE
from privfedcal.privacy.releases import DPSGD_RELEASE, USER_DP_RELEASE, ReleaseSpec


def test_every_declared_attack_is_registered_and_found_by_name():
    named = [r for r in declared_releases() if r.attack is not None]
    assert {r.label: r.attack for r in named} == {"ccvr-stats": "stats",
                                                  "creff-grad": "gradients"}
    for r in named:
        assert release_attack(r.attack).name == r.attack
        assert release_for(r.attack) is r
    assert attacked_calibrators() == ("ccvr", "creff")
    with pytest.raises(UsageError, match="unknown release attack 'nope'"):
        release_attack("nope")
    with pytest.raises(UsageError, match="no release is attacked by 'nope'"):
        release_for("nope")


def test_audit_channels_come_from_the_declarations():
    # the calibrators' releases first, then the channels that are not calibration releases
    assert CHANNELS == ("ccvr-stats", "creff-grad", DPSGD_RELEASE, USER_DP_RELEASE,
                        QUANTILE_RELEASE)
    assert CHANNEL_FIELDS["ccvr-stats"] == ("query.payload/payload/count",
                                            "query.payload/payload/sum",
                                            "query.payload/payload/outer")
    assert CHANNEL_FIELDS["creff-grad"] == ("query.payload/payload/grad",
                                            "query.payload/payload/count",
                                            "query.payload/payload/holders")


def test_a_new_release_and_its_attack_plug_in(monkeypatch):
    spec = ReleaseSpec("toy-sums", sensitivity={"s": "R"}, magnitude={"s": "R*N"},
                       attack="toy")
    calibrator = type("Toy", (), {"releases": (spec,)})
    assert attacks_of(calibrator) == []  # declared, but nothing attacks it yet
    monkeypatch.setattr(RELEASE_ATTACKS, "_extensions", dict(RELEASE_ATTACKS._extensions))
    attack = release_attacks.register(ReleaseAttack("toy", plan=lambda *a, **k: None))
    assert attacks_of(calibrator) == [(spec, attack)]
    # an attack on no calibrator's release reports its targets after the declared ones'
    release_attacks.register(ReleaseAttack("toy2", plan=lambda *a, **k: None,
                                           targets=("toy-target", "class-mean")))
    assert target_order()[-1] == "toy-target"
    assert target_order().count("class-mean") == 1
    with pytest.raises(ValueError, match="registered twice"):
        release_attacks.register(ReleaseAttack("toy", plan=lambda *a, **k: None))


def test_the_attack_name_is_a_plain_name():
    with pytest.raises(ValueError, match="plain name"):
        ReleaseSpec("x", sensitivity={"s": "R"}, magnitude={"s": "R"}, attack="--stats")


def test_report_order_and_audit_options_come_from_the_attacks():
    """The report lists record targets in the declared releases' order (CCVR's statistics
    before CReFF's gradients and the model updates attacked with them), and the audit trains
    CReFF with its server-side optimisation cut (the attack reads the uploads only); an
    attack on the run as a whole (disaggregation across rounds) comes after them."""
    assert target_order() == ("raw-feature", "class-mean", "class-stats", "class-gradient",
                              "class-gradient-rounds", "model-update", "disaggregate")
    assert audit_params("creff") == {"match_steps": 50, "retrain_steps": 100}
    assert audit_params("ccvr") == {} and audit_params("none") == {}


def _written_targets() -> set[str]:
    """Every ``"target": "<name>"`` an attack file's records carry."""
    found = set()
    for path in (Path(release_attacks.__file__).parent).rglob("*_attack.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values, strict=True):
                    if (isinstance(k, ast.Constant) and k.value == "target"
                            and isinstance(v, ast.Constant)):
                        found.add(v.value)
    return found


def test_every_target_an_attack_writes_has_a_place_in_the_report():
    written = _written_targets()
    assert {"class-stats", "class-gradient", "model-update"} <= written  # the scan sees them
    assert written <= set(target_order()), written - set(target_order())


@dataclasses.dataclass(frozen=True)
class NormOptions:
    scale: float = attack_option(1.0, "Multiply every norm by this (> 0).")

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise UsageError(f"--scale must be > 0, got {self.scale}")


def _norms(view, opts: NormOptions):
    """One record per plain upload: the L2 norm of all its tensors (times ``scale``)."""
    records = [{"target": "upload-norm", "label": e["label"], "client": int(e["client"]),
                "norm": opts.scale * math.sqrt(sum(float(t.double().pow(2).sum())
                                                   for t in e["tensors"].values()))}
               for e in view.entries if e["view"] == "plain-upload"]
    return records, []


def _norm_section(records):
    return release_attacks.ReportTable(("uploads", "largest norm"),
                                       [[len(records), max(r["norm"] for r in records)]],
                                       numeric=(True, True), notes=("Upload norms.",))


def test_a_registered_attack_is_a_command_an_api_kind_and_a_report_section(tiny_cfg, tmp_path,
                                                                           monkeypatch):
    """An attack on the run as a whole, registered with its options type and report section,
    is ``privfedcal attack <name>`` (its flags from its options), a kind of
    ``privfedcal.attack`` and a section of the run report, with nothing else written."""
    import privfedcal
    from privfedcal.cli.main import main
    from privfedcal.experiment import build_simulator
    from privfedcal.report.run_report import build_run_report

    run = tmp_path / "run"
    build_simulator(tiny_cfg(method="ccvr", rounds=1, transcript=True, out=str(run)), run).run()
    with pytest.raises(UsageError, match="attack kind must be one of"):
        privfedcal.attack(run, "norms")
    monkeypatch.setattr(RELEASE_ATTACKS, "_extensions", dict(RELEASE_ATTACKS._extensions))
    monkeypatch.setattr(release_attacks, "_ORDER", list(release_attacks._ORDER))
    release_attacks.register(ReleaseAttack(
        "norms", plan=None, run=_norms, options=NormOptions, targets=("upload-norm",),
        summary="Upload norms.", report=_norm_section))
    records = privfedcal.attack(run, "norms", scale=2.0)
    plain, _ = _norms(load_run(run), NormOptions())
    assert records and len(records) == len(plain)
    assert [r["norm"] for r in records] == pytest.approx([2 * r["norm"] for r in plain])
    with pytest.raises(UsageError, match="window"):
        privfedcal.attack(run, "norms", window=3)
    main(["attack", "norms", str(run), "--scale", "2"])
    assert json.loads((run / "attack-norms" / "attack.json").read_text()) == records
    with pytest.raises(SystemExit) as stop:  # its own check, one line, exit 2
        main(["attack", "norms", str(run), "--scale", "0", "--overwrite"])
    assert stop.value.code == 2
    page = build_run_report(run).read_text()
    assert "largest norm" in page and "Upload norms." in page


def test_attack_invert_combines_only_attacks_that_join():
    offered = [release_attack(n) for n in ("stats", "gradients", "updates")]
    stats, gradients, updates = offered
    release_attacks.check_combination([gradients, updates], offered)
    release_attacks.check_combination([updates], offered)
    with pytest.raises(UsageError, match=r"^give exactly one of --stats or --gradients "
                                          r"\(and/or --updates\)$"):
        release_attacks.check_combination([], offered)
    with pytest.raises(UsageError, match="exactly one"):
        release_attacks.check_combination([stats, gradients], offered)
    with pytest.raises(UsageError, match="^--updates goes with --gradients or alone, not with "
                                         "--stats$"):
        release_attacks.check_combination([stats, updates], offered)
    # the quick run to attack trains the calibrator whose release the attack targets
    assert [release_attacks.calibrator_of(a) for a in offered] == ["ccvr", "creff", "creff"]
