"""Where does a run's configuration travel? Every call that receives the ``RunConfig`` (or a
narrow option built from it, privfedcal/settings/floors.py) between the command line and the
training loop.

The walk of the settings from the command line (``privfedcal train ...``, run in this process
under ``sys.setprofile``) is the sequence of *stays*: calls of a ``privfedcal`` function one
of whose arguments (``self`` aside) is a ``RunConfig`` or a narrow option (``OPTION_TYPES``).
Each stay is in a *room* (the function's module) on a *floor* (the layer of its top-level
package in ``tests/package/test_layering.py``'s ``LAYERS``). Counted:

- stays: calls that receive the settings, and rooms: distinct modules among them;
- returns: stays in a room already visited (stays - rooms);
- climbs back up: stays called from a lower floor (the nearest ``privfedcal`` frame that
  called them) into a higher one, a callback carrying the settings up the layers; "in walk
  order": stays on a higher floor than the stay before them;
- for the whole ``RunConfig`` alone: its stays, rooms, stays below experiment.py's floor
  (where narrow options should have taken over) and climbs in walk order; calls of
  privfedcal/settings/floors.py that build narrow options from it, and of config.py, the type's
  own module (resolving the per-model defaults, the line of resolved settings), are
  counted apart.

    python benchmarks/probes/config_walk.py -- train --rounds 1 --threads 1
    python benchmarks/probes/config_walk.py -- train --rounds 1 --threads 1 --calibrate ccvr --dp-eps 8

``--show`` prints every stay (floor, function, the arguments that carry settings); ``--deep``
also counts arguments holding the settings in an attribute (an object's ``cfg``). The
run's folder goes to a temporary directory unless ``--out`` is given; tracing slows the run,
not the counts. Results: docs/architecture.md, "Options at the layers".
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import sys
import tempfile
from pathlib import Path

#: experiment.py's floor, where a run is assembled from its settings: the floors below it
#: (federation, privacy, algorithms, data, models, the foundations) should receive narrow
#: options, not the whole RunConfig
TOP_FLOOR = 4
#: the types that carry settings, by class name (a type a version lacks is never seen)
OPTION_TYPES = ("RunConfig", "DataOptions", "LocalSpec", "EngineSettings", "PrivacyOptions",
                "RunOptions")


def layers() -> dict[str, int]:
    """``LAYERS`` of the layering test, read from its source (the test is not a package)."""
    import ast

    import privfedcal

    root = Path(privfedcal.__file__).resolve().parents[1]
    text = (root / "tests" / "package" / "test_layering.py").read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "LAYERS":
            return ast.literal_eval(node.value)
    raise SystemExit("LAYERS not found in tests/package/test_layering.py")


def floor_of(module: str, table: dict[str, int]) -> int:
    parts = module.split(".")
    return table.get(parts[1] if len(parts) > 1 else "", -1)


def walk(argv: list[str], deep: bool = False) -> dict:
    import privfedcal
    from privfedcal.cli.main import main

    pkg = str(Path(privfedcal.__file__).parent)
    table = layers()
    stays: list[dict] = []

    def carries(frame) -> list[str]:
        code = frame.f_code
        n = code.co_argcount + code.co_kwonlyargcount
        local = frame.f_locals
        found = []
        for name in code.co_varnames[:n]:
            value = local.get(name)
            kind = type(value).__name__
            if kind in OPTION_TYPES:
                if name not in ("self", "cls"):  # an option object's own methods: no travel
                    found.append(f"{name}:{kind}")
            elif deep:  # an object holding the settings in an attribute (its cfg)
                held = getattr(value, "__dict__", None)
                if isinstance(held, dict):
                    inner = [f"{name}.{k}:{type(v).__name__}" for k, v in held.items()
                             if type(v).__name__ in OPTION_TYPES]
                    found += inner[:1]
        return found

    def caller_module(frame) -> str | None:
        f = frame.f_back
        while f is not None:
            if f.f_code.co_filename.startswith(pkg):
                return f.f_globals.get("__name__", "?")
            f = f.f_back
        return None

    conversions = collections.Counter()
    own = collections.Counter()

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(pkg):
            return
        found = carries(frame)
        if not found:
            return
        if frame.f_globals.get("__name__") == "privfedcal.settings.sections":
            conversions[frame.f_code.co_qualname] += 1  # building the narrow options
            return
        if frame.f_globals.get("__name__") == "privfedcal.settings.run_config":
            own[frame.f_code.co_qualname] += 1  # the type's own module: resolving, printing
            return
        module = frame.f_globals.get("__name__", "?")
        caller = caller_module(frame)
        stays.append({"module": module, "function": frame.f_code.co_qualname,
                      "floor": floor_of(module, table), "args": found, "caller": caller,
                      "caller_floor": None if caller is None else floor_of(caller, table)})

    sys.setprofile(profile)
    try:
        main(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        sys.setprofile(None)
    visits = collections.Counter(s["module"] for s in stays)
    climbs = [s for s in stays if s["caller_floor"] is not None
              and s["caller_floor"] < s["floor"]]
    ups = sum(1 for a, b in itertools.pairwise(stays) if b["floor"] > a["floor"])
    whole = [s for s in stays if any(a.endswith(":RunConfig") for a in s["args"])]
    whole_ups = sum(1 for a, b in itertools.pairwise(whole) if b["floor"] > a["floor"])
    return {"argv": argv, "stays": len(stays), "rooms": len(visits),
            "returns": len(stays) - len(visits), "climbs": len(climbs), "walk_climbs": ups,
            "runconfig_stays": len(whole), "runconfig_rooms": len({s["module"] for s in whole}),
            "runconfig_below_top": sum(1 for s in whole if 0 <= s["floor"] < TOP_FLOOR),
            "runconfig_walk_climbs": whole_ups, "conversions": sum(conversions.values()),
            "own_module": sum(own.values()),
            "most_visited": visits.most_common(5),
            "climbs_list": [f"{s['caller']} ({s['caller_floor']}) -> {s['module']}."
                            f"{s['function']} ({s['floor']})" for s in climbs],
            "walk": [f"{s['floor']} {s['module']}.{s['function']}({', '.join(s['args'])})"
                     for s in stays]}


def main() -> None:
    parser = argparse.ArgumentParser(description="Trace where a run's settings travel.")
    parser.add_argument("--json", help="write the counts and the walk to this file")
    parser.add_argument("--show", action="store_true", help="print every stay")
    parser.add_argument("--deep", action="store_true",
                        help="count arguments that hold the settings in an attribute too")
    parser.add_argument("argv", nargs="+", help="privfedcal's arguments, after --")
    args = parser.parse_args()
    argv = list(args.argv)
    with tempfile.TemporaryDirectory() as tmp:
        if argv[0] == "train" and "--out" not in argv:
            argv += ["--out", str(Path(tmp) / "run")]
        result = walk(argv, deep=args.deep)
    shown = [a for a in args.argv]
    print(f"privfedcal {' '.join(shown)}: {result['stays']} stays in {result['rooms']} rooms, "
          f"{result['climbs']} climbs back up ({result['walk_climbs']} in walk order), "
          f"{result['returns']} returns; most visited: "
          + ", ".join(f"{m} {n}" for m, n in result["most_visited"]))
    print(f"  the RunConfig itself: {result['runconfig_stays']} stays in "
          f"{result['runconfig_rooms']} rooms, {result['runconfig_below_top']} below "
          f"experiment.py's floor, {result['runconfig_walk_climbs']} climbs in walk order; "
          f"{result['conversions']} calls building narrow options and {result['own_module']} "
          "of config.py's own functions (not counted as stays)")
    for line in result["climbs_list"]:
        print("  climb:", line)
    if args.show:
        print("\n".join(result["walk"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
