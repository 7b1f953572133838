"""What every job of the Python API shares: its progress (``JobStep``, and ``Watch``, which
logs it and draws a bar), the checks of its arguments by annotation, and its error messages in
keywords rather than the command's flags, from the declaration of its options (``job``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from privfedcal.api import Run
from privfedcal.api.arguments import coerce, python_surface, register_check
from privfedcal.errors import UsageError
from privfedcal.settings.messages import declare_spelling

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class JobStep:
    """Progress of a long job: what it is doing, ``done`` of ``total`` (None: not counted).
    A job that reports its start (``audit``) does so with an empty ``description``, once
    its input is checked."""

    description: str
    done: int = 0
    total: int | None = None


def report_step(progress: Callable[[JobStep], None] | None, step: JobStep) -> None:
    if progress is not None:
        progress(step)


class Watch:
    """What a job shows from Python, as ``train`` and ``attack`` do (``api/log.py``): its
    start, each new step and its end at INFO on the ``privfedcal`` logger, and a bar when
    ``progress`` asks for one (None: when interactive; True: always; False: none), or the
    caller's callable. The watch is the ``progress`` given to the job's half for the CLI."""

    def __init__(self, progress: bool | Callable[[JobStep], None] | None, name: str) -> None:
        self.progress, self.name = progress, name
        self.bar: Any = None
        self.opened, self.doing = False, ""

    def __enter__(self) -> Watch:
        from privfedcal.api.log import logger

        logger.info("%s: started", self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        from privfedcal.api.log import logger

        if self.bar is not None:
            self.bar.close()
        if exc[0] is None:
            logger.info("%s: done", self.name)

    def __call__(self, step: JobStep) -> None:
        from privfedcal.api.log import logger, open_bar

        if callable(self.progress):
            self.progress(step)
        if step.description and step.description != self.doing:
            self.doing = step.description
            logger.info("%s: %s", self.name, step.description)
        if not self.opened and step.total is not None:  # the total is known from here
            self.opened, self.bar = True, open_bar(self.progress, self.name, step.total,
                                                   step.done)
        if self.bar is not None and step.total is not None:
            self.bar.update(step.done, step.total, step.description)


#: a job parameter's annotation (without ``| None``) as the type its spelling records: a
#: ``bool`` is named as the flag that turns it on (``overwrite=True``), any other as itself
_SPELLED_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def declare_job_options(func: Callable[..., Any]) -> None:
    """Declare the spelling of each of ``func``'s parameters (its command's flags, by
    their keywords: ``--max-clients`` is ``max_clients``, ``--overwrite`` ``overwrite=True``,
    ``--no-one-run`` ``one_run=False``), so that a message naming one (``{budget_s}``,
    ``{overwrite}``) is written for its reader. A run setting of the same name keeps its
    own declaration."""
    for p in inspect.signature(func).parameters.values():
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        kind = _SPELLED_TYPES.get(str(p.annotation).removesuffix(" | None"), object)
        declare_spelling(p.name, kind, replace=False)


def job(func: Callable[P, R]) -> Callable[P, R]:
    """``func`` as the API's: arguments checked by annotation, and an error's message in
    keywords (``python_surface``): the settings and the job's own options it names are
    written from their declarations (``declare_job_options``)."""
    declare_job_options(func)
    return python_surface(func)


def run_path(run: Run | str | Path) -> Path:
    return Path(run.path) if isinstance(run, Run) else Path(run)


def _runs(value: Any, name: str, optional: bool) -> list[Path] | None:
    """Run folders: one (a ``Run``, str or Path) or an iterable of them."""
    if value is None and optional:
        return None
    if isinstance(value, (Run, str, Path)):
        value = [value]
    if not isinstance(value, Iterable):
        raise UsageError(f"{name} must be run folders (Run, str or Path), got {value!r}")
    out = []
    for i, v in enumerate(value):
        if not isinstance(v, (Run, str, Path)):
            raise UsageError(f"{name}[{i}] must be a run folder (Run, str or Path), got {v!r}")
        out.append(run_path(v))
    return out


def _several(kind: type) -> Callable[[Any, str, bool], Any]:
    """One value of ``kind`` or an iterable of them, as a tuple without repeats."""
    def check(value: Any, name: str, optional: bool) -> tuple[Any, ...] | None:
        if value is None and optional:
            return None
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            value = [value]
        return tuple(dict.fromkeys(coerce(v, kind, f"{name}[{i}]", False)
                                   for i, v in enumerate(value)))
    return check


def _callable(value: Any, name: str, optional: bool) -> Any:
    if (value is None and optional) or callable(value):
        return value
    raise UsageError(f"{name} must be callable, got {value!r}")


def as_tuple(value: Any) -> tuple[Any, ...]:
    """One value or several as a tuple (the checks above already made it one)."""
    return tuple(value) if isinstance(value, Iterable) and not isinstance(value, str) else (value,)


register_check("bool", lambda v, n, o: coerce(v, bool, n, o))
register_check("Iterable[Run | str | Path]", _runs)
register_check("float | Iterable[float]", _several(float))
register_check("bool | Iterable[bool]", _several(bool))
register_check("str | Iterable[str]", _several(str))
register_check("bool | Callable[[JobStep], None]", lambda v, n, o: v if isinstance(v, bool)
               else _callable(v, n, o))
