"""Every field a client may send, with the calibrators' releases filled in: the table of
``docs/threat-model.md``.

``privacy/client_fields.py`` declares the fields every run may send and derives a
calibration payload's fields from the releases it is given; it sits below the calibrators,
so this module hands it every declared release (``release_attacks.declared_releases``).
The payload rows name the attacks that read each key: ``attack classes`` (every key
``class_inference.KEYS`` knows; a test checks that is every declared key) and the attacks
that name the release's label (``release_attacks.attack_names``). ``python -m privfedcal.attacks.fields_table`` prints the table.
"""

from __future__ import annotations

from privfedcal.attacks.release_attacks import attack_names, declared_releases
from privfedcal.privacy import client_fields as fields


def client_fields() -> tuple[fields.ClientField, ...]:
    """Every field a client of any registered calibrator may send."""
    return fields.client_fields(declared_releases(), attack_names())


def declared(message: str, record: str, key: str) -> fields.ClientField | None:
    """The declaration of ``message/record/key`` among every field a client may send."""
    return fields.declared(message, record, key, declared_releases(), attack_names())


def markdown_table() -> str:
    """The table of ``docs/threat-model.md``."""
    return fields.markdown_table(declared_releases(), attack_names())


__all__ = ["client_fields", "declared", "markdown_table"]


if __name__ == "__main__":  # regenerate the table of docs/threat-model.md
    print(markdown_table())
