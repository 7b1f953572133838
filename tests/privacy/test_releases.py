"""Release declarations: each calibrator declares label, keys, sensitivities and magnitudes in
its own file; the privacy code plans, noises and sizes CKKS parameters from them alone."""

from __future__ import annotations

from typing import ClassVar

import pytest

from privfedcal.calibration.ccvr import CCVR
from privfedcal.calibration.creff import CReFF
from privfedcal.errors import UsageError
from privfedcal.experiment import calibrator_class
from privfedcal.federation.hooks import CALIBRATORS, Calibrator
from privfedcal.privacy.planner import (
    participation_counts,
    planned_participants,
    protection_inputs,
    release_plans,
)
from privfedcal.privacy.releases import ReleaseSpec, evaluate
from privfedcal.settings.floors import PrivacyOptions


def test_symbol_products_by_hand():
    env = {"R": 3.0, "G": 0.5, "N": 100.0, "K": 4.0}
    assert evaluate("1", env) == 1.0
    assert evaluate("R^2*N", env) == 900.0
    assert evaluate("G*N", env) == 50.0
    with pytest.raises(ValueError):
        evaluate("R^3", env)


def test_declared_sensitivities_match_the_derivation():
    (ccvr,) = CCVR.releases
    assert ccvr.sensitivities(["count", "sum", "outer"], clip=3.0, grad_clip=9.0) == {
        "count": 1.0, "sum": 3.0, "outer": 9.0}
    (creff,) = CReFF.releases
    assert creff.sensitivities(["grad", "holders"], clip=3.0, grad_clip=0.5) == {
        "grad": 0.5, "holders": 1.0}
    with pytest.raises(UsageError, match="declares no sensitivity"):
        creff.sensitivities(["outer"], clip=1.0, grad_clip=1.0)
    assert ccvr.bounds(clip=2.0, grad_clip=1.0, examples=10.0, clients=3.0) == {
        "count": 10.0, "sum": 20.0, "outer": 40.0}


def test_a_new_calibrator_only_declares_its_releases(tiny_cfg):
    @CALIBRATORS.register("decl-test")
    class Probe(Calibrator):
        name: ClassVar[str] = "decl-test"
        releases: ClassVar[tuple] = (
            ReleaseSpec("probe-once", {"sum": "R"}, {"sum": "R*N"}, "all"),
            ReleaseSpec("probe-rounds", {"count": "1"}, {"count": "N"}, "selected"))

    try:
        cfg = tiny_cfg(calibrate="decl-test", clients=10, participation=0.3, rounds=5)
        probe = calibrator_class(cfg)  # found by name, as every run finds its calibrator
        assert probe is Probe
        plans = {p.name: p for p in release_plans(protection_inputs(PrivacyOptions.of(cfg), probe))}
        assert plans["probe-once"].steps == 1 and plans["probe-once"].sample_rate == 1.0
        assert plans["probe-rounds"].steps == max(participation_counts(PrivacyOptions.of(cfg)).values())
        assert planned_participants(protection_inputs(PrivacyOptions.of(cfg), probe)) == {"probe-once": 10, "probe-rounds": 3}
    finally:
        CALIBRATORS._items.pop("decl-test", None)


def test_noise_share_is_declared_for_every_key_or_none():
    """A release's split of its noise budget (dp.noise_stds) names every payload key with a
    positive share, or nothing (equal shares); CReFF gives its counts and holder indicators
    a tenth, the noise stage and the attacks' view use the declaration."""
    from privfedcal.attacks.view import release_budget
    from privfedcal.privacy.accounting import PrivacyAccountant
    from privfedcal.privacy.dp_accounting import DPAccounting

    with pytest.raises(ValueError, match="noise_share"):
        ReleaseSpec("x", {"a": "1", "b": "1"}, {"a": "N", "b": "N"}, noise_share={"a": 1.0})
    with pytest.raises(ValueError, match="noise_share"):
        ReleaseSpec("x", {"a": "1"}, {"a": "N"}, noise_share={"a": 0.0})
    (creff,) = CReFF.releases
    assert dict(creff.noise_share) == {"grad": 0.9, "count": 0.1, "holders": 0.1}
    assert release_budget(creff.label) == dict(creff.noise_share)
    (ccvr,) = CCVR.releases
    assert not ccvr.noise_share and release_budget(ccvr.label) is None
    dp = DPAccounting(target=8.0, delta=1e-5, accountant=PrivacyAccountant("rdp", 1e-5),
                 sigmas={creff.label: 2.0}, rates={creff.label: 1.0}, clip=1.0, grad_clip=0.5,
                 distributed=False, covers_updates=False, specs={creff.label: creff})
    assert dp.stds(["grad", "count"], creff.label) == pytest.approx(
        {"grad": 2 * 0.5 / 0.9 ** 0.5, "count": 2 / 0.1 ** 0.5})
