"""What the server's folder records about failures and time: declared codes with public
numbers only (privacy/reasons.py), every uplink's rejections listed, no client named for a
divergence under secure aggregation of the updates, and one file time for the whole view."""

from __future__ import annotations

import json
import re

import pytest
import torch

from privfedcal.errors import Diverged, ReleaseSkipped
from privfedcal.experiment import build_simulator
from privfedcal.federation import divergence
from privfedcal.federation.local import LocalResult
from privfedcal.privacy.reasons import (
    CODES,
    MEANING,
    PUBLIC_NUMBERS,
    Reason,
    from_node_code,
    reason_of,
)
from privfedcal.privacy.releases import UPDATE_RELEASE
from privfedcal.privacy.secagg_stage import EncryptStage
from privfedcal.privacy.transcript import Transcript
from privfedcal.privacy.uplink import Uplink
from tests.privacy.test_uplink import ckks_settings, stats_payload

#: a number written in a record's text: a value of the data would look like one
NUMBER = re.compile(r"\d")


def only_codes(records: list[dict]) -> None:
    """Every record holds a declared code and, beside round, label and client, declared
    public numbers only."""
    for r in records:
        assert r["reason"] in CODES, r
        assert set(r) <= {"round", "label", "client", "reason", *PUBLIC_NUMBERS}, r


def test_every_code_has_a_meaning_and_free_text_is_never_a_code():
    assert set(MEANING) == set(Reason)
    assert reason_of("aggregate entry 5.1e+07 exceeds the declared bound 135946") \
        == Reason.UNNAMED
    assert reason_of(Reason.WITHHELD_ISOLATING.value) == Reason.WITHHELD_ISOLATING
    # a Flower key holder sends only its error code: the release's reason is declared
    assert from_node_code("upload-rejected-locally") == Reason.KEY_HOLDER_REFUSED
    assert from_node_code("anything else") == Reason.KEY_HOLDER_REFUSED


def test_a_sum_past_its_bound_is_recorded_by_its_code_without_its_value():
    """Counts of 2e4 per client against a declared bound of 100 examples: the key holder's
    magnitude check refuses the sum; the record and the run's note say which check, not
    the sum's entry."""
    up = Uplink([EncryptStage(ckks_settings(n=100))])
    uploads = [(k, stats_payload([2, 2], seed=k)) for k in range(3)]
    for _, p in uploads:
        p["count"] = torch.tensor([2e4, 2e4], dtype=torch.float64)
    with pytest.raises(ReleaseSkipped) as err:
        up.aggregate(uploads, round_=1, label="ccvr-stats", transcript=Transcript(None))
    (skipped,) = up.skipped
    assert skipped["reason"] == Reason.BOUND_EXCEEDED.value
    only_codes(up.skipped)
    assert not NUMBER.search(str(err.value).split(":", 1)[1].replace("ccvr-stats", ""))


def test_too_few_uploads_carry_public_numbers_only():
    up = Uplink([EncryptStage(ckks_settings())])
    uploads = [(0, stats_payload([2, 2])), (1, stats_payload([2, 2, 2]))]
    with pytest.raises(ReleaseSkipped):
        up.aggregate(uploads, round_=1, label="ccvr-stats", transcript=Transcript(None))
    only_codes(up.skipped + up.rejected)
    assert up.rejected[0]["reason"] == Reason.MALFORMED.value
    assert up.skipped[0] | {} == {"round": 1, "label": "ccvr-stats",
                                  "reason": Reason.TOO_FEW_UPLOADS.value, "uploads": 1,
                                  "min_clients": 2}


def test_a_model_update_that_does_not_fit_ckks_is_listed_with_the_rejections(tmp_path,
                                                                              tiny_cfg):
    """--secagg-updates: client 1's update holds 1e30 (its encryption overflows); it is
    dropped from the sum like a calibration upload, and listed in the run's
    ``rejected_uploads`` (the uplink's own list), not only in the log. With cohorts of two,
    what is left of the round may be too few for a sum: skipped, by its code."""
    sim = build_simulator(tiny_cfg(rounds=1, secagg_updates=True, data_seed=0),
                          tmp_path / "run")
    up = sim.uplink
    sent = {k: v.clone() for k, v in sim.global_state.items()}
    moved = [{k: (v + 0.01 * i if v.is_floating_point() else v) for k, v in sent.items()}
             for i in range(3)]
    key = next(k for k, v in sent.items() if v.is_floating_point())
    moved[1][key] = torch.full_like(sent[key], 1e30)
    up.average_updates(sent, moved, [1.0, 1.0, 1.0], [0, 1, 2], round_=1,
                       transcript=Transcript(None))
    got = [(r["client"], r["label"], r["reason"]) for r in up.rejected]
    assert got[0] == (1, UPDATE_RELEASE, Reason.CKKS_OVERFLOW.value)
    # the rest of client 1's cohort goes with it (privfedcal/privacy/cohorts.py)
    assert all(reason == Reason.COHORT_INCOMPLETE.value for _, _, reason in got[1:])
    only_codes(up.rejected + up.skipped)
    assert up.update_wire.uplink.rejected == []  # moved, not copied: listed once


