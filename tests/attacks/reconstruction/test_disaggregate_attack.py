"""``attack disaggregate`` on tiny real runs (--clients 4 --participation 0.5).

A plain run's transcript, rewritten into what secure aggregation would have shown (per round,
ciphertext entries and the sum of the participants' uploads; model updates as the CKKS sum
of ``w_k * state_k`` and ``w_k``), is the case where sums over changing participant sets
difference out: the attack must recover every client's hidden counts and size exactly. A
real ``--secagg --secagg-updates --hide-counts`` run selects whole cohorts of at least
``--secagg-min-clients``: the attack must then report nothing finer than a cohort, and
exactness wherever it claims a client determined."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from scipy.linalg import null_space

from privfedcal.attacks.reconstruction.disaggregate_attack import (
    DisaggregateOptions,
    disaggregate_run,
    secure_series,
    secure_sizes,
    summarise,
)
from privfedcal.attacks.reconstruction.runner import load_run
from privfedcal.attacks.release_attacks import release_attack, run_attacks, target_order
from privfedcal.cli.main import main

FAST = ["--method", "creff", "--creff-weighting", "sample", "--clients", "4",
        "--participation", "0.5", "--rounds", "6", "--local-epochs", "1", "--match-steps", "5",
        "--retrain-steps", "5", "--dataset", "digits", "--device", "cpu", "--threads", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("disaggregate")
    main(["train", *FAST, "--out", str(root / "plain")])
    main(["train", *FAST, "--secagg", "--secagg-updates", "--hide-counts",
          "--out", str(root / "secure")])
    return root


def as_secure(entries: list[dict]) -> list[dict]:
    """The transcript secure aggregation would have written: each round's plain uploads of
    a label become ciphertext entries plus one aggregate (their sum)."""
    out, groups = [], {}
    for e in entries:
        if e["view"] == "plain-upload":
            groups.setdefault((e["round"], e["label"]), []).append(e)
            out.append({k: v for k, v in e.items() if k not in ("tensors", "weight", "file")}
                       | {"view": "ciphertext", "bytes": 1})
            last = [x for x in entries if x["view"] == "plain-upload"
                    and (x["round"], x["label"]) == (e["round"], e["label"])][-1]
            if e is last:
                ups = groups[(e["round"], e["label"])]
                if e["label"] == "model-update":  # uplink.average_updates' upload
                    ts = [{"__weight": torch.tensor([u["weight"]], dtype=torch.float64),
                           **{k: v.double() * u["weight"] for k, v in u["tensors"].items()
                              if v.is_floating_point()}} for u in ups]
                else:
                    ts = [u["tensors"] for u in ups]
                out.append({"round": e["round"], "label": e["label"], "view": "aggregate",
                            "client": None, "clients": len(ups),
                            "tensors": {k: sum(t[k].double() for t in ts) for k in ts[0]}})
        else:
            out.append(e)
    return out


def rows_by_key(records: list[dict]) -> dict[str, dict]:
    return {r["key"]: r for r in summarise(records)}


def test_sums_over_changing_participants_give_every_count_and_size_exactly(runs):
    view = load_run(runs / "plain")
    part = json.loads((runs / "plain" / "private" / "partition.json").read_text())
    view.entries = as_secure(view.entries)
    records, notes = disaggregate_run(view)
    rows = rows_by_key(records)
    for key, truth in (("count", part["counts"]), ("__weight", part["sizes"])):
        assert rows[key]["determined"] == rows[key]["exact"] == 4, rows[key]
        assert rows[key]["finest_group"] == 1 and rows[key]["worst_rel_error"] < 1e-9
        mine = sorted((r for r in records if r["key"] == key), key=lambda r: r["client"])
        got = np.array([r["value"] for r in mine])
        np.testing.assert_allclose(got, np.asarray(truth, float).reshape(got.shape), atol=1e-6)
    assert rows["__weight"]["public_total"] == f"N={sum(part['sizes'])}"
    assert rows["count"]["public_total"] == "class totals"
    assert rows["grad"]["kind"] == "time-varying" and rows["grad"]["exact"] is None
    assert any("public total of 'count'" in n for n in notes)
    # without the public totals: exactly the clients whose e_i is in the row space of the
    # rounds' participant sets (scipy's null space, from the round records)
    bare, _ = disaggregate_run(view, DisaggregateOptions(public_totals=False))
    sets = [e["participants"] for e in view.entries if e["label"] == "round"]
    a = np.zeros((len(sets), 4))
    for i, s in enumerate(sets):
        a[i, s] = 1
    fixed = ~(np.abs(null_space(a)) > 1e-9).any(axis=1)
    for r in bare:
        if r["key"] in ("count", "__weight"):
            assert r["determined"] == bool(fixed[r["client"]])
            assert not r["determined"] or r["exact"]


def test_sizes_the_weights_secure_sums_determine_are_sizes(runs):
    """The plain run's updates summed as --secagg-updates would: the weights' sums over
    changing participant sets, with N, determine every client's size."""
    view = load_run(runs / "plain")
    part = json.loads((runs / "plain" / "private" / "partition.json").read_text())
    view.entries = as_secure(view.entries)
    series, _ = secure_series(view)
    got = secure_sizes(view, series, DisaggregateOptions())
    assert got == {k: float(n) for k, n in enumerate(part["sizes"])}


