"""DP noise nobody else can reproduce: the server with the run folder and the seed cannot
cancel it, two runs with the same seed draw different noise; seeded noise only behind
--insecure-seeded-noise (where the same attack does recover the exact counts)."""

from __future__ import annotations

import json
import math

import torch

from privfedcal.cli.main import main
from privfedcal.experiment import build_experiment
from privfedcal.privacy.noise import INSECURE_STATEMENT, noise_generator
from privfedcal.privacy.transcript import load_transcript
from privfedcal.settings.run_config import RunConfig

FAST = ["--method", "ccvr", "--dp-eps", "8", "--clients", "4", "--rounds", "1",
        "--local-epochs", "1", "--device", "cpu", "--threads", "1", "--alpha", "0.5",
        "--seed", "3"]


def run(out, *extra):
    main(["train", *FAST, *extra, "--out", str(out)])
    return json.loads((out / "summary.json").read_text())


def uploads(out):
    return {e["client"]: e for e in load_transcript(out / "server" / "transcript")
            if e["label"] == "ccvr-stats" and e["view"] == "plain-upload"}


def attack_counts(out, summary):
    """The server's attack: regenerate each client's noise from (seed, round, client) as the
    seeded generator would and subtract it from the recorded upload."""
    cfg = RunConfig.from_dict({k: v for k, v in json.loads((out / "config.json").read_text())
                               .items() if k != "versions"})
    p = summary["privacy"]
    # three keys with equal shares, the count's sensitivity 1: std = z * sqrt(3) * 1
    std = p["noise_multipliers"]["ccvr-stats"] * math.sqrt(3)
    out_counts = {}
    for c, e in uploads(out).items():
        noisy = e["tensors"]["count"]
        g = noise_generator(cfg.training.seed, e["round"], c, 101, seeded=True)
        regenerated = std * torch.randn(noisy.shape, generator=g, dtype=noisy.dtype)
        out_counts[c] = noisy - regenerated
    return cfg, out_counts, std


def true_counts(cfg):
    exp = build_experiment(cfg)
    c = exp.data.num_classes
    return {k: torch.bincount(exp.data.y_train[idx], minlength=c).double()
            for k, idx in enumerate(exp.parts)}


def test_server_with_seed_cannot_cancel_noise_and_runs_differ(tmp_path, capsys):
    s1 = run(tmp_path / "a")
    run(tmp_path / "b")
    assert s1["privacy"]["noise_source"] == "os-entropy" and "insecure" not in s1["privacy"]
    # same seed, same data: different noise in every upload
    u1, u2 = uploads(tmp_path / "a"), uploads(tmp_path / "b")
    for c in u1:
        assert not torch.allclose(u1[c]["tensors"]["count"], u2[c]["tensors"]["count"])
    cfg, guessed, std = attack_counts(tmp_path / "a", s1)
    truth = true_counts(cfg)
    residual = torch.cat([(guessed[c] - truth[c]) for c in guessed])
    # the regenerated noise is unrelated to the real one: the residual has ~ sqrt(2) std
    assert float(residual.abs().max()) > 0.5 * std
    assert float(residual.std()) > 0.5 * std


def test_insecure_seeded_noise_is_reproducible_warned_and_recorded(tmp_path, capsys):
    """The control: with --insecure-seeded-noise the same attack recovers exact counts, so
    the test above would fail if noise were still seeded."""
    s1 = run(tmp_path / "a", "--insecure-seeded-noise")
    s2 = run(tmp_path / "b", "--insecure-seeded-noise")
    assert s1["privacy"]["insecure"] == INSECURE_STATEMENT
    assert s1["privacy"]["noise_source"] == "seeded (insecure)"
    u1, u2 = uploads(tmp_path / "a"), uploads(tmp_path / "b")
    for c in u1:
        assert torch.equal(u1[c]["tensors"]["count"], u2[c]["tensors"]["count"])
    cfg, guessed, std = attack_counts(tmp_path / "a", s1)
    truth = true_counts(cfg)
    for c in guessed:
        torch.testing.assert_close(guessed[c], truth[c], atol=1e-3 * std, rtol=0)
    assert s2["accuracy"] == s1["accuracy"]


def test_generators_from_os_entropy_differ():
    a = torch.randn(8, generator=noise_generator(0, 1, 2, 101))
    b = torch.randn(8, generator=noise_generator(0, 1, 2, 101))
    assert not torch.equal(a, b)
    c = torch.randn(8, generator=noise_generator(0, 1, 2, 101, seeded=True))
    d = torch.randn(8, generator=noise_generator(0, 1, 2, 101, seeded=True))
    assert torch.equal(c, d)


def test_dpsgd_noise_is_not_seeded(tiny_cfg):
    """Two DP-SGD local trainings from the same state and seed end in different models; with
    the insecure flag, in the same one."""
    from privfedcal.federation.local import train_client
    from privfedcal.privacy.dpsgd_local import DPSGDSpec

    cfg = tiny_cfg()
    exp = build_experiment(cfg)
    import dataclasses

    from privfedcal.federation.local import clone_state
    from privfedcal.privacy.dpsgd import prepare_model

    model = prepare_model(exp.model)
    state = clone_state(model)

    def once(seeded):
        spec = dataclasses.replace(exp.spec, dp_sgd=DPSGDSpec(1.0, 1.0, 0.1, 2, 3.2, seeded=seeded))
        out, _, _ = train_client(model, exp.algo, state, None, exp.data.x_train,
                                 exp.data.y_train, exp.parts[0], spec, 1, 0)
        return torch.cat([v.flatten().float() for v in out.values()])

    assert not torch.equal(once(False), once(False))
    assert torch.equal(once(True), once(True))
