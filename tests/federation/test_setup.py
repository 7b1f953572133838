"""federation/setup.py: the experiment built from a RunConfig."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from privfedcal.errors import UsageError
from privfedcal.experiment import build_experiment
from privfedcal.federation.setup import fit_warning, resolve_device


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA device"):
            resolve_device("cuda")


def test_fit_warning_names_the_minimum_input():
    assert fit_warning("cnn", "cifar10", 32) is None
    assert fit_warning("mlp", "digits", 8) is None  # no minimum
    msg = fit_warning("resnet8", "digits", 8)
    assert msg is not None and msg.startswith(
        "model resnet8 is built for images of at least 16x16 pixels but digits has 8x8")


@pytest.fixture(scope="module")
def experiment():
    from privfedcal.settings.run_config import RunConfig

    return build_experiment(RunConfig.of(dataset="digits", clients=4, alpha=0.5, rounds=2,
                                      batch_size=32, device="cpu", threads=1, seed=0,
                                      transcript=False))


def test_experiment_resolves_defaults_and_partitions_the_data(experiment):
    e = experiment
    assert e.model_name == "mlp" and e.record["model"] == "mlp" and e.record["lr"] == 0.05
    t = e.spec.training
    assert (t.local_epochs, t.batch_size, t.lr, t.momentum,
            e.spec.data.augment, e.spec.mixed_precision) == (2, 32, 0.05, 0.9, False, False)
    assert e.warnings == []
    rec = e.partition_record()
    # Dirichlet(0.5) over 4 clients, seed 0: pinned sizes; every sample assigned once
    assert rec["sizes"] == [264, 308, 404, 370]
    assert rec["num_train"] == rec["num_assigned"] == 1346
    idx = np.concatenate(rec["indices"])
    assert len(np.unique(idx)) == idx.size == 1346
    y = e.data.y_train.cpu().numpy()
    for k, ix in enumerate(rec["indices"]):
        assert np.bincount(y[ix], minlength=10).tolist() == rec["counts"][k]
    assert rec["class_totals"] == np.bincount(y, minlength=10).tolist()


def test_the_experiment_carries_the_narrow_options_of_its_resolved_config(experiment):
    """Built once from the resolved config: what the trainers, the data and the planner
    read; the worker processes' builder takes the local-training spec, not the config."""
    import pickle

    from privfedcal.experiment import config_of
    from privfedcal.settings.floors import run_options

    e = experiment
    opts = run_options(config_of(e))
    assert e.data_options == opts.data and e.engine == opts.engine and e.privacy == opts.privacy
    assert e.loop == opts.loop and e.loop.training.rounds == 2 and not e.loop.output.transcript
    assert e.spec == opts.training  # mixed precision off on a CPU
    assert e.spec.method == "fedavg" and e.spec.training.lr == 0.05
    assert e.spec.training.local_epochs == 2
    assert e.data_options.data_seed == e.record["data_seed"] == 0  # a plain run: the public seed
    model, algo = pickle.loads(pickle.dumps(e.builder))()
    for key, value in model.state_dict().items():  # same seeds: the server's initial model
        torch.testing.assert_close(value, e.model.state_dict()[key].cpu())
    assert algo.name == e.algo.name


def test_the_partition_is_drawn_from_the_data_options(experiment):
    from privfedcal.federation.setup import draw_partition, load_data

    o = experiment.data_options
    parts, counts, held = draw_partition(load_data(o), o)
    assert [p.tolist() for p in parts] == [p.tolist() for p in experiment.parts]
    assert counts.tolist() == experiment.counts.tolist() and held == experiment.num_examples
    with pytest.raises(ValueError, match="data seed"):
        unseeded = dataclasses.replace(o.training, data_seed=None)
        draw_partition(load_data(o), dataclasses.replace(o, training=unseeded))


def test_the_experiments_record_is_its_resolved_config_and_config_json(experiment, tmp_path):
    """What the floors above read back (``experiment.config_of``) and what the simulator
    writes into the run folder are the same resolved settings."""
    from privfedcal.experiment import config_of
    from privfedcal.federation.simulator import Simulator
    from privfedcal.settings.run_config import read_run_config

    cfg = config_of(experiment)
    assert (cfg.model, cfg.training.lr, cfg.training.local_epochs, cfg.training.data_seed) == ("mlp", 0.05, 2, 0)
    Simulator(experiment, tmp_path / "run").close()
    assert read_run_config(tmp_path / "run") == cfg
    assert read_run_config(tmp_path / "run" / "server") == cfg.replace(data_seed=None)
