"""privfedcal.flower.plugin.plugin_settings: where each side reads the plugin's settings, in which
order, and the digest by which the server checks a node's."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("flwr")

from privfedcal.errors import UsageError  # noqa: E402
from privfedcal.flower.plugin.plugin_settings import gather, resolve  # noqa: E402


def test_node_config_beats_run_config_beats_keywords():
    flat = gather({"dp_eps": 2.0, "dp_clip": 3.0, "key_holder": 1},
                  {"privfedcal.dp-eps": 4.0, "other-key": 1},
                  {"privfedcal.dp-eps": 1.0, "partition-id": 0})
    s = resolve(flat, clients=3)
    assert s.cfg.privacy.dp_eps == 1.0 and s.cfg.privacy.dp_clip == 3.0
    assert s.options.key_holder == 1 and s.cfg.calibrator == "ccvr" and s.cfg.training.rounds == 1
    assert s.cfg.data.clients == 3 and s.cfg.privacy.dp_delta == 1e-5  # no examples: the plugin's delta


def test_delta_follows_the_public_example_count():
    s = resolve(gather({"dp_eps": 1.0, "dp_clip": 2.0, "examples": 50_000}, {}), clients=2)
    assert s.cfg.privacy.dp_delta == pytest.approx(1 / (10 * 50_000))
    assert not math.isfinite(resolve({}, clients=2).cfg.privacy.dp_eps)


@pytest.mark.parametrize("kwargs, run_config, match", [
    ({"epsilon": 1.0}, {}, "unknown privfedcal setting 'epsilon'"),
    ({}, {"privfedcal.dataset": "x"}, "unknown privfedcal setting 'dataset'"),
    ({"method": "oracle"}, {}, "method must be one of ccvr, creff"),
    ({"dp_clip": "auto", "secagg": True}, {}, "dp-clip='auto' needs dp-eps"),
    ({"hide_counts": True}, {}, "--hide-counts needs --secagg"),
])
def test_bad_settings_are_one_line_errors(kwargs, run_config, match):
    with pytest.raises(UsageError, match=match) as info:
        resolve(gather(kwargs, run_config), clients=3)
    assert "\n" not in str(info.value)


def test_digest_tells_protection_settings_apart_but_not_the_servers_waiting():
    base = resolve(gather({"dp_eps": 8.0, "secagg": True}, {}), clients=3).digest()
    assert resolve(gather({"dp_eps": 9.0, "secagg": True}, {}), clients=3).digest() != base
    assert resolve(gather({"dp_eps": 8.0}, {}), clients=3).digest() != base
    assert resolve(gather({"dp_eps": 8.0, "secagg": True}, {}), clients=4).digest() != base
    assert resolve(gather({"dp_eps": 8.0, "secagg": True, "round_timeout": 5.0}, {}),
                   clients=3).digest() == base


def test_creff_runs_without_image_augmentation_unless_asked():
    s = resolve(gather({"method": "creff"}, {}), clients=3)
    assert s.cfg.calibration_params["dsa"] == "none"
    s = resolve(gather({"method": "creff", "calibration_params": {"creff_dsa": "flip"}}, {}),
                clients=3)
    assert "dsa" not in s.cfg.calibration_params


def test_an_auto_clip_is_planned_with_the_calibration_in_one_budget():
    from opacus.accountants import RDPAccountant

    from privfedcal.privacy.accounting import ReleasePlan, plan_noise
    from privfedcal.privacy.quantile import ClipSearch, plan_clip_noise

    s = resolve(gather({"dp_eps": 8.0, "dp_clip": "auto", "examples": 1000}, {}), clients=3)
    auto = s.auto_clip
    assert s.cfg.privacy.dp_clip is None  # chosen by the search, before the calibration release
    # the calibration's DPAccounting plans against the whole target, not a remainder
    assert s.cfg.privacy.dp_eps == 8.0 and s.cfg.privacy.dp_delta == pytest.approx(1e-5)  # min(1e-5, 1/10N)
    clip_z, (calibration_z,) = plan_clip_noise(8.0, s.cfg.privacy.dp_delta, ClipSearch(),
                                               [ReleasePlan("ccvr-stats", 1.0, 1)])
    assert auto.sigma == clip_z and auto.calibration == {"ccvr-stats": calibration_z}
    # basic composition (0.1 epsilon and delta / 2 for the search) plans more noise
    (basic,) = plan_noise(7.2, 5e-6, [ReleasePlan("ccvr-stats", 1.0, 1)])
    assert calibration_z == pytest.approx(0.643, abs=2e-3) and basic > 1.1 * calibration_z
    # opacus by hand: the search's two stages and the calibration spend the target, no more
    acc = RDPAccountant()
    acc.history = [(auto.stage_sigma(1), 1.0, 1), (auto.stage_sigma(2), 1.0, 1),
                   (calibration_z, 1.0, 1)]
    assert 8.0 * 0.99 < acc.get_epsilon(s.cfg.privacy.dp_delta) <= 8.0
    # the search alone spends its share
    acc.history = [(auto.sigma, 1.0, 1)]
    assert acc.get_epsilon(s.cfg.privacy.dp_delta) == pytest.approx(0.8, rel=1e-2)
