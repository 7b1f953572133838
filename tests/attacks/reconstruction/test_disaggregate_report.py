"""How ``attack disaggregate`` shows its records (attacks/reconstruction/disaggregate_report.py): one table
row per (label, key) with the worst-off client beside the mean, a verdict per label that
says when nothing finer than a cohort is determined, and the PNG."""

from __future__ import annotations

from privfedcal.attacks.reconstruction.disaggregate_attack import audit_columns, summarise
from privfedcal.attacks.reconstruction.disaggregate_report import COLUMNS, plot, rows, verdicts


def record(label, key, client, *, determined, rel_error, group, finest, total="N=10"):
    scored = rel_error is not None
    return {"target": "disaggregate", "label": label, "key": key, "client": client,
            "kind": "constant", "releases": 3, "rounds": [1, 2, 3],
            "participants": [[0, 1], [1, 2], [0, 2]], "public_total": total,
            "determined": determined, "group": group, "finest_group": finest,
            "fit_residual": 0.0, "scored": scored, "rel_error": rel_error,
            "max_abs_error": None if rel_error is None else 10 * rel_error,
            "exact": None if rel_error is None else rel_error < 0.05}


def test_rows_put_the_worst_off_client_beside_the_mean(tmp_path):
    recs = [record("model-update", "__weight", c, determined=True, rel_error=e, group=[c],
                   finest=1) for c, e in enumerate((0.01, 0.001, 0.1))]
    (row,) = summarise(recs)
    assert row["determined"] == 3 and row["exact"] == 2  # 0.1 is not within rounding
    assert row["worst_client"] == 1 and row["worst_rel_error"] == 0.001
    assert abs(row["mean_rel_error"] - 0.037) < 1e-12
    (cells,) = rows(recs)
    assert len(cells) == len(COLUMNS)
    assert dict(zip(COLUMNS, cells, strict=True))["worst-off"] == "k1"
    assert verdicts(recs) == ["model-update: individual values are determined for 3 of 3 "
                              "clients ('__weight')"]
    assert audit_columns(recs) == {"disaggregated": "3/3", "finest_group": 1}
    assert plot(recs, tmp_path / "d.png").stat().st_size > 0


def test_cohorts_read_as_nothing_finer_than_a_cohort(tmp_path):
    recs = [record("creff-grad", "count", c, determined=False, rel_error=None,
                   group=[0, 1] if c < 2 else [2, 3], finest=2, total=None) for c in range(4)]
    assert verdicts(recs) == ["creff-grad: nothing finer than a group of 2 clients is "
                              "determined (of 4)"]
    assert audit_columns(recs) == {"disaggregated": "0/4", "finest_group": 2}
    none = [dict(r, group=None, finest_group=None) for r in recs]
    assert "no group of clients smaller than the whole federation" in verdicts(none)[0]
    assert plot(recs, tmp_path / "d.png").stat().st_size > 0  # unscored: the matrix alone
