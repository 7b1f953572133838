"""An attack's options type describes its flags: the fields' names, types, defaults and help
text are read back as ``privfedcal attack``'s flags and the API's keywords; unknown keywords
and conflicting declarations are refused."""

from __future__ import annotations

import dataclasses

import pytest

from privfedcal.attacks.attack_options import (
    NoOptions,
    attack_option,
    make_options,
    merged_flags,
    option_flags,
    options_from,
)
from privfedcal.attacks.release_attacks import registered
from privfedcal.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Small:
    size: int = attack_option(3, "How many.")
    rate: float | None = attack_option(None, "A rate.", cli=False)
    loud: bool = attack_option(False, "Say it.", flag="--loud/--quiet-please")


@dataclasses.dataclass(frozen=True)
class Other:
    size: int = attack_option(4, "How many, differently.")


def test_fields_read_back_as_flags():
    size, rate, loud = option_flags(Small)
    assert (size.name, size.type, size.optional, size.default, size.help, size.decls) == (
        "size", int, False, 3, "How many.", ("--size",))
    assert (rate.type, rate.optional, rate.cli) == (float, True, False)
    assert loud.type is bool and loud.decls == ("--loud/--quiet-please",)
    assert option_flags(NoOptions) == ()
    # only the CLI's fields, first declaration first
    assert list(merged_flags([Small])) == ["size", "loud"]


def test_a_field_without_a_description_is_an_error_of_the_declaration():
    @dataclasses.dataclass(frozen=True)
    class Bare:
        size: int = 3

    with pytest.raises(TypeError, match="attack_option"):
        option_flags(Bare)


def test_two_types_that_declare_one_option_differently_are_refused():
    with pytest.raises(TypeError, match="'size' is declared twice"):
        merged_flags([Small, Other])


def test_unknown_keywords_are_one_line_usage_errors():
    assert make_options(Small, {"size": 5}, "attack small") == Small(size=5)
    with pytest.raises(UsageError, match="attack small takes no option 'sise'.*size, rate, loud"):
        make_options(Small, {"sise": 5}, "attack small")
    # settings given once for several attacks: each type takes its own
    assert options_from(Small, {"size": 7, "window": 2}) == Small(size=7)


def test_every_registered_attack_describes_its_options():
    for attack in registered():
        flags = option_flags(attack.options)  # raises for an undescribed field
        assert all(f.help for f in flags), attack.name
        assert attack.summary, attack.name
        attack.options()  # the defaults are valid
