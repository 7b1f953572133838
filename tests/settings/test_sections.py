"""The sections of the settings (privfedcal/settings/sections.py): every flag of ``privfedcal
train`` and ``privfedcal partition`` parses and lands in its section's field, each section
checks its own rules, and the flat files users have (a settings TOML, a run's config.json
written before the sections) load to the same ``RunConfig``."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import typer

from privfedcal.cli.main import app
from privfedcal.cli.train_command import resolve_config
from privfedcal.errors import UsageError
from privfedcal.settings.catalogue import METHOD_OWNERS, cli_settings
from privfedcal.settings.descriptions import settings_of
from privfedcal.settings.run_config import RunConfig, load_toml, read_run_config
from privfedcal.settings.sections import SECTIONS, PrivacySettings

DATA = Path(__file__).with_name("data")
#: a non-default value of each flag that needs one chosen (the others: see ``_value``), and
#: the flags without which it is refused (the protection it belongs to)
VALUES = {
    "method": "fedprox", "model": "cnn", "dataset": "cifar10", "data_root": "/tmp/data",
    "partition": "iid", "device": "cpu", "precision": "fp32", "calibrate": "ccvr",
    "accountant": "prv", "stages": "toy", "out": "/tmp/run", "alpha": 0.5,
    "imbalance_factor": 20.0, "lr": 0.02, "momentum": 0.5, "weight_decay": 0.001,
    "participation": 0.5, "dp_eps": 8.0, "dp_delta": 1e-6, "dp_clip": 2.0, "dp_grad_clip": 2.0,
    "dp_train_share": 0.3, "dp_update_clip": 0.5, "dp_updates_share": 0.3,
    "dp_clip_quantile": 0.3, "secagg_key_holder": 1, "secagg_min_clients": 3,
    "dp_nominal_size": 50, "client_batch": 2, "virtual_mode": "proportional",
    "creff_weighting": "client", "creff_dsa": "off",
}
DP = ["--dp-eps", "8"]
NEEDS = {
    **dict.fromkeys(["dp_delta", "dp_clip", "dp_grad_clip", "accountant", "dp_updates"], DP),
    **dict.fromkeys(["dp_train", "dp_train_share", "dp_nominal_size"], [*DP, "--dp-train"]),
    **dict.fromkeys(["dp_update_clip", "dp_updates_share", "dp_adaptive_clip"],
                    [*DP, "--dp-updates"]),
    "dp_clip_quantile": [*DP, "--dp-updates", "--dp-adaptive-clip"],
    **dict.fromkeys(["hide_counts", "secagg_key_holder", "secagg_min_clients"], ["--secagg"]),
}
NOT_SETTINGS = ("config", "resume", "report", "log", "quiet")


def _value(s):
    if s.name in VALUES:
        return VALUES[s.name]
    if s.type is bool:
        return not s.default
    if s.type is int:
        return 3 if s.default is None else s.default + 1
    if s.type is float:
        return 0.25
    raise AssertionError(f"choose a value of --{s.name} in VALUES")


def _argv(s, value) -> list[str]:
    if s.type is bool:
        on, _, off = (s.param_decls[0] if s.param_decls else s.flag_name).partition("/")
        return [on if value else off or "--no-" + on[2:]]
    return [s.flag_name, str(value)]


def _parse(command: str, argv: list[str]) -> dict:
    click_app = typer.main.get_command(app)
    ctx = click_app.commands[command].make_context(command, list(argv))
    return {k: v for k, v in ctx.params.items() if k not in NOT_SETTINGS}


def _read(cfg: RunConfig, s):
    return getattr(getattr(cfg, s.section) if s.section else cfg, s.name)


@pytest.mark.parametrize("s", [s for s in cli_settings() if s.scope == "run"],
                         ids=lambda s: s.name)
def test_every_train_flag_lands_in_its_sections_field(s):
    value = _value(s)
    cfg = resolve_config(None, _parse("train", NEEDS.get(s.name, []) + _argv(s, value)))
    assert _read(cfg, s) == value and _read(cfg, s) != s.default
    assert cfg.to_dict()[s.name] == value  # the flat config.json names it as the flag does
    holder = cfg if not s.section else getattr(cfg, s.section)
    assert s.name in {f.name for f in dataclasses.fields(holder)}


@pytest.mark.parametrize("s", [s for s in cli_settings() if s.scope != "run"],
                         ids=lambda s: s.name)
def test_every_hyperparameter_flag_lands_in_its_table(s):
    value = _value(s)
    method, name = METHOD_OWNERS.get(s.name, (None, s.name))
    given = ["--method", method] if method else []
    cfg = resolve_config(None, _parse("train", given + _argv(s, value)))
    table = cfg.method_params if s.scope == "method" else cfg.calibration_params
    assert table == {name: value}


def test_a_methods_hyperparameter_has_its_own_flag_and_keeps_its_short_one():
    def run(*argv):
        return resolve_config(None, _parse("train", list(argv))).method_params

    assert run("--method", "fedprox", "--fedprox-mu", "0.1") == {"mu": 0.1}
    assert run("--method", "moon", "--moon-mu", "2", "--moon-tau", "0.3") == {"mu": 2.0,
                                                                                "tau": 0.3}
    assert run("--method", "moon", "--mu", "2") == {"mu": 2.0}  # the chosen method has it
    with pytest.raises(UsageError, match="--fedprox-mu is a hyperparameter of --method "
                                         "fedprox, not of moon"):
        run("--method", "moon", "--fedprox-mu", "0.1")
    with pytest.raises(UsageError, match="--fedprox-mu and --mu set the same"):
        run("--method", "fedprox", "--mu", "0.1", "--fedprox-mu", "0.2")
    from privfedcal.api import config_from

    assert config_from(None, {"method": "feduv", "feduv_lam": 0.5}).method_params == {"lam": 0.5}


def test_every_partition_flag_parses():
    from privfedcal.cli.partition_command import PARTITION_KEYS

    for s in settings_of(RunConfig, "run"):
        if s.name in PARTITION_KEYS:
            value = _value(s)
            assert _parse("partition", _argv(s, value))[s.name] == value


def test_sections_hold_every_setting_once():
    names = [s.name for s in settings_of(RunConfig, "run")]
    assert len(names) == len(set(names))
    declared = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert sorted(s.name for s in settings_of(RunConfig, "run") if s.section) == sorted(declared)
    assert {s.section for s in settings_of(RunConfig, "run")} == {"", *SECTIONS}


def test_of_places_flat_names_and_to_dict_flattens_them():
    cfg = RunConfig.of(dp_eps=8.0, clients=5, lr=0.1, workers=2, out="x", method="fedprox")
    assert (cfg.privacy.dp_eps, cfg.data.clients, cfg.training.lr, cfg.engine.workers,
            cfg.output.out, cfg.method) == (8.0, 5, 0.1, 2, "x", "fedprox")
    assert RunConfig.of(**RunConfig.of().flat()) == RunConfig() == RunConfig.of()
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.replace(clients=7).data.clients == 7 and cfg.data.clients == 5
    with pytest.raises(TypeError, match="unknown setting"):
        RunConfig.of(no_such_setting=1)


def test_a_section_checks_its_own_rules():
    with pytest.raises(UsageError, match="--hide-counts needs --secagg"):
        PrivacySettings(hide_counts=True)
    with pytest.raises(UsageError, match="--dp-train needs a budget: give --dp-eps"):
        PrivacySettings(dp_train=True)
    with pytest.raises(UsageError, match="--dp-delta belong"):
        PrivacySettings(dp_delta=1e-6)
    assert PrivacySettings(secagg=True).protected and not PrivacySettings().protected
    assert PrivacySettings(stages=" a, b ").stage_names == ("a", "b")
    with pytest.raises(UsageError, match="--secagg-key-holder 4 is not a client"):
        RunConfig.of(clients=4, secagg=True, secagg_key_holder=4)  # spans two sections


def test_a_run_folders_config_json_from_before_the_sections_loads_the_same():
    """``data/old_run/config.json``: the config.json of ``privfedcal train --rounds 1`` written
    before the settings were sections; resume and ``--config`` read it."""
    path = DATA / "old_run" / "config.json"
    raw = json.loads(path.read_text())
    cfg = read_run_config(path.parent)
    assert cfg.to_dict() == {k: v for k, v in raw.items() if k != "versions"}
    written = json.dumps({**cfg.to_dict(), "versions": raw["versions"]}, indent=2)
    assert written == path.read_text()  # the same bytes: same keys, same order
    again = RunConfig.from_dict(load_toml(path))
    assert again == cfg.replace(out=None)


def test_a_settings_toml_loads_into_the_sections():
    cfg = RunConfig.from_dict(load_toml(DATA / "settings.toml"))
    assert (cfg.method, cfg.data.clients, cfg.data.alpha, cfg.training.rounds,
            cfg.training.local_epochs, cfg.engine.threads, cfg.privacy.dp_eps,
            cfg.privacy.secagg, cfg.output.transcript) == (
        "fedprox", 5, 0.5, 3, 1, 1, 8.0, True, False)
    assert cfg.method_params == {"mu": 0.01}
    assert cfg.calibration_params == {"virtual_per_class": 20}
    assert math.isinf(RunConfig().privacy.dp_eps)


def test_the_config_takes_flat_names_as_it_did_when_it_was_flat():
    """``RunConfig(dp_eps=8)`` and ``dataclasses.replace(cfg, rounds=3)`` keep working: each
    flat name lands in its section."""
    cfg = RunConfig(dp_eps=8, clients=5, method="ccvr")
    assert cfg == RunConfig.of(dp_eps=8, clients=5, method="ccvr")
    assert (cfg.privacy.dp_eps, cfg.data.clients) == (8, 5)
    later = dataclasses.replace(cfg, rounds=3)
    assert (later.training.rounds, later.data.clients, later.privacy.dp_eps) == (3, 5, 8)
    assert later.to_dict() == cfg.replace(rounds=3).to_dict()
    with pytest.raises(TypeError, match="bogus"):
        RunConfig(bogus=1)
