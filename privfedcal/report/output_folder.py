"""Output folders of the jobs (the CLI's commands and ``privfedcal.jobs``): checked before
any work, written all or nothing.

An unwritable ``--out`` is refused before training or attacking starts (one line, exit 2).
Earlier results (an attack's ``attack.json``, an audit's ``audit.csv``) are never replaced
without ``--overwrite``. Result files are first written under partial names and renamed
together at the end, so an error or Ctrl-C half-way leaves the earlier files as they were.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from privfedcal.settings.messages import SettingError, SettingText


def check_writable(folder: Path, flag: str | None = None) -> None:
    """``folder`` can be created (or written into): its nearest existing ancestor is a
    folder this process may write. Permission bits are not enough (root passes them under
    ``/proc`` and ``/sys``, which refuse new entries all the same), so a probe folder is
    made there and removed at once; nothing is left behind. The message names the folder
    as ``flag`` where a caller has its own word for it, else as the ``out`` setting, in its
    reader's spelling (``--out``, ``out``)."""
    folder = Path(folder)
    probe = folder
    where = flag if flag is not None else SettingText("{out}")
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        what = "is" if probe == folder else f"lies under {probe}, which is"
        raise SettingError("cannot write to {where} {folder}: it {what} not a folder",
                           where=where, folder=folder, what=what)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SettingError("cannot write to {where} {folder}: {probe} is not writable",
                           where=where, folder=folder, probe=probe)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".privfedcal-probe-", dir=probe))
    except OSError as exc:
        raise SettingError("cannot write to {where} {folder}: {probe} takes no new files "
                           "({reason})", where=where, folder=folder, probe=probe,
                           reason=exc.strerror or exc) from None


def check_fresh(folder: Path, names: Sequence[str], *, overwrite: bool,
                what: str = "results") -> None:
    """Refuse to replace earlier results in ``folder`` (any of ``names``) unless
    ``overwrite``; also check that ``folder`` is writable. The message names the options
    through their declarations: the CLI's flags (``--overwrite``), the jobs' keywords
    (``overwrite=True``)."""
    check_writable(folder)
    held = [n for n in names if (Path(folder) / n).exists()]
    if held and not overwrite:
        raise SettingError("{folder} already holds {what} ({held}); pass {overwrite} to "
                           "replace them, or {out} another folder", folder=folder, what=what,
                           held=", ".join(held))


def partial_path(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place (same suffix, so that
    writers choosing the format by extension keep working)."""
    return path.with_name(f"{path.stem}.partial{path.suffix}")


@contextlib.contextmanager
def all_or_nothing(folder: Path, names: Sequence[str]) -> Iterator[dict[str, Path]]:
    """Yield ``{name: partial path}`` in ``folder``; on success rename every partial file
    onto its name, on any error (Ctrl-C included) delete them and re-raise. A folder this
    created and left empty is removed."""
    folder = Path(folder)
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SettingError("cannot write to {out} {folder}: {reason}", folder=folder,
                           reason=exc.strerror or exc) from None
    partial = {n: partial_path(folder / n) for n in names}
    try:
        yield partial
        missing = [n for n, p in partial.items() if not p.exists()]
        if missing:
            raise RuntimeError(f"result file(s) not written: {', '.join(missing)}")
        for n, p in partial.items():
            os.replace(p, folder / n)
    except BaseException:
        for p in partial.values():
            p.unlink(missing_ok=True)
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty
        raise
