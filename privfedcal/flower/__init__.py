"""Flower integration (``pip install "privfedcal[flower]"``, Flower 1.41).

The components of a Flower app (``[tool.flwr.app.components]``):

* ``privfedcal.flower.server_app:app``: the simulator's round loop, clients reached through
  Flower messages (``server.FlowerSimulator``);
* ``privfedcal.flower.client_app:app``: one SuperNode = one client (``partition-id`` in its
  node config), training and computing calibration payloads with the simulator's own code.

See ``docs/flower.md`` and ``examples/flower/``.
"""

try:
    import flwr  # noqa: F401
except ModuleNotFoundError as exc:  # the base install has no Flower: say which extra brings it
    raise ModuleNotFoundError(
        "privfedcal.flower needs Flower 1.41: install the extra with "
        "pip install -e \".[flower]\" (from a clone) or pip install \"privfedcal[flower]\"",
        name=exc.name,
    ) from exc
