"""Each release is declared once, by its calibrator's ``ReleaseSpec``; an attack is a
``ReleaseAttack`` in its own file that names the labels of the releases it targets, and
everything else (the class-set inference, the privacy audit's channels and fields, the
audit sweep's list of attacked calibrators) follows from the two. A new release with its
attack, or a second attack on a release, is picked up without another edit."""

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
    ReleaseAttack,
    attacked_calibrators,
    attacks_of,
    attacks_on,
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


def test_every_attacked_release_is_found_by_its_label():
    attacked = {r.label: [a.name for a in attacks_on(r.label)] for r in declared_releases()
                if attacks_on(r.label)}
    assert attacked == {"ccvr-stats": ["stats"], "creff-grad": ["gradients"]}
    for r in declared_releases():
        for a in attacks_on(r.label):
            assert release_attack(a.name) is a and isinstance(a, ReleaseAttack)
            assert release_for(a.name) is r
    assert attacked_calibrators() == ("ccvr", "creff")
    with pytest.raises(UsageError, match="unknown release attack 'nope'"):
        release_attack("nope")
    with pytest.raises(UsageError, match="no release is attacked by 'disaggregate'"):
        release_for("disaggregate")  # on the run as a whole


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


def _noop_plan(*args, **kw):
    return None


@pytest.fixture
def scratch():
    """The registry for a test to add to, the attacks it registers taken out after it."""
    before = set(release_attacks.RELEASE_ATTACKS)
    yield
    for name in set(release_attacks.RELEASE_ATTACKS) - before:
        release_attacks.unregister(name)


def test_a_new_release_and_its_attack_plug_in(scratch):
    spec = ReleaseSpec("toy-sums", sensitivity={"s": "R"}, magnitude={"s": "R*N"})
    calibrator = type("Toy", (), {"releases": (spec,)})
    assert attacks_of(calibrator) == []  # declared, but nothing attacks it yet

    class Toy(ReleaseAttack):
        name, labels, plan = "toy", ("toy-sums",), staticmethod(_noop_plan)

    class Toy2(ReleaseAttack):  # on no calibrator's release
        name, plan = "toy2", staticmethod(_noop_plan)
        targets = ("toy-target", "class-mean")

    attack = release_attacks.register(Toy())
    assert attacks_of(calibrator) == [(spec, attack)]
    # an attack on no calibrator's release reports its targets after the declared ones'
    release_attacks.register(Toy2())
    assert target_order()[-1] == "toy-target"
    assert target_order().count("class-mean") == 1
    with pytest.raises(ValueError, match="registered twice"):
        release_attacks.register(Toy())
    release_attacks.unregister("toy")
    assert attacks_of(calibrator) == [] and "toy" not in release_attacks.RELEASE_ATTACKS


def test_a_second_attack_on_a_release_is_one_more_file(scratch, tmp_path):
    """A second attack on CCVR's release, written in a file of its own that names the
    release's label, is found beside the first: the calibrator and the first attack are
    untouched."""
    import importlib.util

    path = tmp_path / "second_stats_attack.py"
    path.write_text(
        "from privfedcal.attacks.release_attacks import ReleaseAttack, register\n\n\n"
        "def plan_means(view, opts, clients=None, classes=None):\n"
        "    return None\n\n\n"
        "class MeansAttack(ReleaseAttack):\n"
        "    name = 'means'\n"
        "    labels = ('ccvr-stats',)\n"
        "    targets = ('class-mean',)\n"
        "    plan = staticmethod(plan_means)\n\n\n"
        "ATTACK = register(MeansAttack())\n")
    spec = importlib.util.spec_from_file_location("second_stats_attack", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from privfedcal.calibration.ccvr import CCVR

    assert [a.name for a in attacks_on("ccvr-stats")] == ["stats", "means"]
    assert [a.name for _, a in attacks_of(CCVR)] == ["stats", "means"]
    assert release_for("means") is CCVR.releases[0]
    assert release_attacks.calibrator_of(module.ATTACK) == "ccvr"
    assert release_attacks.attack_names()["ccvr-stats"] == ["stats", "means"]
    from privfedcal.attacks.fields_table import declared

    assert "`attack invert --means`" in declared("query.payload", "payload", "sum").budget


def test_an_attack_is_a_plain_name_with_a_plan_or_a_run():
    with pytest.raises(ValueError, match="plain name"):
        type("Bad", (ReleaseAttack,), {"name": "--stats", "plan": staticmethod(_noop_plan)})
    with pytest.raises(ValueError, match="define plan"):
        type("Bad", (ReleaseAttack,), {"name": "bad"})


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
                                                                           scratch):
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

    class Norms(ReleaseAttack):
        name, options, targets, summary = "norms", NormOptions, ("upload-norm",), "Upload norms."
        run, report = staticmethod(_norms), staticmethod(_norm_section)

    release_attacks.register(Norms())
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
