"""What the plugin leaves in a user's app: repeated runs in fresh run folders, the app's
threads and root logger as they were (``privfedcal.threads`` for the plugin's own work)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("flwr")

import torch  # noqa: E402
from plugin_app import NODES, Net, eval_loader, make_client_app, node_data  # noqa: E402

from privfedcal.flower.grid import InProcessGrid, run_app  # noqa: E402
from privfedcal.flower.plugin import CalibrationClient, preflight  # noqa: E402
from privfedcal.flower.plugin.plugin_settings import gather, resolve  # noqa: E402

pytestmark = pytest.mark.flower
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

APP = """
from flwr.serverapp import ServerApp
from plugin_app import Net, eval_loader, fedavg, make_client_app

from privfedcal.flower.plugin import calibrate, preflight

client = make_client_app()
server = ServerApp()


@server.main()
def main(grid, context):
    preflight(grid, Net(), context, head="fc3", test_data=eval_loader())
    model = fedavg(grid, rounds=1)
    calibrate(grid, model, context, head="fc3", test_data=eval_loader())
"""

PYPROJECT = """
[tool.flwr.app]
publisher = "someone"

[tool.flwr.app.components]
serverapp = "outputs_app:server"
clientapp = "outputs_app:client"

[tool.flwr.app.config]
"privfedcal.dp-eps" = ""
"""


def test_repeated_run_app_calls_get_fresh_run_folders(tmp_path, monkeypatch):
    app = tmp_path / "app"
    app.mkdir()
    (app / "outputs_app.py").write_text(textwrap.dedent(APP))
    (app / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    for _ in range(2):  # the same Flower run id from the same folder: no collision
        run_app(app, NODES)
    folders = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert folders == ["flower-plugin-ccvr-1", "flower-plugin-ccvr-1-2"]
    assert all((tmp_path / "runs" / f / "summary.json").is_file() for f in folders)


def test_threads_are_the_plugins_own_and_restored():
    seen = []

    def model():
        seen.append(torch.get_num_threads())
        return Net()

    app = make_client_app()
    app._registered_funcs = {k: v for k, v in app._registered_funcs.items()
                             if not k.startswith("query.")}
    CalibrationClient(model, node_data, head="fc3", threads=1).attach(app)
    grid = InProcessGrid(app, {}, NODES)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        preflight(grid, Net(), None, head="fc3", test_data=eval_loader(), threads=2)
        assert seen and set(seen) == {1}  # the nodes' own count, whatever the server's
        assert torch.get_num_threads() == 2  # the app's count, as it left it
    finally:
        torch.set_num_threads(before)
    # each party's own: not part of the settings the server and the nodes compare
    assert resolve(gather({"threads": 4}, {}), clients=3).digest() == \
        resolve(gather({}, {}), clients=3).digest()


SCRIPT = """
import json, logging, sys
sys.path.insert(0, sys.argv[1])
root = logging.getLogger()
before = [repr(h) for h in root.handlers], root.level
from plugin_app import NODES, Net, eval_loader, make_client_app
from privfedcal.flower.grid import InProcessGrid
from privfedcal.flower.plugin import preflight
fresh = "opacus" not in sys.modules
grid = InProcessGrid(make_client_app(), {"privfedcal.dp-eps": 8.0, "privfedcal.dp-clip": 5.0},
                     NODES)
preflight(grid, Net(), None, head="fc3", test_data=eval_loader(), dp_eps=8.0, dp_clip=5.0)
print(json.dumps({"fresh": fresh, "opacus": "opacus.utils.module_utils" in sys.modules,
                  "kept": before == ([repr(h) for h in root.handlers], root.level)}))
"""


def test_the_dp_path_leaves_the_root_logger_as_it_was():
    """opacus' import calls logging.basicConfig: Flower's lines would print twice."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(HERE)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == \
        {"fresh": True, "opacus": True, "kept": True}
