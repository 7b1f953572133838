"""A release's declaration (``ReleaseSpec``) is the only truth about its payload: a toy
calibrator declares, in this file alone, a release whose payload keys no other file names;
the planner's DP noise, the CKKS bounds and layout, the symmetrisation of its noise and the
attacker's noise model (``attacks/view.py``) all follow from that declaration."""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import privfedcal
from privfedcal.attacks.view import RunView, release_spec
from privfedcal.errors import UsageError
from privfedcal.experiment import build_experiment, calibrator_class
from privfedcal.federation.hooks import CALIBRATORS, Calibrator
from privfedcal.privacy.planner import build_uplink
from privfedcal.privacy.releases import ReleaseSpec
from privfedcal.privacy.secagg_stage import NOISE_SIGMAS, EncryptStage
from privfedcal.privacy.stages import NoiseStage
from privfedcal.privacy.transcript import Transcript

LABEL = "toy-spread"
#: payload keys that no file of the package names: their rules live in TOY's declaration only
SQUARE, TALLY = "toy_square", "toy_tally"
TOY = ReleaseSpec(
    LABEL, sensitivity={SQUARE: "R^2", TALLY: "1"},
    magnitude={SQUARE: "R^2*N", TALLY: "K"}, participants="all",
    holds={SQUARE: "per-class sums of z z^T (C, d, d)", TALLY: "0/1 per class (C,)"},
    noise_share={SQUARE: 3.0, TALLY: 1.0}, symmetric=frozenset({SQUARE}))


@pytest.fixture
def toy():
    @CALIBRATORS.register("toy-spread")
    class Toy(Calibrator):
        name: ClassVar[str] = "toy-spread"
        releases: ClassVar[tuple] = (TOY,)

    try:
        yield Toy
    finally:
        CALIBRATORS._items.pop("toy-spread", None)


def test_no_package_file_names_the_toy_keys():
    """The keys are unknown outside this file, so everything below came from TOY."""
    root = Path(privfedcal.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert SQUARE not in text and TALLY not in text, path


def test_the_toy_release_is_noised_bounded_packed_and_modelled_from_its_declaration(
        tiny_cfg, toy):
    clip = 2.0
    cfg = tiny_cfg(calibrate="toy-spread", dp_eps=4.0, dp_clip=clip, secagg=True,
                   hide_counts=False)
    exp = build_experiment(cfg)
    assert calibrator_class(cfg) is toy
    up = build_uplink(cfg, exp, toy)
    noise = next(s for s in up.stages if isinstance(s, NoiseStage))
    wire = next(s for s in up.stages if isinstance(s, EncryptStage))
    dp, secagg = noise.dp, wire.secagg
    z = dp.sigmas[LABEL]
    assert z > 0

    # DP noise std: z * s_k / sqrt(w_k), shares 3:1 normalised to 3/4 and 1/4
    want = {SQUARE: z * clip ** 2 / math.sqrt(0.75), TALLY: z * 1.0 / math.sqrt(0.25)}
    assert dp.stds([SQUARE, TALLY], LABEL) == pytest.approx(want)

    # CKKS bounds from the magnitudes (N examples, K clients), with 10 noise stds of room
    n, k = float(exp.num_examples), float(cfg.data.clients)
    assert secagg.bounds == pytest.approx({SQUARE: clip ** 2 * n, TALLY: k})
    assert secagg.max_abs(LABEL, [SQUARE, TALLY]) == pytest.approx(
        max(clip ** 2 * n + NOISE_SIGMAS * want[SQUARE], k + NOISE_SIGMAS * want[TALLY]))

    # the declared symmetric key travels as its upper triangle, the other in full
    c, d = 3, 4
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(c, 5, d, generator=g, dtype=torch.float64)
    payload = {SQUARE: feats.transpose(1, 2) @ feats, TALLY: torch.ones(c, dtype=torch.float64)}
    rel = up.release(LABEL, 1, [0, 1, 2, 3], [0, 1, 2, 3], payload, Transcript(None))
    wire.open(rel)
    layout = rel.state["sealing"].layout
    assert {e.name: e.symmetric for e in layout.entries} == {SQUARE: True, TALLY: False}
    assert layout.size == c * d * (d + 1) // 2 + c

    # its noise is symmetrised (the raw draw is not symmetric), the other key left alone
    rel.client = 0
    noisy = noise.client(payload, rel)
    assert torch.equal(noisy[SQUARE], noisy[SQUARE].transpose(-1, -2))
    assert not torch.equal(noisy[SQUARE], payload[SQUARE])
    assert noisy[TALLY].shape == (c,)

    # the attacker's noise model reads the same declaration, from the run's summary
    summary = {"privacy": {"noise_multipliers": {LABEL: z}, "feature_clip": clip,
                           "grad_clip": dp.grad_clip}}
    view = RunView(Path("."), cfg, summary, exp, [])
    assert release_spec(LABEL) is TOY
    assert view.noise_stds(LABEL, [SQUARE, TALLY]) == pytest.approx(want)


def test_an_undeclared_release_is_refused_by_the_noise_and_the_attacker(tiny_cfg, toy):
    cfg = tiny_cfg(calibrate="toy-spread", dp_eps=4.0)
    up = build_uplink(cfg, build_experiment(cfg), toy)
    dp = next(s for s in up.stages if isinstance(s, NoiseStage)).dp
    dp.sigmas["undeclared"] = 1.0
    with pytest.raises(UsageError, match="no declaration"):
        dp.stds([SQUARE], "undeclared")
    view = RunView(Path("."), cfg, {"privacy": {"noise_multipliers": {"undeclared": 1.0},
                                                "feature_clip": 1.0, "grad_clip": 1.0}},
                   None, [])
    with pytest.raises(UsageError, match="declares release 'undeclared'"):
        view.noise_stds("undeclared", [SQUARE])


def test_symmetric_keys_must_be_declared_payload_keys():
    with pytest.raises(ValueError, match="symmetric"):
        ReleaseSpec("x", {"a": "R"}, {"a": "R*N"}, symmetric=frozenset({"b"}))
