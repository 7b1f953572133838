"""A row of `privfedcal audit dp`: one channel's empirical lower bound on epsilon beside the
epsilon the run claims (``attacks/distinguishing/games.py`` ``play``, and the one-run audits
``one_run.one_run`` and ``one_run_training.one_run_training``; docs/privacy/auditing.md).

`dp_audit.csv` keeps the columns ``attacks/distinguishing/games.py`` ``COLUMNS`` of these rows."""

from typing import Annotated, Literal, TypedDict


class DPAuditRow(TypedDict):
    """One audited channel: the distinguishing game's result and what it rests on."""

    channel: Annotated[str, "the channel (`ccvr-stats`, `creff-grad`, `dp-sgd`; "
                            "`... (one run)` for the one-run audits)"]
    claimed_eps: Annotated[float, "the epsilon the run claims for it (inf: no DP; NaN where "
                                  "the run did not say)"]
    delta: Annotated[float, "its delta"]
    eps_lower: Annotated[float, "the empirical lower bound on epsilon at `confidence` (above "
                                "`claimed_eps`: the claim is refuted)"]
    confidence: Annotated[float, "confidence of the lower bound"]
    trials: Annotated[int, "releases played, both neighbours together (1: a one-run audit)"]
    canary: Annotated[str, "the canary that tells the neighbours apart"]
    stopped: Annotated[Literal["", "budget"], "`budget` where the time budget cut the game "
                                              "short (the bound then rests on fewer trials)"]
    score: Annotated[str, "the distinguisher's statistic (`projection`, `loss drop`, ...)"]
    false_pos: Annotated[int, "false positives on the test half (one run: wrong guesses)"]
    false_neg: Annotated[int, "false negatives on the test half"]
    test_trials: Annotated[int, "trials (one run: guesses) the bound counts"]
    seconds: Annotated[float, "wall time of the channel's audit"]


__all__ = ["DPAuditRow"]
