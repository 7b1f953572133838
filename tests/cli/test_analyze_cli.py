"""``privfedcal analyze``: files and numbers of a tiny CCVR run, checked against independent
numpy computations; bad run folders and flags end as one line with exit 2."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from privfedcal.analysis.run_analysis import (
    PROBE_PURPOSE,
    SLICES_PURPOSE,
    cka_layers,
    classifier_weight_key,
    probe_indices,
)
from privfedcal.cli.main import main
from privfedcal.experiment import build_experiment
from privfedcal.federation.checkpoint import load_checkpoint
from privfedcal.federation.local import make_generator, train_client
from privfedcal.settings.run_config import RunConfig

FAST = ["--clients", "4", "--rounds", "2", "--local-epochs", "1", "--device", "cpu",
        "--threads", "1", "--alpha", "0.5", "--no-transcript", "--dataset", "digits"]
SAMPLES, PROJECTIONS = 60, 32
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    run = tmp_path_factory.mktemp("analyze") / "run"
    main(["train", *FAST, "--method", "ccvr", "--out", str(run)])
    main(["analyze", str(run), "--samples", str(SAMPLES), "--projections", str(PROJECTIONS)])
    return run, json.loads((run / "analysis.json").read_text())


def np_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Kornblith et al.'s linear CKA in feature space, numpy float64."""
    x = x - x.mean(0)
    y = y - y.mean(0)
    return np.linalg.norm(x.T @ y) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y))


def test_writes_plots_and_json(analysed, capsys):
    run, result = analysed
    for name in ("classifier_norms.png", "cka.png", "singular_values.png"):
        assert (run / name).read_bytes()[:8] == PNG, name
    assert set(result) >= {"classifier", "cka", "separability", "method", "run_dir", "plots"}
    cls = result["classifier"]
    assert (cls["before_source"], cls["after_source"]) == ("checkpoint/global", "final/model")
    assert cls["weight_key"] == "classifier.weight" and cls["calibrated"] is True
    cka = result["cka"]
    assert cka["layers"] == ["body.1", "body.3", "features", "classifier"]  # the mlp
    assert list(cka["mean"]) == cka["layers"]
    assert (cka["clients"], cka["samples"], cka["local_round"]) == (4, SAMPLES, 3)
    for layer in cka["layers"]:
        mat = np.array(cka["matrices"][layer])
        assert mat.shape == (4, 4) and np.allclose(mat, mat.T) and np.allclose(np.diag(mat), 1)
        assert 0 <= cka["mean"][layer] <= 1
        assert np.isclose(cka["mean"][layer], mat[np.triu_indices(4, 1)].mean())
    assert result["separability"]["projections"] == PROJECTIONS


def test_classifier_numbers_match_checkpoints(analysed):
    run, result = analysed
    w_before = load_checkpoint(run / "checkpoint")["global"]["classifier.weight"].double().numpy()
    w_after = load_checkpoint(run / "final")["model"]["classifier.weight"].double().numpy()
    cls = result["classifier"]
    np.testing.assert_allclose(cls["norms"]["before"], np.sqrt((w_before**2).sum(1)), rtol=1e-12)
    np.testing.assert_allclose(cls["norms"]["after"], np.sqrt((w_after**2).sum(1)), rtol=1e-12)
    np.testing.assert_allclose(cls["singular_values"]["before"],
                               np.linalg.svd(w_before, compute_uv=False), rtol=1e-10)
    np.testing.assert_allclose(cls["singular_values"]["after"],
                               np.linalg.svd(w_after, compute_uv=False), rtol=1e-10)
    assert not np.allclose(cls["norms"]["before"], cls["norms"]["after"])  # CCVR recalibrated


