"""The check behind every ``*_from_dict``: a JSON-like value against a result type.

A result type is a ``TypedDict`` whose every key is annotated ``Annotated[T, "what it
holds"]`` (wrapped in ``NotRequired`` where the writer leaves the key out). The check walks
the annotation: a nested ``TypedDict`` is checked key by key (missing required keys, and in
strict mode unknown keys, are errors), a union of ``TypedDict``s is told apart by its
``Literal`` keys (an attack record's ``target``), ``list``/``dict`` element by element,
``int`` refuses a bool and a fraction, ``float`` takes an int (JSON writes ``8.0`` and
``8`` alike). A mismatch is a ``UsageError`` naming the path to the value
(``summary.json: privacy.secagg.min_clients: expected int, got 'two'``).

The types are docs too: ``docs_of`` reads the strings of ``Annotated`` (``markdown.py``
renders them into ``docs/api.md``).
"""

import functools
import types
from typing import (
    Annotated,
    Any,
    Literal,
    NotRequired,
    Required,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    is_typeddict,
)

from privfedcal.errors import PrivfedcalError, UsageError

#: where a writer's new key must be typed (the message of an unknown key in strict mode)
HOME = "privfedcal/results"


class Mismatch(PrivfedcalError):
    """A value unlike its type: the path inside the checked value, and what is wrong."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}" if path else problem)
        self.path, self.problem = path, problem


def strip(annotation: Any) -> tuple[Any, str]:
    """The type under ``NotRequired``/``Required``/``Annotated``, and its doc string ('' where
    none)."""
    doc = ""
    while True:
        origin = get_origin(annotation)
        if origin in (NotRequired, Required):
            annotation = get_args(annotation)[0]
        elif origin is Annotated:
            doc = doc or next((m for m in annotation.__metadata__ if isinstance(m, str)), "")
            annotation = get_args(annotation)[0]
        else:
            return annotation, doc


@functools.cache
def keys_of(kind: Any) -> dict[str, Any]:
    """Key -> annotation (``Annotated`` and ``NotRequired`` kept) of a ``TypedDict``."""
    return get_type_hints(kind, include_extras=True)


def docs_of(kind: Any) -> dict[str, str]:
    """Key -> what it holds, for every key of the ``TypedDict`` ``kind``."""
    return {key: strip(ann)[1] for key, ann in keys_of(kind).items()}


def required(kind: Any) -> frozenset[str]:
    return frozenset(kind.__required_keys__)


def _where(path: str, key: object) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    name = str(key)
    simple = name.isidentifier()
    return (f"{path}.{name}" if path else name) if simple else f"{path}[{name!r}]"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _literals(kind: Any) -> dict[str, tuple[Any, ...]]:
    """The keys of ``kind`` whose type is a ``Literal``, with their values."""
    out = {}
    for key, ann in keys_of(kind).items():
        tp = strip(ann)[0]
        if get_origin(tp) is Literal:
            out[key] = get_args(tp)
    return out


def _tags(members: tuple[Any, ...]) -> list[str]:
    """The keys that tell the ``TypedDict`` members of a union apart: ``Literal`` in every
    one of them, with no value shared (an attack record's ``target``)."""
    typed = [strip(m)[0] for m in members if is_typeddict(strip(m)[0])]
    if not typed:
        return []
    tags = []
    for key in sorted(set.intersection(*(set(_literals(m)) for m in typed))):
        values = [v for m in typed for v in _literals(m)[key]]
        if len(values) == len(set(values)):
            tags.append(key)
    return tags


def _could_be(kind: Any, value: Any, tags: list[str]) -> bool:
    """Whether ``value`` carries the tag values of the ``TypedDict`` ``kind``."""
    if not isinstance(value, dict):
        return False
    literals = _literals(kind)
    return all(key in value and any(_same(value[key], a) for a in literals[key])
               for key in tags)


def _shape_fits(tp: Any, value: Any, tags: list[str]) -> bool:
    """Whether ``value`` has the shape of the union member ``tp`` (an object carrying its
    ``Literal`` keys, a list, an object), so that only that member's message is shown."""
    tp, _ = strip(tp)
    if is_typeddict(tp):
        return _could_be(tp, value, tags)
    origin = get_origin(tp)
    if origin is list:
        return isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict)
    if tp is type(None) or tp is None:
        return value is None
    return not isinstance(value, list | dict)


def _same(value: Any, literal: Any) -> bool:
    return type(value) is type(literal) and value == literal


