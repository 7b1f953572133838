"""privfedcal.flower.deploy.localdeploy on any Flower app: only what the app declares is passed.

A tiny numpy-only Flower app (no privfedcal in it) written to ``tmp_path``: the command line
is refused with one line and exit 2 where it names an undeclared run-config key or no node
count; the run command adds ``clients`` and the nodes' data seed only for an app that
declares them. The slow tests run the tiny app on a real local deployment (SuperLink and
SuperNodes as processes), once to completion and once with a ServerApp that raises.
"""

from __future__ import annotations

import textwrap
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from privfedcal.flower.deploy.localdeploy import LocalDeployment, main  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower"

APP = """
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg

client = ClientApp()
server = ServerApp()


@client.train()
def train(msg, context):
    w = msg.content["arrays"]["w"].numpy() + context.run_config["step"]
    return Message(RecordDict({"arrays": ArrayRecord({"w": torch.from_numpy(w)}),
                               "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)


@server.main()
def main(grid, context):
    if context.run_config["fail"]:
        raise RuntimeError("the ServerApp gives up")
    result = FedAvg(fraction_evaluate=0.0, min_available_nodes=2).start(
        grid, ArrayRecord({"w": torch.zeros(1)}), num_rounds=context.run_config["rounds"])
    print("final weight", float(result.arrays["w"].numpy()[0]))
    with open("final_weight.txt", "w") as f:  # the app's own file, in its working folder
        f.write(str(float(result.arrays["w"].numpy()[0])))
"""

PYPROJECT = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "tinyapp"
version = "1.0.0"
description = "a Flower app that knows nothing of privfedcal"
license = "Apache-2.0"
dependencies = ["flwr>=1.41"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "someone"

[tool.flwr.app.components]
serverapp = "tiny:server"
clientapp = "tiny:client"

[tool.flwr.app.config]
rounds = 1
step = 0.5
fail = false
"""


@pytest.fixture
def app(tmp_path):
    root = tmp_path / "tinyapp"
    root.mkdir()
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "tiny.py").write_text(textwrap.dedent(APP))
    return root


def _refused(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_undeclared_keys_and_missing_node_counts_are_refused(app, capsys, tmp_path):
    err = _refused(capsys, ["deploy", str(app), "--nodes", "2", "clients=2"])
    assert err == (f"error: {app} declares no run-config key clients "
                   "(declared: fail, rounds, step)")
    assert "no 'clients'" in _refused(capsys, ["deploy", str(app), "rounds=2"])
    assert "--nodes must be >= 1" in _refused(capsys, ["simulate", str(app), "--nodes", "0"])
    assert "KEY=VALUE in TOML" in _refused(capsys, ["deploy", str(app), "--nodes", "2",
                                                    "rounds=="])
    assert "rounds" in _refused(capsys, ["deploy", str(app), "--nodes", "2", "rounds=[1]"])
    assert "no pyproject.toml" in _refused(capsys, ["deploy", str(tmp_path), "--nodes", "2"])
    assert "differs from --nodes 3" in _refused(
        capsys, ["deploy", str(EXAMPLE), "--nodes", "3", "clients=2"])


def _command(tmp_path, app_dir, overrides, **kw):
    dep = LocalDeployment(2, tmp_path / "dep", **kw)
    dep.workdir.mkdir(exist_ok=True)
    dep._run_command(app_dir, overrides)
    return tomllib.loads((dep.workdir / "overrides.toml").read_text())


def test_the_run_command_adds_clients_only_where_declared(app, tmp_path):
    assert _command(tmp_path, app, {"rounds": 3}) == {"rounds": 3}
    assert _command(tmp_path, EXAMPLE, {"rounds": 3}) == {"clients": 2, "rounds": 3}


@pytest.mark.parametrize("seed", [True, False])
def test_nodes_get_the_data_seed_only_when_asked(tmp_path, seed):
    dep = LocalDeployment(2, tmp_path, data_seed=5, node_data_seed=seed)
    started = []
    dep._start = lambda name, args: started.append(args)
    dep.start_node(1)
    node_config = started[0][started[0].index("--node-config") + 1]
    assert node_config == "partition-id=1 num-partitions=2" + (" data-seed=5" if seed else "")


@pytest.mark.flower
@pytest.mark.slow
def test_a_foreign_app_runs_on_a_local_deployment(app, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert main(["deploy", str(app), "--nodes", "2", "rounds=2", "--timeout", "400"]) == 0
    out = capsys.readouterr().out
    assert "final weight 1.0" in out  # two rounds of +0.5 from both nodes
    assert "the run finished" in out
    # the ServerApp ran in a fresh run folder under the current one, kept and printed
    folder = Path(out.strip().splitlines()[-1].removeprefix("run folder: "))
    assert folder.parent == tmp_path / "runs" and folder.name.startswith("flower-deploy-")
    assert (folder / "final_weight.txt").read_text() == "1.0"


def test_out_is_a_new_or_empty_folder(app, capsys, tmp_path):
    from privfedcal.flower.deploy.localdeploy import _out_folder

    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    err = _refused(capsys, ["deploy", str(app), "--nodes", "2", "--out", str(tmp_path / "used")])
    assert err == f"error: --out {tmp_path / 'used'} is not an empty folder: give a new one"
    assert _out_folder(tmp_path / "new", "deploy") == tmp_path / "new"
    assert not (tmp_path / "new").exists()  # made only once the run's settings are checked
    # a refused run leaves no folder behind
    _refused(capsys, ["deploy", str(app), "--nodes", "2", "--out", str(tmp_path / "n2"), "x=1"])
    assert not (tmp_path / "n2").exists()


@pytest.mark.flower
@pytest.mark.slow
def test_a_failing_foreign_app_exits_1(app, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert main(["deploy", str(app), "--nodes", "2", "fail=true", "--timeout", "400"]) == 1
    assert "the run failed" in capsys.readouterr().out
