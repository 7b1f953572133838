"""The settings' one description (privfedcal/settings/catalogue.py) and what is derived from it: the
``train`` / ``partition`` options, settings-file type checks and the docs tables."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st

from privfedcal.cli.main import app, main
from privfedcal.cli.train_command import resolve_config
from privfedcal.errors import UsageError
from privfedcal.settings.catalogue import (
    CALIBRATION_SETTINGS,
    METHOD_SETTINGS,
    FlowerOptions,
    Setting,
    all_settings,
    check_value,
    cli_settings,
    rewrite,
    settings_of,
    stale_docs,
    usage_table,
)
from privfedcal.settings.run_config import RunConfig, load_toml

ROOT = Path(__file__).resolve().parents[2]


def _command(name: str):
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def _one_error_line(args, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert exc.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- the description ----------------------------------------------------------------------
def test_every_runconfig_field_is_described_with_its_default_and_type():
    described = {s.name: s for s in settings_of(RunConfig, "run")}
    default = RunConfig()
    assert list(described) == list(default.to_dict())
    assert described["imbalance_factor"].default == default.data.imbalance_factor == 10.0
    assert (described["rounds"].type, described["rounds"].optional) == (int, False)
    assert (described["lr"].type, described["lr"].optional) == (float, True)
    assert (described["augment"].type, described["augment"].optional) == (bool, True)
    assert described["method_params"].type is dict
    assert all(s.help and s.group for s in all_settings())


def test_flower_options_defaults_are_the_described_ones():
    """docs/flower.md once said 3600/300 s and the example app 600/120 s: one source now."""
    flower = {s.name: s.default for s in settings_of(FlowerOptions, "flower")}
    assert flower == {"round_timeout": 3600.0, "poll_interval": 0.2, "node_wait": 300.0,
                      "key_holder": 0, "min_replies": 0, "hold": 0.0}
    assert FlowerOptions() == FlowerOptions(**flower)


def test_partition_help_names_every_scheme():
    from privfedcal.data.partition import PARTITIONS

    (s,) = [s for s in settings_of(RunConfig, "run") if s.name == "partition"]
    assert s.help.split(" | ") == list(PARTITIONS)


# ---- types ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, value, want", [
    (float, 3, 3.0), (float, 0.5, 0.5), (int, 7, 7), (str, "x", "x"), (bool, False, False),
])
def test_check_value_accepts_and_widens(kind, value, want):
    got = check_value(Setting("x", kind, None, "h", "Data"), value)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("kind, value, words", [
    (int, 3.0, "an integer"), (int, True, "an integer"), (float, "1", "a number"),
    (float, False, "a number"), (str, 1, "a string"), (bool, 1, "true or false"),
    (int, None, "an integer"), (dict, 3, "a table"),
])
def test_check_value_refuses_wrong_types(kind, value, words):
    with pytest.raises(UsageError, match=f"where: x must be {words}"):
        check_value(Setting("x", kind, None, "h", "Data"), value, "where: ")


@given(st.integers(-10**6, 10**6) | st.floats(allow_nan=False))
def test_optional_float_takes_none_and_any_number(value):
    s = Setting("x", float, None, "h", "Data", optional=True)
    assert check_value(s, None) is None
    assert check_value(s, value) == float(value)


@pytest.mark.parametrize("text, needle", [
    ('rounds = "3"', "rounds must be an integer, got '3'"),
    ("alpha = true", "alpha must be a number, got True"),
    ("secagg = 1", "secagg must be true or false, got 1"),
    ("clients = 2.5", "clients must be an integer, got 2.5"),
    ("method_params = 3", "method_params must be a table"),
    ("[calibration_params]\nvirtual_per_class = 1.5",
     "calibration_params.virtual_per_class must be an integer, got 1.5"),
    ('[calibration_params]\ntukey = "yes"', "calibration_params.tukey must be true or false"),
])
def test_wrong_type_in_a_settings_file_is_one_line_and_exit_2(tmp_path, capsys, text, needle):
    conf = tmp_path / "bad.toml"
    conf.write_text(text + "\n")
    line = _one_error_line(["train", "--config", str(conf)], capsys)
    assert line.startswith("privfedcal: error: config file ") and needle in line, line


def test_a_method_hyperparameter_of_the_wrong_type_is_one_line_and_exit_2(tmp_path, capsys):
    """Method hyperparameters are checked by the method's own Params when the run is built
    (which names are valid depends on the method)."""
    conf = tmp_path / "bad.toml"
    conf.write_text('method = "fedprox"\n[method_params]\nmu = "big"\n')
    line = _one_error_line(["train", "--config", str(conf)], capsys)
    assert "fedprox: mu must be a finite number, got 'big'" in line, line
    conf.write_text('[method_params]\nmu = 0.1\n')  # fedavg has no mu
    line = _one_error_line(["train", "--config", str(conf)], capsys)
    assert "method 'fedavg' takes no mu" in line, line


def test_settings_file_values_arrive_typed(tmp_path):
    from privfedcal.algorithms import create_algorithm

    conf = tmp_path / "ok.toml"
    conf.write_text("alpha = 1\ndp-eps = 4\n[method_params]\nmu = 1\n"
                    "[calibration_params]\nvirtual-per-class = 20\nccvr_steps = 3\n")
    got = load_toml(conf)
    assert got["alpha"] == 1.0 and type(got["alpha"]) is float and got["dp_eps"] == 4.0
    assert got["method_params"] == {"mu": 1}
    mu = create_algorithm("fedprox", num_classes=3, **got["method_params"]).params.mu
    assert mu == 1.0 and type(mu) is float  # the Params' declared type
    # a name without a flag is left to the calibrator's own check
    assert got["calibration_params"] == {"virtual_per_class": 20, "ccvr_steps": 3}


# ---- the CLI options ----------------------------------------------------------------------
def test_train_has_one_option_per_cli_setting_with_its_help_and_default():
    params = {p.name: p for p in _command("train").params}
    for s in cli_settings():
        p = params[s.name]
        assert s.flag_name in p.opts, (s.name, p.opts)
        assert p.help == s.help and p.default is None
        assert p.show_default == (s.shown_default or False)
    assert params["imbalance_factor"].show_default == "10.0"
    assert params["lr"].show_default == "per model, see docs/usage.md"
    assert params["mu"].show_default == "the method's"
    assert params["hide_counts"].secondary_opts == ["--show-counts"]
    described = {s.name for s in cli_settings()}
    assert set(params) - described == {"config", "resume", "report", "log", "quiet"}
    # every run setting but the two tables has a flag (min_size had none before)
    assert {s.name for s in settings_of(RunConfig, "run") if s.type is not dict} <= described
    assert {s.name for s in METHOD_SETTINGS + CALIBRATION_SETTINGS} <= described


def test_help_groups_follow_the_description():
    params = {p.name: p for p in _command("train").params}
    assert params["dp_eps"].rich_help_panel == "Privacy"
    assert params["virtual_per_class"].rich_help_panel == "Calibration"
    assert params["threads"].rich_help_panel == "Hardware"


def test_partition_options_are_trains():
    train = {p.name: p for p in _command("train").params}
    part = {p.name: p for p in _command("partition").params}
    shared = set(part) - {"config", "out", "overwrite"}
    assert "imbalance_factor" in shared and "min_size" in shared
    for name in shared:
        assert (part[name].help, part[name].show_default, part[name].opts) == \
            (train[name].help, train[name].show_default, train[name].opts)


def test_no_flag_gives_runconfig_defaults():
    flags = {s.name: None for s in cli_settings()}
    assert resolve_config(None, flags) == RunConfig()
    cfg = resolve_config(None, {**flags, "mu": 0.5, "tukey": False, "min_size": 3})
    assert cfg.method_params == {"mu": 0.5} and cfg.calibration_params == {"tukey": False}
    assert cfg.data.min_size == 3


def test_min_size_flag_reaches_the_partition(tmp_path, capsys):
    """``train --min-size`` (new: only ``partition`` had it) splits as ``partition`` does."""
    import json

    flags = ["--clients", "3", "--min-size", "200", "--seed", "4"]
    main(["train", *flags, "--rounds", "1", "--local-epochs", "1", "--threads", "1",
          "--no-transcript", "--out", str(tmp_path / "run")])
    main(["partition", *flags, "--out", str(tmp_path / "p")])
    capsys.readouterr()
    used = json.loads((tmp_path / "run" / "private" / "partition.json").read_text())
    shown = json.loads((tmp_path / "p" / "partition.json").read_text())
    assert used["min_size"] == 200 and min(used["sizes"]) >= 200
    assert used["counts"] == shown["counts"]


def test_wrong_flag_type_is_one_line(capsys):
    line = _one_error_line(["train", "--rounds", "three"], capsys)
    assert "--rounds" in line and "three" in line


# ---- docs -------------------------------------------------------------------------------
def test_docs_tables_are_the_generated_ones():
    """Run ``python -m privfedcal.settings.catalogue --write`` after changing a setting."""
    assert stale_docs(ROOT) == []


def test_usage_table_rows():
    table = usage_table().splitlines()
    assert len(table) == 2 + len([s for s in all_settings() if s.scope != "flower"])
    assert "| Data | `--imbalance-factor` | `imbalance_factor` | `imbalance-factor` | 10.0 |" \
        in usage_table()
    row = next(r for r in table if "`--out`" in r)
    assert "&lt;method&gt;" in row  # not swallowed as an HTML tag


def test_rewrite_replaces_only_the_marked_block():
    begin = "<!-- t:begin (generated: python -m privfedcal.settings.catalogue --write) -->"
    text = f"a\n{begin}\nold\n<!-- t:end -->\nb\n"
    assert rewrite(text, "t", "new") == f"a\n{begin}\nnew\n<!-- t:end -->\nb\n"
    with pytest.raises(ValueError):
        rewrite("no markers", "t", "new")


def test_dp_eps_off_round_trips_as_null():
    cfg = RunConfig.from_dict({"dp_eps": None})
    assert math.isinf(cfg.privacy.dp_eps) and cfg.to_dict()["dp_eps"] is None


def test_a_new_methods_hyperparameters_become_flags(monkeypatch):
    """Declared once, on the method's Params (``hyper``): the flag's name, type and help
    follow; a name two methods share with different types is refused."""
    import dataclasses

    from privfedcal.algorithms.algorithm import ALGORITHMS, Algorithm, hyper
    from privfedcal.settings.catalogue import method_settings

    @dataclasses.dataclass(frozen=True)
    class P:
        gamma: int = hyper(3, "focusing exponent")
        mu: float = hyper(0.2, "a second meaning of mu")

    class Focal(Algorithm):
        name = "focal-test"
        Params = P

    monkeypatch.setitem(ALGORITHMS._items, "focal-test", Focal)
    flags = {s.name: s for s in method_settings()}
    assert flags["gamma"].type is int and "focal-test: focusing exponent" in flags["gamma"].help
    assert "focal-test: a second meaning of mu" in flags["mu"].help
    assert "fedprox: weight of the proximal term" in flags["mu"].help

    @dataclasses.dataclass(frozen=True)
    class Q:
        mu: str = hyper("x", "mu as text")

    class Clash(Algorithm):
        name = "clash-test"
        Params = Q

    monkeypatch.setitem(ALGORITHMS._items, "clash-test", Clash)
    with pytest.raises(TypeError, match="'mu' has different types"):
        method_settings()


def test_calibration_flags_are_the_calibrators_declared_options():
    """``CALIBRATION_SETTINGS`` is derived from the calibrators' ``Params`` fields made by
    ``calibration_option`` (name or prefixed flag, the field's type, its help), in
    calibrator-name and field order; a wrong type is refused when the calibrator is built
    too, not only when a settings file is read."""
    import dataclasses

    from privfedcal.calibration import CALIBRATORS, calibrator_params
    from privfedcal.federation.hooks import CalibrationSpec
    from privfedcal.settings.descriptions import calibration_option, calibration_options

    assert [s.name for s in CALIBRATION_SETTINGS] == [
        "virtual_per_class", "virtual_mode", "tukey", "features_per_class", "match_steps",
        "retrain_steps", "feature_lr", "creff_client_draws", "creff_weighting", "creff_dsa",
        "creff_release_last"]
    derived = [s for n in CALIBRATORS.names() if hasattr(CALIBRATORS.get(n), "Params")
               for s in calibration_options(CALIBRATORS.get(n).Params)]
    assert tuple(derived) == CALIBRATION_SETTINGS

    @dataclasses.dataclass(frozen=True)
    class ToyParams:
        steps: int = calibration_option(3, "toy steps.")
        mode: str = calibration_option("a", "toy mode.", flag="toy_mode")
        quiet: float = 0.5  # no flag

    (steps, mode) = calibration_options(ToyParams)
    assert (steps.name, steps.type, steps.help, steps.scope) == ("steps", int, "toy steps.",
                                                                 "calibration")
    assert (mode.name, mode.type, mode.optional, mode.default) == ("toy_mode", str, True, None)
    with pytest.raises(UsageError, match="calibration_params.virtual_per_class must be an "
                                         "integer, got 1.5"):
        calibrator_params(CALIBRATORS.get("ccvr"), CalibrationSpec("ccvr"),
                          {"virtual_per_class": 1.5})
