"""privfedcal's calibration with its protections as a plugin for a Flower app of one's own.

Client (the user's ``ClientApp``)::

    CalibrationClient(Net, data=trainloader_of, head="fc3").attach(app)

Server (the user's ``ServerApp`` main: ``preflight`` before ``strategy.start``, every
check on the server and the nodes before training; ``calibrate`` after it)::

    preflight(grid, model, context, head="fc3", test_data=testloader)
    summary = calibrate(grid, model, context, method="ccvr", head="fc3", test_data=testloader)

Both read privfedcal's settings from keyword arguments and the run config's
``privfedcal.*`` keys (``privfedcal.dp-eps``, ``privfedcal.secagg``,
``privfedcal.hide-counts``...; ``plugin_settings.py``); a node also from its node config, never
from the server's messages. ``HeadAdapter`` shows the user's model to the calibrators
through its head's input (a forward pre-hook) without renaming anything. With
``privfedcal.dp-clip = "auto"`` (the default under DP) the nodes choose the feature clip
privately within the budget (``clip.py``). ``PrivateUpdates`` wraps the user's strategy
in DP-FedAvg charged to the same budget (``dp_fedavg.py``). The server reuses privfedcal's own Flower machinery
(``FlowerSimulator``, ``GridLink``, the planner; ``server_calibration.py`` says which parts). See
docs/flower.md.
"""

from privfedcal.flower.plugin.client import CalibrationClient
from privfedcal.flower.plugin.dp_fedavg import PrivateUpdates
from privfedcal.flower.plugin.plugin_settings import PluginSettings
from privfedcal.flower.plugin.preflight import PreflightError, preflight
from privfedcal.flower.plugin.server_calibration import calibrate
from privfedcal.models.head_adapter import HeadAdapter, find_head

__all__ = ["CalibrationClient", "HeadAdapter", "PluginSettings", "PreflightError",
           "PrivateUpdates", "calibrate", "find_head", "preflight"]