def test_a_sum_with_a_missing_ciphertext_is_left_out(runs):
    view = load_run(runs / "plain")
    entries = as_secure(view.entries)
    drop = next(i for i, e in enumerate(entries) if e["view"] == "ciphertext")
    view.entries = entries[:drop] + entries[drop + 1:]
    records, notes = disaggregate_run(view)
    assert any("ciphertexts recorded; release left out" in n for n in notes)
    label = entries[drop]["label"]
    assert {r["releases"] for r in records if r["label"] == label} == {5}
    assert {r["releases"] for r in records if r["label"] != label} == {6}


def test_cohorts_leave_nothing_finer_than_a_cohort(runs, tmp_path):
    cfg = json.loads((runs / "secure" / "server" / "config.json").read_text())
    m = cfg["secagg_min_clients"]
    main(["attack", "disaggregate", str(runs / "secure"), "--threads", "1"])
    out = runs / "secure" / "attack-disaggregate"
    assert (out / "disaggregation.png").stat().st_size > 0
    records = json.loads((out / "attack.json").read_text())
    rows = rows_by_key(records)
    assert {"count", "grad", "__weight"} <= set(rows)
    for row in rows.values():
        assert row["finest_group"] is None or row["finest_group"] >= m, row
    for r in records:  # whatever it claims determined, it recovers (here: nothing)
        assert r["group"] is None or len(r["group"]) >= m
        assert not r["determined"] or r["exact"] in (True, None)
    # the server's view alone: the same determinations, unscored
    view = shutil.copytree(runs / "secure" / "server", tmp_path / "server")
    alone, notes = release_attack("disaggregate").run(load_run(view), DisaggregateOptions())
    assert all(r["scored"] is False for r in alone) and any("unscored" in n for n in notes)
    assert [(r["key"], r["client"], r["determined"], r["group"]) for r in alone] == [
        (r["key"], r["client"], r["determined"], r["group"]) for r in records]


def assert_usage_error(args, capsys, needle):
    """Exit 2 with one line on stderr naming the problem (as tests/cli/cli_helpers.py)."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert exc.value.code == 2 and len(err) == 1 and needle in err[0], err


def test_bad_input_is_one_line(runs, capsys):
    assert_usage_error(["attack", "disaggregate", str(runs / "secure"), "--window", "-1"],
                       capsys, "--window must be >= 0")
    assert_usage_error(["attack", "disaggregate"], capsys, "needs a run folder")
    # a run without secure aggregation: every upload was in the clear
    assert_usage_error(["attack", "disaggregate", str(runs / "plain"), "--out",
                        str(runs / "plain-out")], capsys, "nothing to disaggregate")


def test_registered_as_a_whole_run_attack():
    attack = release_attack("disaggregate")
    assert attack.run is disaggregate_run and attack.plan is None
    assert run_attacks() == [attack]
    assert target_order()[-1] == "disaggregate"
    assert attack.audit_columns([]) == {"disaggregated": None, "finest_group": None}
