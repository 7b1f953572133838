"""One spelling of the run folder across commands.

Every command that reads a run folder takes it as a positional argument or as ``--run DIR``
(the same thing): ``privfedcal analyze RUN`` and ``privfedcal analyze --run RUN``,
``privfedcal attack invert --stats RUN`` and ``... --run RUN``. ``compare`` takes several.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, overload

from privfedcal.errors import UsageError

#: help of the positional run folder
RUN_ARG_HELP = "Run folder (the same as --run)."


@overload
def run_folder(positional: Path | None, option: Path | None, command: str, *,
               required: Literal[True]) -> Path: ...
@overload
def run_folder(positional: Path | None, option: Path | None, command: str, *,
               required: bool) -> Path | None: ...
def run_folder(positional: Path | None, option: Path | None, command: str, *,
               required: bool) -> Path | None:
    """The run folder given either way; refused when given twice differently, or missing
    where ``command`` needs one."""
    if positional is not None and option is not None and positional != option:
        raise UsageError(f"{command}: the run folder was given twice ({positional} and --run "
                         f"{option}); give it once")
    run = positional if positional is not None else option
    if run is None and required:
        raise UsageError(f"{command} needs a run folder: privfedcal {command} RUN "
                         "(or --run RUN)")
    return run


def run_folders(positional: list[Path] | None, option: list[Path] | None) -> list[Path]:
    """Several run folders: the positional ones then every ``--run``, each once, in order."""
    return list(dict.fromkeys([*(positional or []), *(option or [])]))
