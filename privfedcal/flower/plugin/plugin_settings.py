"""The plugin's settings: what the server and every node must agree on, and where each
side reads them.

Both sides build privfedcal's own ``RunConfig`` and ``FlowerOptions`` from the same settings
(``parse_run_config``, with its checks), so the planner (``privacy/planner.py``
``plan_protection``) gives the server and each node the same releases, noise, ledger limits
and CKKS set-up. Sources,
each overriding the one before:

1. keyword arguments (``CalibrationClient(..., dp_eps=8)``, ``calibrate(..., dp_eps=8)``);
2. the run config's ``privfedcal.*`` keys (``privfedcal.dp-eps = 8.0`` in the app's
   ``[tool.flwr.app.config]``: one place both sides read);
3. on a node only, its node config's ``privfedcal.*`` keys (the node operator's own).

A node never reads a setting from a server's message. The names are ``privfedcal train``'s
(``dp-eps``, ``dp-clip``, ``secagg``, ``hide-counts``, ``secagg-min-clients``,
``flower.key-holder``, ``flower.min-replies``, ``calibration-params.virtual-per-class``...;
keyword arguments spell them with ``_``), plus the plugin's own:

* ``method``: ``ccvr`` or ``creff``;
* ``threads``: torch threads for the plugin's own work on that party (unset: as the app
  left them; each party its own, not compared; ``wording.torch_threads``);
* ``clients``: the number of nodes K (default: the node config's ``num-partitions`` on a
  node, the number of connected nodes on the server);
* ``dp-clip = "auto"``: the feature clip chosen privately by the nodes within the budget
  (``clip.py``); the default under DP, where no clip is set;
* ``examples``: a public upper bound on the nodes' training examples together. It sets the
  default delta (``min(1e-5, 1/(10 N))``, as ``privfedcal train``); unset, delta defaults
  to 1e-5 and the server bounds CKKS magnitudes by the sizes the nodes report (a node that
  under-reports can only make a secure sum fail the key holder's check).

``digest`` is what a node's ``query.hello`` reply shows the server: a hash of the resolved
settings, so that a node configured otherwise (another epsilon, secagg off) is refused
before any release instead of being accounted with the server's numbers.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from privfedcal.errors import UsageError
from privfedcal.flower.plugin.clip import AUTO, AutoClip, default_clip, with_update_release
from privfedcal.flower.records import FlowerOptions, parse_run_config
from privfedcal.privacy.dp import default_delta
from privfedcal.settings.run_config import RunConfig

__all__ = ["DATASET", "METHODS", "PREFIX", "PluginSettings", "gather", "resolve"]

PREFIX = "privfedcal."
METHODS = ("ccvr", "creff")
#: the ``dataset`` a plugin run's config.json names: the data are the app's own
DATASET = "flower-app"
#: privfedcal settings a plugin run takes (run-config spelling)
RUN_KEYS = ("dp-eps", "dp-delta", "dp-clip", "dp-grad-clip", "accountant", "secagg",
            "hide-counts", "secagg-min-clients", "rounds", "participation", "seed", "threads",
            "dp-updates", "dp-update-clip", "dp-updates-share")
FLOWER_KEYS = ("flower.key-holder", "flower.min-replies", "flower.round-timeout",
               "flower.poll-interval", "flower.node-wait")
PLUGIN_KEYS = ("method", "clients", "examples")
#: settings of the server's waiting, and each party's own threads: the server and the nodes
#: may differ in them (not in the digest)
SERVER_ONLY = ("flower.min-replies", "flower.round-timeout", "flower.poll-interval",
               "flower.node-wait", "threads")
CALIBRATION = "calibration-params."
KEYS = PLUGIN_KEYS + RUN_KEYS + FLOWER_KEYS
#: delta where neither dp-delta nor examples is given
PLUGIN_DELTA = 1e-5


def _valid() -> str:
    return ", ".join((*KEYS, CALIBRATION + "NAME"))


def _check_key(key: str, where: str) -> str:
    key = key.replace("_", "-")
    if key in KEYS or (key.startswith(CALIBRATION) and len(key) > len(CALIBRATION)):
        return key
    raise UsageError(f"{where}: unknown privfedcal setting {key!r}; valid: {_valid()}")


def from_keywords(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments (``dp_eps``, ``key_holder``, ``calibration_params={...}``) as
    run-config keys."""
    flat: dict[str, Any] = {}
    for name, value in kwargs.items():
        if value is None:
            continue
        if name == "calibration_params":
            if not isinstance(value, Mapping):
                raise UsageError(f"calibration_params must be a mapping, got {value!r}")
            flat.update({CALIBRATION + str(k).replace("_", "-"): v for k, v in value.items()})
            continue
        key = name.replace("_", "-")
        if "flower." + key in FLOWER_KEYS:
            key = "flower." + key
        flat[_check_key(key, "keyword argument")] = value
    return flat


