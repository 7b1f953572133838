"""Messages that name settings through their declaration, written for their reader.

A check that refuses a setting raises ``SettingError("{hide_counts} needs {secagg}")``: the
template's fields are setting names, and the message is written when it is read, in the
words of whoever reads it. ``str(err)`` is the CLI's form (``--hide-counts needs --secagg``);
``err.render("python")`` names keywords (``hide_counts=True needs secagg=True``) and
``err.render("flower")`` the Flower run config's keys (``hide-counts=True needs
secagg=True``, ``method-params.mu``; the plugin passes its own spelling,
``privfedcal.hide-counts``).

Fields of a template:

- ``{dp_eps}``: the setting (``--dp-eps`` / ``dp_eps``; a boolean one as the flag that turns
  it on, which reads ``secagg=True`` in Python);
- ``{rounds=}``: the setting with the value given as the keyword ``rounds=`` (``--rounds 3``
  / ``rounds=3``; ``--method fedavg`` / ``method='fedavg'``; a capitalised placeholder such
  as ``N`` is shown as it is; a conversion and a format spec apply to the value,
  ``{dp_delta=:g}``; ``{hide_counts=}`` with False is ``--show-counts`` /
  ``hide_counts=False``);
- ``{match_steps:name}``: the setting's name alone, as messages list several
  (``match-steps`` / ``match_steps``);
- any other field is plain text given as a keyword (``got {got!r}``; a name not also
  given as ``{name=}``), formatted as ``str.format`` does; a value with a ``render`` method
  (another ``SettingText``) is written for the same reader.

How a setting is spelled (its type, the flag that turns a boolean off, its run-config key)
comes from its declaration, recorded with :func:`declare_spelling`: by ``settings_of`` for
the sections' settings, by the settings catalogue (privfedcal/settings/catalogue.py) for
every setting when it is imported, and by ``api.arguments.flag_keywords`` for the attacks'
options.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from privfedcal.errors import UsageError

READERS = ("cli", "python", "flower")
_FORMATTER = string.Formatter()


@dataclass(frozen=True)
class Spelling:
    """How one setting is written: its name, type, the flags that turn a boolean on and
    off (``--hide-counts`` / ``--show-counts``) and its key in Flower's run config
    (``method-params.mu``)."""

    name: str
    type: type
    on: str
    off: str
    flower: str


#: every declared setting's spelling, by name (:func:`declare_spelling`)
SPELLINGS: dict[str, Spelling] = {}


def declare_spelling(name: str, kind: type, decls: str | None = None,
                     replace: bool = True, flower: str | None = None) -> None:
    """Record how the setting ``name`` is spelled: ``decls`` is its typer declaration
    (``--hide-counts/--show-counts``; None: ``--name``, and ``--no-name`` for a boolean),
    ``flower`` its run-config key (None: the name with hyphens). ``replace`` False keeps an
    earlier declaration (a run setting's spelling wins over an attack option of the same
    name)."""
    if not replace and name in SPELLINGS:
        return
    on, _, off = (decls or "--" + name.replace("_", "-")).partition("/")
    SPELLINGS[name] = Spelling(name, kind, on, off or "--no-" + on[2:],
                               flower or name.replace("_", "-"))


def _spelling(name: str) -> Spelling:
    hyphens = name.replace("_", "-")
    return SPELLINGS.get(name) or Spelling(name, object, "--" + hyphens, "--no-" + hyphens,
                                           hyphens)


def _setting(name: str, spec: str, conversion: str | None, value: Any, has_value: bool,
             reader: str, spell: Callable[[str], str] | None) -> str:
    """One setting of a template, written for ``reader``; a value is shown with the
    field's conversion and format spec (``{dp_delta=:g}``, ``{calibrate=!r}``)."""
    s = _spelling(name)
    boolean = isinstance(value, bool) or (not has_value and s.type is bool)
    shown = ""
    if has_value and not boolean:
        shown = _FORMATTER.format_field(_FORMATTER.convert_field(value, conversion), spec)
    if reader == "cli":
        if spec == "name":
            return s.on[2:]
        if boolean:
            return s.on if value is not False else s.off
        return f"{s.on} {shown}" if has_value else s.on
    word = spell(name) if spell else name if reader == "python" else s.flower
    if spec == "name" or not (has_value or boolean):
        return word
    if boolean:
        return f"{word}={value is not False}"
    if isinstance(value, str) and not value.isupper() and not conversion:
        shown = repr(shown)
    return f"{word}={shown}"