def test_cka_and_separability_recomputed_independently(analysed):
    """Round R + 1 of clients 0 and 2 replayed with train_client (the engine's generator),
    CKA of their logits and the class-Gaussian SW2 recomputed in numpy."""
    torch.set_num_threads(1)
    run, result = analysed
    raw = json.loads((run / "config.json").read_text())
    raw.pop("versions")
    exp = build_experiment(RunConfig.from_dict(raw))
    glob = load_checkpoint(run / "checkpoint")["global"]
    probe = exp.data.x_test[probe_indices(exp.data.x_test.shape[0], SAMPLES, 0)]
    logits = []
    for c in (0, 2):
        state, _, _ = train_client(exp.model, exp.algo, glob, None, exp.data.x_train,
                                   exp.data.y_train, exp.parts[c], exp.spec, 3, c)
        exp.model.load_state_dict(state)
        exp.model.eval()
        with torch.no_grad():
            logits.append(exp.model(probe).double().numpy())
    expected = np_cka(*logits)
    assert result["cka"]["matrices"]["classifier"][0][2] == pytest.approx(expected, rel=1e-6)

    exp.model.load_state_dict(load_checkpoint(run / "final")["model"])
    held = torch.cat(exp.parts)
    with torch.no_grad():
        z = exp.model.features(exp.data.x_train[held]).double().numpy()
    y = exp.data.y_train[held].numpy()
    classes = sorted(set(y.tolist()))
    assert result["separability"]["classes"] == classes
    means = np.stack([z[y == c].mean(0) for c in classes])
    covs = np.stack([np.cov(z[y == c], rowvar=False) for c in classes])
    g = make_generator(0, 0, 0, SLICES_PURPOSE)
    u = torch.randn(PROJECTIONS, z.shape[1], generator=g, dtype=torch.float64).numpy()
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    m = means @ u.T
    s = np.sqrt(np.einsum("ld,cde,le->cl", u, covs, u))
    sw = np.sqrt(((m[:, None] - m[None]) ** 2 + (s[:, None] - s[None]) ** 2).mean(2))
    expected_sw = sw[np.triu_indices(len(classes), 1)].mean()
    assert result["separability"]["mean_sliced_wasserstein"] == pytest.approx(expected_sw, rel=1e-6)


def test_probe_is_a_seeded_subset():
    a = probe_indices(100, 30, seed=5)
    assert torch.equal(a, probe_indices(100, 30, seed=5))
    assert len(set(a.tolist())) == 30 and not torch.equal(a, probe_indices(100, 30, seed=6))
    assert torch.equal(torch.sort(probe_indices(10, 500, 0)).values, torch.arange(10))
    assert PROBE_PURPOSE != SLICES_PURPOSE


def test_cka_layers_run_order_and_no_duplicate_of_z():
    from privfedcal.models.cnn import SimpleCNN

    model = SimpleCNN(num_classes=3, in_channels=1, image_size=16)
    layers = cka_layers(model, torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(0)))
    # projection.2 outputs z itself: it is reported once, as "features"
    assert layers == ["convs.0", "convs.3", "body.0", "body.2", "projection.0", "features",
                      "classifier"]


def test_weight_key_of_a_normalised_classifier():
    assert classifier_weight_key({"classifier.weight": torch.ones(1)}) == "classifier.weight"
    key = "classifier.parametrizations.weight.original"
    assert classifier_weight_key({key: torch.ones(1), "x": torch.ones(1)}) == key


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    lines = [x for x in out.err.splitlines() if x.strip()]
    assert exc.value.code == 2 and len(lines) == 1 and "Traceback" not in out.err, out.err
    return lines[0]


def test_errors_are_one_line(analysed, tmp_path, capsys):
    run, _ = analysed
    assert "not a run folder" in run_cli(["analyze", str(tmp_path)], capsys)
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(run / "config.json", unfinished / "config.json")
    shutil.copytree(run / "checkpoint", unfinished / "checkpoint")
    assert "no final/ checkpoint" in run_cli(["analyze", str(unfinished)], capsys)
    shutil.copytree(run / "checkpoint", unfinished / "final")  # holds no "model" entry
    assert "lacks 'global' or final/ lacks 'model'" in run_cli(["analyze", str(unfinished)], capsys)
    assert "--samples must be >= 2" in run_cli(["analyze", str(run), "--samples", "1"], capsys)
    assert "--projections" in run_cli(["analyze", str(run), "--projections", "0"], capsys)


def test_progress_on_stderr_when_piped_and_quiet_silences_it(analysed, capsys):
    run, _ = analysed
    args = ["analyze", str(run), "--samples", str(SAMPLES), "--projections", str(PROJECTIONS)]
    main(args)
    err = capsys.readouterr().err
    assert f"privfedcal: analyze {run}: retraining clients for CKA [0/4]" in err
    main([*args, "--quiet"])
    assert capsys.readouterr().err == ""