def from_config(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The ``privfedcal.*`` entries of a run or node config, without the prefix; an empty
    value (``privfedcal.dp-eps = ""``) is unset, as a key left out."""
    return {_check_key(k[len(PREFIX):], where): v for k, v in config.items()
            if k.startswith(PREFIX) and v != ""}


def gather(kwargs: Mapping[str, Any], run_config: Mapping[str, Any],
           node_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings from their sources, later ones winning (module docstring)."""
    flat = from_keywords(kwargs)
    flat.update(from_config(run_config, "run config"))
    if node_config is not None:
        flat.update(from_config(node_config, "node config"))
    return flat


@dataclass(frozen=True)
class PluginSettings:
    """The resolved settings of one side: privfedcal's config and Flower options."""

    cfg: RunConfig
    options: FlowerOptions
    examples: int | None
    flat: dict[str, Any]
    #: with dp-clip = "auto": the clip's search and the run's one noise plan (its ``cfg``
    #: has the whole budget and no clip until the search has chosen one)
    auto_clip: AutoClip | None = None

    @property
    def method(self) -> str:
        return self.cfg.calibrator

    def digest(self) -> str:
        """A hash of the settings both sides must share (``query.hello``'s ``settings``)."""
        text = json.dumps(self.flat, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _plan_auto_clip(cfg: RunConfig) -> AutoClip:
    """The search's and the calibration releases' noise in one plan for the run's target
    (clip.py), from the releases ``cfg`` declares: the same on the server and every node."""
    from privfedcal.experiment import calibrator_class
    from privfedcal.privacy.planner import protection_inputs, release_plans
    from privfedcal.settings.floors import PrivacyOptions

    p = cfg.privacy
    if p.dp_delta is None:  # resolve sets it under DP; a guard, not a user path
        raise UsageError("dp-clip='auto' needs dp-delta")
    if p.dp_eps is None:
        raise UsageError("dp-clip='auto' needs dp-eps")
    inputs = protection_inputs(PrivacyOptions.of(cfg), calibrator_class(cfg))
    return AutoClip.plan(float(p.dp_eps), float(p.dp_delta), p.accountant,
                         with_update_release(inputs, release_plans(inputs)))


def resolve(flat: Mapping[str, Any], *, clients: int | None) -> PluginSettings:
    """``flat`` (``gather``) as privfedcal's ``RunConfig`` and ``FlowerOptions``;
    ``clients`` where the settings give none (the node config's or the Grid's count)."""
    flat = dict(flat)
    method = flat.pop("method", "ccvr")
    if method not in METHODS:
        raise UsageError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    k = flat.pop("clients", clients)
    if k is None:
        raise UsageError("the number of nodes is unknown: give clients= or the run "
                         "config's privfedcal.clients")
    k = _int(k, "clients", 1)
    examples = flat.pop("examples", None)
    if examples is not None:
        examples = _int(examples, "examples", 1)
    eps = flat.get("dp-eps", math.inf)
    dp_on = isinstance(eps, int | float) and not isinstance(eps, bool) and math.isfinite(eps)
    if dp_on and flat.get("dp-delta") is None:
        # both sides must plan the same noise: delta from public numbers only
        flat["dp-delta"] = default_delta(examples) if examples else PLUGIN_DELTA
    if method == "creff" and not any(key.endswith("dsa") for key in flat
                                     if key.startswith(CALIBRATION)):
        # CReFF's default augmentation is for images; an app's inputs may be anything
        flat[CALIBRATION + "dsa"] = "none"
    flat = default_clip(flat, dp_on)  # under DP the search's clip unless one is set
    run_flat = dict(flat)
    auto_clip = flat.get("dp-clip") == AUTO
    if auto_clip:  # the clip chosen privately, within the one budget (clip.py)
        if not dp_on:
            raise UsageError("dp-clip='auto' needs dp-eps: the clip is chosen within the DP "
                             "budget (give a number without DP)")
        del run_flat["dp-clip"]  # the search's clip, once chosen
    # rounds: CReFF's calibration rounds on the final model (CCVR makes one release)
    run = {"method": "fedavg", "calibrate": method, "clients": k, "dataset": DATASET,
           "workers": 1, "rounds": 1, **run_flat}
    cfg, options = parse_run_config(run)
    auto = _plan_auto_clip(cfg) if auto_clip else None
    shared = {"method": method, "clients": k, "examples": examples,
              **{key: v for key, v in flat.items() if key not in SERVER_ONLY}}
    return PluginSettings(cfg, options, examples, shared, auto)
