"""Typed results: what a run, an attack and a DP audit write, as ``TypedDict``s.

A ``TypedDict`` is a dict at run time, so a record reads as before (``summary["accuracy"]``)
while mypy and editors know its keys and their types. Every key is annotated
``Annotated[T, "what it holds"]``: ``field_docs(Summary)`` reads those strings, and the
section "Result types" of ``docs/api.md`` is generated from them
(``python -m privfedcal.results --write``).

Each ``*_from_dict(data)`` checks a record against its type and returns it typed (the same
dict): a missing required key or a value of another type is a ``UsageError`` naming the
path to it; ``strict`` (the default) refuses keys the type does not know, so that a writer
adding a key without typing it here fails the tests (``tests/package/test_results.py`` runs
the writers). Readers of files written by another version pass ``strict=False``: unknown
keys then stay in the dict, untyped.
"""

from typing import Any, cast

from privfedcal.results.attack_records import (
    AttackRecord,
    ClassSetRecord,
    DisaggregationRecord,
    InversionRecord,
    PartialAttack,
    View,
)
from privfedcal.results.audit_records import DPAuditRow
from privfedcal.results.check import docs_of, validate
from privfedcal.results.run_records import (
    AccountedRelease,
    AdaptiveClip,
    Calibration,
    CKKSParams,
    Diverged,
    Evaluation,
    FlowerHolds,
    FromTranscript,
    MetricsRow,
    Privacy,
    Rejected,
    RoundCalibration,
    SecAgg,
    SecAggUpdates,
    Skipped,
    Summary,
    UserDP,
    WholeRun,
)


def summary_from_dict(data: Any, *, strict: bool = True,
                      where: str = "summary.json") -> Summary:
    """``data`` (a parsed ``summary.json``) as a ``Summary``, checked."""
    validate(Summary, data, strict=strict, where=where)
    return cast(Summary, data)


def metrics_row_from_dict(data: Any, *, strict: bool = True,
                          where: str = "metrics.jsonl") -> MetricsRow:
    """``data`` (a line of ``metrics.jsonl``, parsed) as a ``MetricsRow``, checked."""
    validate(MetricsRow, data, strict=strict, where=where)
    return cast(MetricsRow, data)


def attack_record_from_dict(data: Any, *, strict: bool = True,
                            where: str = "attack record") -> AttackRecord:
    """``data`` (a record of ``privfedcal.attack`` or ``attack.json``) as the
    ``AttackRecord`` its ``target`` names, checked."""
    validate(AttackRecord, data, strict=strict, where=where)
    return cast(AttackRecord, data)


def partial_attack_from_dict(data: Any, *, strict: bool = True,
                             where: str = "attack.json") -> PartialAttack:
    """``data`` (the ``attack.json`` object of an interrupted attack) as a
    ``PartialAttack``, checked."""
    validate(PartialAttack, data, strict=strict, where=where)
    return cast(PartialAttack, data)


def dp_audit_row_from_dict(data: Any, *, strict: bool = True,
                           where: str = "audit dp row") -> DPAuditRow:
    """``data`` (a row of ``privfedcal audit dp``) as a ``DPAuditRow``, checked."""
    validate(DPAuditRow, data, strict=strict, where=where)
    return cast(DPAuditRow, data)


def field_docs(kind: Any) -> dict[str, str]:
    """Key -> what it holds, for every key of the result type ``kind`` (``Summary``)."""
    return docs_of(kind)


__all__ = [
    "AccountedRelease", "AdaptiveClip", "AttackRecord", "CKKSParams", "Calibration", "ClassSetRecord",
    "DPAuditRow", "DisaggregationRecord", "Diverged", "Evaluation", "FlowerHolds",
    "FromTranscript",
    "InversionRecord", "MetricsRow", "PartialAttack", "Privacy", "Rejected",
    "RoundCalibration", "SecAgg", "SecAggUpdates", "Skipped", "Summary", "UserDP", "View", "WholeRun",
    "attack_record_from_dict", "dp_audit_row_from_dict", "field_docs",
    "metrics_row_from_dict", "partial_attack_from_dict", "summary_from_dict",
]
