"""The options each floor receives (privfedcal/settings/floors.py): each one's fields are the
settings of its name and meaning, the privacy options are the privacy section with the
public protocol, and a layer given the narrow option computes what it computed from the
whole config."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing

import pytest

from privfedcal.federation.setup import (
    PARTITION_SETTINGS,
    partition_is_secret,
    partition_settings_digest,
)
from privfedcal.privacy.cohorts import cohort_plan, select_clients
from privfedcal.settings.descriptions import settings_of
from privfedcal.settings.floors import (
    DataOptions,
    LocalSpec,
    LoopOptions,
    PrivacyOptions,
    run_options,
)
from privfedcal.settings.run_config import RunConfig, resolve_training_defaults
from privfedcal.settings.sections import SECTIONS, DataSettings, PrivacySettings, TrainingSettings

#: fields of the narrow options that are derived from RunConfig rather than copied by name
DERIVED = {"local_method", "calibrator", "optimizer", "dp_sgd", "mixed_precision"}


def _resolved(**kw) -> RunConfig:
    return resolve_training_defaults(RunConfig.of(**kw), model="mlp", augment=False)


def test_every_privacy_setting_is_a_privacy_option():
    """The planner sees every protection: the privacy options are the privacy section."""
    privacy = {s.name for s in settings_of(RunConfig, "run") if s.group == "Privacy"}
    fields = {f.name for f in dataclasses.fields(PrivacyOptions)}
    assert issubclass(PrivacyOptions, PrivacySettings) and issubclass(DataOptions, DataSettings)
    assert privacy - fields == set()


def test_the_public_protocol_reads_off_the_sections_it_is_held_in():
    """The privacy options read the public protocol, and the data options the seeds, off
    the sections they hold, under the settings' own names; both stay picklable and equal
    to a copy (worker processes and the Flower plugin receive them)."""
    import pickle

    cfg = _resolved(clients=7, rounds=4, participation=0.5, seed=3, data_seed=11, dp_eps=2.0)
    privacy, data = PrivacyOptions.of(cfg), DataOptions.of(cfg)
    assert (privacy.data, privacy.training, data.training) == (cfg.data, cfg.training,
                                                               cfg.training)
    assert (privacy.clients, privacy.rounds, privacy.participation, privacy.seed) == (
        7, 4, 0.5, 3)
    assert (privacy.local_epochs, privacy.batch_size) == (
        cfg.training.local_epochs, cfg.training.batch_size)
    assert (data.seed, data.data_seed, data.clients) == (3, 11, 7)
    assert pickle.loads(pickle.dumps(privacy)) == privacy
    assert pickle.loads(pickle.dumps(data)) == data
    defaults = PrivacyOptions()
    assert (defaults.clients, defaults.rounds, defaults.participation, defaults.seed) == (
        10, 30, 1.0, 0)
    assert (DataOptions().seed, DataOptions().data_seed) == (0, None)


@pytest.mark.parametrize("kind", [DataOptions, LocalSpec, PrivacyOptions, LoopOptions])
def test_fields_are_run_settings_of_the_same_name(kind):
    names = {s.name for s in settings_of(RunConfig, "run")}
    own = {f.name for f in dataclasses.fields(kind)} - DERIVED - {"method", "method_params"}
    held = {n for n in own if n in SECTIONS}  # a section held whole, under its own name
    assert all(typing.get_type_hints(kind)[n] is SECTIONS[n] for n in held)
    assert own - held <= names, own - held - names


@pytest.mark.parametrize("kind", [LocalSpec, LoopOptions, DataOptions, PrivacyOptions])
def test_records_of_sections_copy_none_of_their_settings(kind):
    """A floor that reads a section holds the section itself: no field of its own repeats a
    setting a section declares (``spec.data.augment``, never a second ``spec.augment``).
    A floor that extends a section (``PrivacyOptions`` the privacy section) declares that
    one section's settings, never another's (``privacy.training.rounds``, read as the
    property ``privacy.rounds``, never a field ``rounds``)."""
    declared = {f.name: name for name, section in SECTIONS.items()
                for f in dataclasses.fields(section)}
    extended = [section for section in SECTIONS.values() if issubclass(kind, section)]
    assert len(extended) <= 1
    inherited = {f.name for section in extended for f in dataclasses.fields(section)}
    own = {f.name for f in dataclasses.fields(kind)} - inherited
    assert {n: declared[n] for n in own if n in declared} == {}
    held = {n for n in own if n in SECTIONS}
    assert held and all(typing.get_type_hints(kind)[n] is SECTIONS[n] for n in held)
    assert not any(issubclass(SECTIONS[n], section) for n in held for section in extended)


def test_local_spec_holds_the_runs_sections():
    cfg = _resolved(dp_eps=4.0, dp_train=True, augment=True)
    spec = LocalSpec.of(cfg)
    assert (spec.training, spec.data, spec.privacy) == (cfg.training, cfg.data, cfg.privacy)
    assert spec.data.augment is True and spec.privacy.dp_train is True


def test_values_are_copied_and_derived_from_the_resolved_config():
    cfg = _resolved(method="ccvr", clients=7, dp_eps=4.0, dp_clip=3.0, secagg=True,
                    hide_counts=True, method_params={}, workers=1, client_batch=2, seed=5)
    opts = run_options(cfg)
    assert opts.privacy.local_method == "fedavg" and opts.privacy.calibrator == "ccvr"
    assert opts.privacy.dp_enabled and opts.privacy.secure and opts.privacy.dp_clip == 3.0
    assert opts.privacy.batch_size == cfg.training.batch_size == 32  # the "small" family's default
    assert opts.training.method == "fedavg" and opts.training.training.lr == pytest.approx(0.05)
    assert opts.engine.client_batch == 2 and opts.data.clients == 7 and opts.data.seed == 5
    assert (opts.loop.method, opts.loop.local_method, opts.loop.calibrator) == (
        "ccvr", "fedavg", "ccvr")
    loop = opts.loop
    assert (loop.data.clients, loop.training.rounds, loop.training.seed, loop.training.eval_every,
            loop.output.transcript) == (7, cfg.training.rounds, 5, cfg.training.eval_every,
                                        cfg.output.transcript)
    assert opts.engine is cfg.engine
    assert not PrivacyOptions.of(RunConfig()).dp_enabled
    params = {"creff_release_last": 3}
    own = PrivacyOptions.of(RunConfig.of(method="creff", calibration_params=params))
    params["creff_release_last"] = 9  # a copy: the options keep the run's value
    assert own.calibration_params == {"creff_release_last": 3}
    assert math.isinf(PrivacyOptions.of(RunConfig()).dp_eps)


def test_local_spec_refuses_unresolved_settings():
    with pytest.raises(ValueError, match="lr"):
        LocalSpec.of(RunConfig.of(local_epochs=1, batch_size=8, momentum=0.0, weight_decay=0.0,
                               augment=False))
    with pytest.raises(ValueError, match="resolve augment first"):
        LocalSpec.of(RunConfig.of(local_epochs=1, batch_size=8, lr=0.1, momentum=0.0,
                                  weight_decay=0.0))


def test_local_spec_names_an_implemented_optimizer():
    from privfedcal.errors import UsageError

    spec = LocalSpec(TrainingSettings(local_epochs=1, batch_size=8, lr=0.1, momentum=0.0,
                                      weight_decay=0.0, seed=0), DataSettings(augment=False))
    assert spec.optimizer == "sgd" and spec.method == "fedavg" and spec.method_params == {}
    with pytest.raises(UsageError, match="optimizer must be one of sgd, got 'adam'"):
        dataclasses.replace(spec, optimizer="adam")


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DataOptions.of(RunConfig()).clients = 3  # type: ignore[misc]


@pytest.mark.parametrize("kw", [{}, {"secagg": True, "dp_eps": 2.0, "secagg_min_clients": 3,
                                     "participation": 0.5, "clients": 12}])
def test_layers_compute_from_the_options_what_the_config_says(kw):
    cfg = _resolved(seed=3, **kw)
    privacy, data = PrivacyOptions.of(cfg), DataOptions.of(cfg)
    # the server's choices read the public protocol only: never the secret data seed
    secret = PrivacyOptions.of(cfg.replace(data_seed=12345))
    assert [select_clients(privacy, r) for r in (1, 2, 3)] == [
        select_clients(secret, r) for r in (1, 2, 3)]
    assert cohort_plan(privacy) == cohort_plan(secret)
    assert partition_is_secret(privacy) == partition_is_secret(cfg.privacy) == bool(kw)
    # the digest of the settings' values as the config holds them, computed here
    text = json.dumps({k: cfg.flat()[k] for k in PARTITION_SETTINGS}, sort_keys=True)
    assert partition_settings_digest(data) == hashlib.sha256(text.encode()).hexdigest()[:16]
    other = DataOptions.of(cfg.replace(alpha=0.3))
    assert partition_settings_digest(other) != partition_settings_digest(data)