def _results(bad: int) -> list[LocalResult]:
    return [LocalResult({"w": torch.tensor([float("nan") if k == bad else 1.0])}, None, 0.1)
            for k in range(3)]


def test_a_divergence_under_secure_updates_names_no_client():
    with pytest.raises(Diverged) as err:
        divergence.check_local(_results(1), [4, 5, 6], None, 2, 0.1, secure=True)
    assert err.value.record()["client"] is None and "client" not in str(err.value)
    assert err.value.client == 5  # kept for the experimenter's log
    with pytest.raises(Diverged) as err:
        divergence.check_local(_results(1), [4, 5, 6], None, 2, 0.1)
    assert err.value.record()["client"] == 5 and "client 5" in str(err.value)


def _client_timing(obj, path="") -> list[str]:
    """Paths of per-client entries that carry a time."""
    found = []
    if isinstance(obj, dict):
        if "client" in obj and any(re.search("second|time", k) for k in obj):
            found.append(path)
        for k, v in obj.items():
            found += _client_timing(v, f"{path}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += _client_timing(v, f"{path}[{i}]")
    return found


def test_every_file_of_the_server_view_carries_one_time(tmp_path, tiny_cfg):
    """A run of 3 rounds with its transcript: every file and folder under server/ has the
    same modification time (that of server/config.json), and no JSON there times a client."""
    build_simulator(tiny_cfg(rounds=3, transcript=True, participation=0.5),
                    tmp_path / "run").run()
    view = tmp_path / "run" / "server"
    paths = [view, *view.rglob("*")]
    assert len([p for p in paths if p.suffix == ".safetensors"]) >= 3  # a file per round
    assert {p.stat().st_mtime_ns for p in paths} == {(view / "config.json").stat().st_mtime_ns}
    for p in view.rglob("*.json"):
        assert _client_timing(json.loads(p.read_text())) == [], p


def test_a_diverged_runs_summary_lists_the_rejections_too(tmp_path, tiny_cfg):
    sim = build_simulator(tiny_cfg(rounds=1, secagg_updates=True, data_seed=0),
                          tmp_path / "run")
    sim.uplink.rejected.append({"round": 1, "label": UPDATE_RELEASE, "client": 2,
                                "reason": Reason.CKKS_OVERFLOW.value})
    sim.write_diverged(Diverged(1, "the local training loss is not finite", client=2,
                                client_public=False))
    summary = json.loads((tmp_path / "run" / "server" / "summary.json").read_text())
    assert summary["diverged"]["client"] is None
    assert summary["rejected_uploads"] == sim.uplink.rejected
    assert summary["skipped_releases"] == []
    assert "client" not in " ".join(summary["notes"])


def _text_reasons(tree) -> list[int]:
    """Lines of calls ``.reject(round, label, client, <text>)`` or
    ``.raise_skipped(round, label, <text>)`` whose reason is a string literal or f-string."""
    import ast

    at = {"reject": 3, "raise_skipped": 2}
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in at and len(node.args) > at[node.func.attr]):
            arg = node.args[at[node.func.attr]]
            if isinstance(arg, ast.JoinedStr | ast.Constant):
                lines.append(node.lineno)
    return lines


def test_every_recorded_reason_is_passed_as_a_code():
    """No call in the package hands a release record its reason as text (a code or an
    exception carrying one; the text goes in ``detail``, to the log)."""
    import ast
    from pathlib import Path

    import privfedcal

    root = Path(privfedcal.__file__).parent
    found = {str(p.relative_to(root)): _text_reasons(ast.parse(p.read_text()))
             for p in root.rglob("*.py")}
    assert {p: lines for p, lines in found.items() if lines} == {}
    planted = ast.parse('log.raise_skipped(1, "x", f"sum {s} too large")\n'
                        'log.reject(1, "x", 2, Reason.MALFORMED, "text")')
    assert _text_reasons(planted) == [1]
