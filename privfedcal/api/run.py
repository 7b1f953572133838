"""A run folder as the Python API hands it out (``Run``: read lazily, saved on request) and
the temporary folder an in-memory run lives in (``Scratch``). ``train`` and ``resume``
(``api/__init__.py``) make them; ``privfedcal.api`` re-exports ``Run``.

The keyword checks that the API's modules share (``bool``, ``progress``) are registered
here, in the module they all import first."""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from privfedcal.api.arguments import as_path, coerce, plain_value, python_surface, register_check
from privfedcal.errors import UsageError
from privfedcal.report.output_folder import check_writable
from privfedcal.settings.run_config import RunConfig

if TYPE_CHECKING:
    from privfedcal.federation.setup import Experiment
    from privfedcal.results import MetricsRow, Summary

__all__ = ["Run", "Scratch"]


register_check("bool", lambda v, n, o: coerce(v, bool, n, o))


def check_progress(value: Any, name: str, optional: bool) -> Any:
    """``progress``: None (a bar when interactive), True, False or a callable."""
    value = plain_value(value)
    if (value is None and optional) or isinstance(value, bool) or callable(value):
        return value
    raise UsageError(f"{name} must be callable, True or False, got {type(value).__name__}")


def _read_json(text: str, where: str | Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where} is not valid JSON ({exc.msg})") from None


class Scratch:
    """A temporary folder that holds in-memory runs: removed when the last ``Run`` holding
    it is garbage-collected, or at interpreter exit."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="privfedcal-"))
        self._removal = weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)

    def __deepcopy__(self, memo: dict[int, Any]) -> Scratch:
        return self  # one owner: a copied Run shares the folder (and keeps it alive)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}  # unpickled (another process), it refers without owning


@dataclass(frozen=True)
class Run:
    """A run folder (``privfedcal train``'s or ``train()``'s), read lazily.

    ``path`` is the folder; ``config`` its settings (the experimenter's, with the data seed);
    ``summary`` and ``metrics`` the files of the same names; ``server_view`` the folder an
    auditor is given (``RUN/server``: public config, transcript, summary). A run trained
    without ``out`` is kept in a temporary folder that lives as long as the ``Run`` (and
    the runs ``resume`` makes of it): ``in_memory`` is then True, and ``save`` keeps it."""

    path: Path
    #: the temporary folder an in-memory run lives in (None for a folder of one's own)
    scratch: Scratch | None = field(default=None, repr=False, compare=False)

    @property
    def in_memory(self) -> bool:
        """True for a run in a temporary folder, removed with the ``Run`` (``save`` it)."""
        return self.scratch is not None

    @property
    def config(self) -> RunConfig:
        from privfedcal.settings.run_config import read_run_config

        return read_run_config(self.path)

    @property
    def summary(self) -> Summary:
        """``summary.json``, typed (``privfedcal.results.Summary``; docs/api.md, "Result
        types"); keys of another version are kept untyped, a damaged file is a
        ``UsageError`` naming it."""
        from privfedcal.results import summary_from_dict

        file = self.path / "summary.json"
        if not file.is_file():
            raise UsageError(f"{self.path} has no summary.json: the run did not finish")
        return summary_from_dict(_read_json(file.read_text(), file), strict=False,
                                 where=str(file))

    @property
    def accuracy(self) -> float:
        """Test accuracy of the final (calibrated) model, a fraction."""
        accuracy = self.summary["accuracy"]
        if accuracy is None:  # a diverged run's summary
            raise UsageError(f"{self.path} has no accuracy: the run diverged (summary.json)")
        return float(accuracy)

    @property
    def metrics(self) -> list[MetricsRow]:
        """One record per evaluated round (``metrics.jsonl``), typed as ``summary``."""
        from privfedcal.results import metrics_row_from_dict

        file = self.path / "metrics.jsonl"
        if not file.is_file():
            return []
        return [metrics_row_from_dict(_read_json(line, f"{file}:{n}"), strict=False,
                                      where=f"{file}:{n}")
                for n, line in enumerate(file.read_text().splitlines(), 1) if line.strip()]

    @property
    def server_view(self) -> Path:
        from privfedcal.federation.runfolder import server_dir

        return server_dir(self.path)

    @python_surface
    def experiment(self, device: str = "cpu") -> Experiment:
        """The run's experiment as the experimenter holds it (``federation/setup.py``
        ``Experiment``: ``data``, the clients' index tensors ``parts``, ``counts``, ``model``),
        its partition redrawn from the recorded data seed and ``model`` holding the final
        (calibrated) weights from ``final/``."""
        from privfedcal.experiment import build_experiment
        from privfedcal.federation.checkpoint import load_checkpoint

        exp = build_experiment(self.config.replace(device=device, workers=1))
        final = self.path / "final"
        if final.is_dir():
            exp.model.load_state_dict(load_checkpoint(final, exp.device)["model"])
        exp.model.eval()
        return exp

    def report(self) -> Path:
        """Write ``report.html`` (``privfedcal report``) and return its path."""
        from privfedcal.report.run_report import build_run_report

        return Path(build_run_report(self.path))

    @python_surface
    def save(self, path: str | Path, overwrite: bool = False) -> Run:
        """Copy the run to the folder ``path`` (the folder ``privfedcal train --out path``
        writes) and return it as a ``Run`` of its own. A ``path`` that holds a run is
        refused unless ``overwrite`` (then that run folder is replaced: only a folder with a
        ``config.json``, never another one); a non-empty folder that holds no run is
        refused either way. The saved ``config.json`` records ``path`` as the run's
        ``out``."""
        dest = Path(path)
        here = self.path.resolve()
        if dest.resolve() == here:
            return self
        if here in dest.resolve().parents:
            raise UsageError(f"cannot save {self.path} into itself ({dest})")
        make_room(dest, overwrite, "pick another path or give overwrite=True")
        if dest.is_dir() and any(dest.iterdir()):
            raise UsageError(f"{dest} is not empty and holds no run: save into a new or "
                             "empty folder")
        check_writable(dest, flag="path")
        shutil.copytree(self.path, dest, dirs_exist_ok=True)
        from privfedcal.federation.runfolder import server_dir

        for folder in (dest, server_dir(dest)):
            record = folder / "config.json"
            if record.is_file():
                record.write_text(json.dumps({**json.loads(record.read_text()),
                                              "out": str(dest)}, indent=2))
        saved = Run(dest)
        if (dest / "report.html").is_file():  # it shows the settings, ``out`` included
            saved.report()
        return saved


register_check("Run | str | Path",
               lambda v, n, o: v if isinstance(v, Run) else as_path(v, n, o))


def make_room(folder: Path, overwrite: bool, hint: str) -> None:
    """Refuse a ``folder`` that holds a run (its ``checkpoint/`` or ``summary.json``)
    unless ``overwrite``; with ``overwrite``, remove it if it is a run folder (a
    ``config.json`` in a real folder, not a link) and refuse a non-empty folder that is not
    one: only a run folder is ever deleted."""
    holds = (folder / "checkpoint").exists() or (folder / "summary.json").exists()
    if not overwrite:
        if holds:
            raise UsageError(f"{folder} already holds a run; {hint}")
        return
    if not folder.exists() or (folder.is_dir() and not folder.is_symlink()
                               and not any(folder.iterdir())):
        return
    if folder.is_symlink() or not folder.is_dir() or not (folder / "config.json").is_file():
        raise UsageError(f"{folder} is not a privfedcal run folder (no config.json): "
                         "overwrite=True replaces only a run folder")
    shutil.rmtree(folder)
