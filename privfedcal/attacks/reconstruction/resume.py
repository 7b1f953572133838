"""A partial attack: the targets an interrupted ``attack invert`` finished, and its resume.

An interrupted attack (Ctrl-C or SIGTERM: ``progress.Stopped``) writes ``attack.json`` as an
object ``{"partial": true, "targets_done": k, "targets_planned": n, "settings": ...,
"done": [target keys], "records": [...]}`` (a finished attack's attack.json stays the list
of records) and the finished targets' true and reconstructed images to
``attack-partial.safetensors``. ``--resume`` with the same settings (``settings`` here:
the attack, the run folder, every option and the chosen clients and classes) runs the
other targets only (``finished``; ``runner.execute(done=...)``) and writes the complete
attack: its records and images are those of one uninterrupted run (every target draws its
start from its own generator).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import Tensor

from privfedcal.attacks.reconstruction.scoring import Attacked, _plain
from privfedcal.errors import UsageError

#: the finished targets' images of a partial attack, beside its attack.json
PARTIAL_IMAGES = "attack-partial.safetensors"


def job_keys(descriptions: Sequence[str]) -> list[str]:
    """A key per job: its description, numbered where descriptions repeat."""
    seen: dict[str, int] = {}
    keys = []
    for d in descriptions:
        seen[d] = seen.get(d, 0) + 1
        keys.append(d if seen[d] == 1 else f"{d} #{seen[d]}")
    return keys


def plain_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` as they read back from JSON (tuples become lists), for comparison."""
    return json.loads(json.dumps(_plain(dict(settings))))


def write_partial(json_path: Path, images_path: Path, settings: Mapping[str, Any],
                  keys: Sequence[str], finished: Mapping[int, Attacked]) -> None:
    """The partial attack.json and its images: the targets ``finished`` (plan index ->
    result) of the plan whose jobs have ``keys``."""
    order = sorted(finished)
    doc = {"partial": True, "targets_done": len(order), "targets_planned": len(keys),
           "settings": plain_settings(settings), "done": [keys[i] for i in order],
           "records": [finished[i].record for i in order]}
    json_path.write_text(json.dumps(_plain(doc), indent=1, allow_nan=False))
    tensors: dict[str, Tensor] = {}
    for n, i in enumerate(order):
        tensors[f"{n}.truth"] = finished[i].truth.detach().cpu().contiguous()
        tensors[f"{n}.recon"] = finished[i].recon.detach().cpu().contiguous()
    save_file(tensors, str(images_path))


@dataclass(frozen=True)
class PartialAttack:
    """A partial attack read back: its settings, and the finished targets by key."""

    settings: dict[str, Any]
    planned: int
    targets: dict[str, Attacked]


def read_partial(folder: Path) -> PartialAttack | None:
    """The partial attack in ``folder``; None where its attack.json is absent or complete."""
    path = Path(folder) / "attack.json"
    try:
        doc = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("partial") is not True:
        return None
    try:
        images = load_file(str(Path(folder) / PARTIAL_IMAGES))
    except FileNotFoundError:
        raise UsageError(f"{path} is a partial attack but {PARTIAL_IMAGES} beside it is "
                         "missing; start over with --overwrite") from None
    targets = {key: Attacked(rec, images[f"{n}.truth"], images[f"{n}.recon"])
               for n, (key, rec) in enumerate(zip(doc["done"], doc["records"], strict=True))}
    return PartialAttack(doc["settings"], int(doc["targets_planned"]), targets)


def finished(partial: PartialAttack, settings: Mapping[str, Any],
             keys: Sequence[str]) -> dict[int, Attacked]:
    """The targets of ``partial`` as ``execute``'s ``done`` (plan index -> result), after
    checking that it was made with the same ``settings`` and plans the same targets."""
    now = plain_settings(settings)
    differ = sorted(k for k in set(now) | set(partial.settings)
                    if now.get(k) != partial.settings.get(k))
    if differ:
        raise UsageError(f"--resume: the partial attack was made with other settings "
                         f"({', '.join(differ)} differ); rerun it with those, or start over "
                         "with --overwrite")
    unknown = set(partial.targets) - set(keys)
    if unknown or partial.planned != len(keys):
        raise UsageError("--resume: the partial attack planned other targets than this run "
                         "plans now; start over with --overwrite")
    return {i: partial.targets[k] for i, k in enumerate(keys) if k in partial.targets}