def render(template: str, values: dict[str, Any], reader: str = "cli",
           spell: Callable[[str], str] | None = None) -> str:
    """``template`` with its fields written for ``reader`` (module docstring); ``spell``:
    how a setting's keyword is written (the Flower plugin's ``privfedcal.dp-eps``)."""
    if reader not in READERS:
        raise ValueError(f"reader must be one of {', '.join(READERS)}, got {reader!r}")
    parts = list(_FORMATTER.parse(template))
    #: a name given with its value (``{rounds=}``) is a setting wherever it is named
    valued = {f[:-1] for _, f, _, _ in parts if f and f.endswith("=")}
    out = []
    for literal, field, spec, conversion in parts:
        out.append(literal)
        if field is None:
            continue
        name = field.removesuffix("=")
        if name in valued or name not in values:
            out.append(_setting(name, spec or "", conversion, values.get(name),
                                field.endswith("="), reader, spell))
            continue
        value = values[name]
        if hasattr(value, "render"):
            out.append(value.render(reader, spell))
        else:
            value = _FORMATTER.convert_field(value, conversion)
            out.append(_FORMATTER.format_field(value, spec or ""))
    return "".join(out)


def template_fields(template: str) -> list[tuple[str, bool]]:
    """(name, is a setting) of each field of ``template`` whose value is not a keyword
    of the message: every such field must name a declared setting."""
    out = []
    for _, field, _, _ in _FORMATTER.parse(template):
        if field is not None:
            out.append((field.removesuffix("="), field.endswith("=")))
    return out


class SettingText(str):
    """A message naming settings (module docstring): as a ``str``, the CLI's form, so
    that it prints, joins and is written to files as the CLI's text; ``render(reader)``
    writes it for another reader."""

    template: str
    values: dict[str, Any]

    def __new__(cls, template: str, **values: Any) -> SettingText:
        text = super().__new__(cls, render(template, values))
        text.template, text.values = template, values
        return text

    def render(self, reader: str = "cli", spell: Callable[[str], str] | None = None) -> str:
        return render(self.template, self.values, reader, spell)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.template, self.values))

    @classmethod
    def named(cls, names: Iterable[str], sep: str = ", ", spec: str = "") -> SettingText:
        """The settings ``names``, each as its reader spells it (``spec`` "name": the name
        alone), joined by ``sep``."""
        names = list(names)
        if not all(n.isidentifier() for n in names):
            raise ValueError(f"not setting names: {names}")
        return cls(sep.join("{" + n + (":" + spec if spec else "") + "}" for n in names))


def _rebuild(template: str, values: dict[str, Any]) -> SettingText:
    return SettingText(template, **values)


class SettingError(UsageError):
    """Bad settings, in a message that names them through their declaration
    (``SettingText``): the CLI prints ``str(err)``; the Python API and the Flower plugin
    show ``err.render(...)``."""

    def __init__(self, template: str, **values: Any) -> None:
        text = template if isinstance(template, SettingText) else SettingText(template, **values)
        super().__init__(text)

    def render(self, reader: str = "cli", spell: Callable[[str], str] | None = None) -> str:
        return render_message(self, reader, spell)


def render_message(text: Any, reader: str, spell: Callable[[str], str] | None = None) -> str:
    """An error's message (or a hint, any text) written for ``reader``: a ``SettingText``
    rendered, anything else as it is."""
    if isinstance(text, BaseException):
        if len(text.args) != 1:
            return str(text)
        text = text.args[0]
    return text.render(reader, spell) if isinstance(text, SettingText) else str(text)


def refuse_failed(checks: list[tuple[bool, str]]) -> None:
    """Raise the message of the first check that does not hold as a ``SettingError``: a
    template whose fields name settings, or a ``SettingText`` made with its values."""
    for ok, message in checks:
        if not ok:
            raise SettingError(message)