def check_value(tp: Any, value: Any, path: str, strict: bool) -> None:
    """Raise ``Mismatch`` where ``value`` is not of type ``tp``."""
    tp, _ = strip(tp)
    origin = get_origin(tp)
    if tp is Any:
        return
    if is_typeddict(tp):
        check_object(tp, value, path, strict)
    elif origin in (Union, types.UnionType):
        members = get_args(tp)
        if value is None and type(None) in members:
            return
        tags = _tags(members)
        tried = [m for m in members if _shape_fits(m, value, tags)]
        for member in tried:
            try:
                check_value(member, value, path, strict)
                return
            except Mismatch as exc:
                if len(tried) == 1:  # the one member of that shape: its own message
                    raise exc from None
        if tags and isinstance(value, dict):
            shown = ", ".join(f"{k}={value.get(k)!r}" for k in tags)
            raise Mismatch(path, f"{shown} is none of {render(tp)}'s")
        raise Mismatch(path, f"expected {render(tp)}, got {_show(value)}")
    elif origin is Literal:
        if not any(_same(value, a) for a in get_args(tp)):
            raise Mismatch(path, f"expected {render(tp)}, got {_show(value)}")
    elif origin is list:
        if not isinstance(value, list):
            raise Mismatch(path, f"expected a list, got {_show(value)}")
        (item,) = get_args(tp)
        for i, v in enumerate(value):
            check_value(item, v, _where(path, i), strict)
    elif origin is dict:
        if not isinstance(value, dict):
            raise Mismatch(path, f"expected an object, got {_show(value)}")
        key_type, item = get_args(tp)
        for k, v in value.items():
            check_value(key_type, k, f"{path} (key {k!r})", strict)
            check_value(item, v, _where(path, k), strict)
    elif tp is type(None) or tp is None:
        if value is not None:
            raise Mismatch(path, f"expected None, got {_show(value)}")
    elif tp in (bool, str):
        if not isinstance(value, tp):
            raise Mismatch(path, f"expected {tp.__name__}, got {_show(value)}")
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Mismatch(path, f"expected int, got {_show(value)}")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Mismatch(path, f"expected float, got {_show(value)}")
    else:  # a result type annotated with something this check does not know
        raise TypeError(f"{HOME}: no check for the annotation {tp!r}")


def check_object(kind: Any, value: Any, path: str, strict: bool) -> None:
    """``value`` as the ``TypedDict`` ``kind``: required keys there, each known key's value
    of its type, and (``strict``) no key the type lacks."""
    if not isinstance(value, dict):
        raise Mismatch(path, f"expected an object ({kind.__name__}), got {_show(value)}")
    hints = keys_of(kind)
    missing = sorted(required(kind) - value.keys())
    if missing:
        raise Mismatch(path, f"{kind.__name__} misses key(s) {', '.join(missing)}")
    unknown = [k for k in value if k not in hints]
    if strict and unknown:
        raise Mismatch(path, f"unknown key(s) {', '.join(map(str, unknown))} of "
                             f"{kind.__name__}: a writer added a key without its type "
                             f"and doc in {HOME}")
    for key, v in value.items():
        if key in hints:
            check_value(hints[key], v, _where(path, key), strict)


def validate(tp: Any, value: Any, *, strict: bool, where: str) -> None:
    """``check_value`` with a ``UsageError`` of one line: ``where`` (a file, a type) first."""
    try:
        check_value(tp, value, "", strict)
    except Mismatch as exc:
        raise UsageError(f"{where}: {exc}") from None


def render(tp: Any, link: bool = False) -> str:
    """A type as the docs write it: ``float | None``, ``list[int]``, ``Privacy``;
    ``link`` makes a ``TypedDict``'s name a markdown link to its section."""
    tp, _ = strip(tp)
    origin = get_origin(tp)
    if tp is Any:
        return "Any"
    if tp is type(None) or tp is None:
        return "None"
    if is_typeddict(tp):
        return f"[{tp.__name__}](#{tp.__name__.lower()})" if link else tp.__name__
    if origin in (Union, types.UnionType):
        return " | ".join(render(m, link) for m in get_args(tp))
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(render(a, link) for a in get_args(tp))}]"
    return str(getattr(tp, "__name__", tp))


def nested(tp: Any) -> list[Any]:
    """The ``TypedDict``s inside ``tp``, in order of first appearance, ``tp`` first."""
    found: list[Any] = []

    def walk(t: Any) -> None:
        t, _ = strip(t)
        if is_typeddict(t):
            if t in found:
                return
            found.append(t)
            for ann in keys_of(t).values():
                walk(ann)
        else:
            for arg in get_args(t):
                walk(arg)

    walk(tp)
    return found
