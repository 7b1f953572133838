"""The options every inversion attack shares, and the audit's view of them.

Kept apart from the attack runner, which imports the scoring metrics (torchmetrics, and
through it matplotlib and torchvision): building the CLI's ``attack`` and ``audit`` flags
reads these declarations only, so a ``privfedcal train`` loads none of the attack code's
libraries (``tests/package/test_lazy_imports.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from privfedcal.attacks.attack_options import (
    OptionFlag,
    attack_option,
    option_flags,
    with_defaults,
)
from privfedcal.attacks.reconstruction.engine import (
    DEFAULT_ATTACK_BATCH,
    DEFAULT_MAX_STEPS,
    InversionConfig,
)
from privfedcal.errors import UsageError
from privfedcal.settings.messages import SettingError


@dataclass(frozen=True)
class InversionOptions:
    """How hard an inversion attack works and on what: the options every attack that
    inverts (``stats``, ``gradients``, ``updates``) shares; each extends it with its own."""

    steps: int = attack_option(DEFAULT_MAX_STEPS, "Step cap per inversion (each stops "
                               "earlier once converged); lower it for a quick look.")
    restarts: int = attack_option(4, "Random restarts per inversion (best kept).")
    attack_batch: int = attack_option(DEFAULT_ATTACK_BATCH, "Targets optimised together per "
                                      "batch (1: one at a time; same results, more memory).")
    round: int | None = attack_option(None, "Release round (default: the last).")
    max_n: int = attack_option(256, "Largest batch of a client's class to invert (larger "
                               "ones are skipped, noted).")
    known_classes: bool = attack_option(False, "Also attack held classes that noise hides "
                                        "(attacker knows the label set).")
    seed: int = attack_option(0, "Seed of the attacks (and of the quick run).")
    #: clients attacked when none are named (the first uploaders); the sweep sets it
    default_clients: int = attack_option(2, "Clients attacked when none are named.", cli=False)
    false_positive_rate: float = attack_option(1e-3, "Per-class false-positive rate of the "
                                               "class inference under DP noise.", cli=False)

    def __post_init__(self) -> None:
        # 0 steps would score the random start as the attack's result ("nothing leaked")
        if self.steps < 1 or self.restarts < 1:
            raise SettingError("attacks need {steps} >= 1 and {restarts} >= 1 (got {steps=}, "
                               "{restarts=}): with none the random start would be reported as "
                               "the attack's result", steps=self.steps, restarts=self.restarts)
        if self.max_n < 1:
            raise SettingError(f"{{max_n}} must be >= 1, got {self.max_n}")
        if self.default_clients < 1:
            raise UsageError("at least one client must be attacked")
        if self.attack_batch < 1:
            raise SettingError(f"{{attack_batch}} must be >= 1 (1: one target at a time), got "
                             f"{self.attack_batch}")
        if not 0 < self.false_positive_rate < 1:
            raise UsageError("the false-positive rate must be in (0, 1)")

    @property
    def inversion(self) -> InversionConfig:
        return InversionConfig(steps=self.steps, restarts=self.restarts)


#: The inversion options the audit takes: fields of ``InversionOptions`` (their help,
#: defaults and checks), so ``privfedcal audit``'s flags and ``privfedcal.audit``'s keywords
#: are the attacks' own.
AUDIT_INVERSION_OPTIONS = ("steps", "restarts", "attack_batch")
#: Where the audit's defaults differ from an attack's: 2 restarts, not 4, since the audit
#: attacks every setting of its grid (20 by default) and is meant to take seconds per setting.
AUDIT_DEFAULTS = {"restarts": 2}


def audit_flags() -> tuple[OptionFlag, ...]:
    """The audit's inversion options as described fields, with the audit's defaults."""
    return with_defaults(option_flags(InversionOptions), AUDIT_INVERSION_OPTIONS,
                         AUDIT_DEFAULTS)
