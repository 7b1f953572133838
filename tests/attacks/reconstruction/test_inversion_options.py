"""The shared inversion options and the audit's defaults, declared apart from the runner."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from privfedcal.attacks.reconstruction import engine, runner
from privfedcal.attacks.reconstruction.inversion_options import (
    AUDIT_DEFAULTS,
    AUDIT_INVERSION_OPTIONS,
    InversionOptions,
    audit_flags,
)
from privfedcal.errors import UsageError


def test_defaults_are_the_engines_and_the_runner_re_exports_the_same_type() -> None:
    opts = InversionOptions()
    assert (opts.steps, opts.restarts, opts.attack_batch) == (
        engine.DEFAULT_MAX_STEPS, 4, engine.DEFAULT_ATTACK_BATCH)
    assert opts.inversion == engine.InversionConfig(steps=opts.steps, restarts=4)
    assert runner.InversionOptions is InversionOptions


def test_the_audit_takes_three_fields_with_its_one_override() -> None:
    flags = {f.name: f for f in audit_flags()}
    assert tuple(flags) == AUDIT_INVERSION_OPTIONS
    assert flags["restarts"].default == AUDIT_DEFAULTS["restarts"] == 2
    assert flags["steps"].default == engine.DEFAULT_MAX_STEPS


@pytest.mark.parametrize("bad", [{"steps": 0}, {"restarts": 0}, {"max_n": 0},
                                 {"attack_batch": 0}, {"false_positive_rate": 1.0}])
def test_bad_values_are_refused_in_one_line(bad) -> None:
    with pytest.raises(UsageError) as err:
        InversionOptions(**bad)
    assert "\n" not in str(err.value)


def test_the_declarations_load_no_scoring_library() -> None:
    """Building ``attack``/``audit`` flags must not import torchmetrics (and with it
    matplotlib and torchvision), which a default ``privfedcal train`` never needs."""
    code = ("import json, sys\n"
            "import privfedcal.attacks.reconstruction.inversion_options as m\n"
            "m.audit_flags()\n"
            "print(json.dumps(sorted(k.split('.')[0] for k in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    loaded = set(json.loads(out))
    assert "torch" in loaded
    assert loaded.isdisjoint({"torchmetrics", "matplotlib", "torchvision"}), loaded
