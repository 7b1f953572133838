"""Each release is declared once: the calibrator's ``ReleaseSpec`` names the attack, the
attack's own file registers under that name, and everything else (the class-set inference,
the privacy audit's channels and fields, the audit sweep's list of attacked calibrators)
follows from the two. A new release with its attack is picked up without another edit."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from privfedcal.attacks import release_attacks
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
    monkeypatch.setattr(RELEASE_ATTACKS, "_items", dict(RELEASE_ATTACKS._items))
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
