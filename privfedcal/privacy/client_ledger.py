"""A client's own count of the DP releases it has made, and its refusal of one past its plan.

The noise of every release is calibrated to the run's planned schedule (privfedcal/privacy/planner.py
``release_plans``: per client at q = 1, over the most releases any client makes; DP-SGD over
the planned rounds), and the server's accountant (``DPAccounting.check``) guards that plan. A
client does not rely on the server for it (docs/threat-model.md): it counts the releases it
has actually made, per release label (DP-SGD's local training is the label ``dpsgd``), and
refuses (``BudgetRefused``) one that would take it past the count its noise was planned for.
It computes that count from the public run config with its own planner, never from a server
message. While each client keeps its ledger, its epsilon stays within the target whatever
the server selects. The guarantee stops holding if the ledger is lost: a SuperNode whose
``Context.state`` is wiped mid-run, or a simulator resumed from a checkpoint written before
ledgers existed (docs/privacy/dp-uploads.md, "Each client keeps its own ledger").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from privfedcal.errors import BudgetRefused, UsageError
from privfedcal.privacy.accounting import PrivacyAccountant


@dataclass
class ClientLedger:
    """One client's releases: ``made`` per label, at most ``limits`` per label."""

    limits: dict[str, int]  # releases of each label the noise was calibrated to
    made: dict[str, int] = field(default_factory=dict)

    @classmethod
    def planned(cls, dp: Any) -> ClientLedger:
        """The limits of the run's own noise plan (``dp``, its ``DPAccounting``): each planned
        group's steps divided by the steps of one release (1 for an upload; DP-SGD: its
        steps per round)."""
        return cls({p["name"]: int(p["steps"]) // dp.steps.get(p["name"], 1)
                    for p in dp.planned})

    def check(self, label: str) -> None:
        """Refuse (``BudgetRefused``) a release of ``label`` past the planned count."""
        n, limit = self.made.get(label, 0), self.limits.get(label, 0)
        if n >= limit:
            raise BudgetRefused(f"this client has made {n} {label!r} release(s), all its "
                                f"noise was planned for ({limit}): refusing another")

    def record(self, label: str) -> None:
        """Count a release of ``label`` the client makes (refused past the plan)."""
        self.check(label)
        self.made[label] = self.made.get(label, 0) + 1

    def epsilon(self, dp: Any) -> float:
        """Epsilon of the releases made, at the plan's noise (within the target while the
        ledger holds)."""
        acc = PrivacyAccountant(dp.accountant.kind, dp.delta)
        for label, n in sorted(self.made.items()):
            if n:
                acc.record(dp.sigmas[label], dp.rates[label], dp.steps.get(label, 1) * n,
                           label=label)
        return acc.epsilon()

    def state_dict(self) -> dict[str, Any]:
        return {"made": dict(self.made)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        made = {str(k): v for k, v in state.get("made", {}).items()}
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in made.values()):
            raise UsageError(f"a client ledger's counts must be integers >= 0, got {made}")
        self.made = made


__all__ = ["ClientLedger"]
