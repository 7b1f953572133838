"""A run stopped between a release and its checkpoint, then resumed, releases once.

Each test stops a DP run with KeyboardInterrupt (Ctrl-C) at one step of a round by wrapping
a method so that its Nth call raises, resumes it, and checks from the server's folder alone:
every release the server holds is charged (the epsilon recomputed from the transcript,
privacy/transcript_epsilon.py, is at most the reported one, which is at most the target),
and a redone release reached the server with the very value of its first attempt. Before
the release journal a resumed round drew fresh noise: CReFF's command below held releases
worth epsilon 9.50 against the 7.996 reported.
"""

from __future__ import annotations

import json

import pytest
import torch

import privfedcal
import privfedcal.federation.simulator as simulator
from privfedcal.experiment import build_simulator
from privfedcal.federation.runfolder import transcript_dir
from privfedcal.privacy.release_journal import ReleaseJournal
from privfedcal.privacy.transcript import Transcript
from privfedcal.privacy.transcript_files import read_entry
from privfedcal.privacy.uplink import Uplink


def stop_at(m, owner, name, n, *, after=False, when=lambda *a, **kw: True):
    """``owner.name`` raises KeyboardInterrupt at its ``n``-th call that ``when`` accepts,
    before running (or ``after`` it ran)."""
    original = getattr(owner, name)
    calls = [0]

    def wrapped(*args, **kwargs):
        if when(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n and not after:
                raise KeyboardInterrupt
        out = original(*args, **kwargs)
        if when(*args, **kwargs) and calls[0] == n and after:
            raise KeyboardInterrupt
        return out

    m.setattr(owner, name, wrapped)


def at_checkpoint(round_):
    return lambda directory, payload, **_: (directory.name == "checkpoint"
                                       and payload["round"] == round_)


def stopped_and_resumed(cfg, run_dir, monkeypatch, *stop):
    """Run ``cfg`` stopped by ``stop_at(*stop)``, then resume it: the resumed summary."""
    with monkeypatch.context() as m:
        stop_at(m, *stop[:3], **(stop[3] if len(stop) > 3 else {}))
        with pytest.raises(KeyboardInterrupt):
            build_simulator(cfg, run_dir).run()
    return privfedcal.resume_simulator(run_dir).run()


def index(run_dir):
    return json.loads((transcript_dir(run_dir) / "index.json").read_text())


def same_tensors(run_dir, entries):
    """Whether every entry of ``entries`` holds the same tensors as the first."""
    loaded = [read_entry(transcript_dir(run_dir), e) for e in entries]
    return all(set(x) == set(loaded[0]) and all(torch.equal(x[k], loaded[0][k]) for k in x)
               for x in loaded[1:])


def assert_charged(summary, target=8.0):
    privacy = summary["privacy"]
    recomputed = privacy["from_transcript"]
    assert recomputed["epsilon"] <= privacy["epsilon_spent"] + 1e-12 <= target + 1e-12
    assert recomputed["epsilon_claimed"] == privacy["epsilon_spent"]


def creff_cfg(tiny_cfg, rounds=3):
    """The issue's command (``--method creff --dp-eps 8 --secagg --hide-counts --clients 4
    --participation 0.5 --rounds 6``), fewer rounds by default."""
    return tiny_cfg(method="creff", dp_eps=8.0, secagg=True, hide_counts=True,
                    participation=0.5, rounds=rounds, transcript=True)


def check_creff_redo(summary, run, round_):
    """Round ``round_``'s CReFF release held twice (both attempts on record), one value,
    charged once; the journal empty once the run is done."""
    assert_charged(summary)
    sums = [e for e in index(run) if e["view"] == "aggregate" and e["round"] == round_]
    assert [e.get("attempt", 0) for e in sums] == [0, 1]
    assert same_tensors(run, sums)
    assert summary["privacy"]["from_transcript"]["repeated"] == 1
    # the whole-run check sees every sum the server holds, the first attempt's included,
    # and the first attempt's ciphertexts count in the bytes uploaded
    assert summary["privacy"]["whole_run"]["secure_sums"] == summary["rounds"] + 1
    sent = [e for e in index(run) if e["view"] == "ciphertext" and e["round"] == round_]
    assert {e.get("attempt", 0) for e in sent} == {0, 1}
    assert summary["uploaded_bytes"] == sum(e.get("bytes", 0) for e in index(run)
                                            if e["view"] == "ciphertext")
    assert not (run / "journal").exists() or not list((run / "journal").iterdir())


def test_creff_stopped_after_a_release_before_its_checkpoint_releases_it_once(
        tiny_cfg, tmp_path, monkeypatch):
    """Stopped right after round 2's aggregate reached server/transcript/ and before round
    2's checkpoint: the resume redoes round 2, every client re-sends its journaled noisy
    upload and the key holder its journaled sum, so the server holds round 2's release
    twice with one value; both attempts stay on its record, and are charged once."""
    run = tmp_path / "run"
    summary = stopped_and_resumed(creff_cfg(tiny_cfg, rounds=2), run, monkeypatch,
                                  simulator, "save_checkpoint", 1, {"when": at_checkpoint(2)})
    check_creff_redo(summary, run, 2)


def test_a_run_stopped_before_its_first_checkpoint_releases_round_1_once(
        tiny_cfg, tmp_path, monkeypatch):
    """No checkpoint yet: the resume starts over at round 1, and still re-sends round 1's
    journaled releases; the first attempt's record stays apart (attempt 0 and 1)."""
    run = tmp_path / "run"
    summary = stopped_and_resumed(creff_cfg(tiny_cfg, rounds=2), run, monkeypatch,
                                  simulator, "save_checkpoint", 1, {"when": at_checkpoint(1)})
    check_creff_redo(summary, run, 1)


@pytest.mark.slow
def test_the_issues_creff_run_stopped_at_round_3_is_charged_for_what_the_server_holds(
        tiny_cfg, tmp_path, monkeypatch):
    """The issue's reproduction, 6 rounds, stopped after round 3's release: the server held
    releases worth 9.50 against 7.996 reported; now 7.996 recomputed and reported."""
    run = tmp_path / "run"
    summary = stopped_and_resumed(creff_cfg(tiny_cfg, rounds=6), run, monkeypatch,
                                  simulator, "save_checkpoint", 1, {"when": at_checkpoint(3)})
    check_creff_redo(summary, run, 3)
    assert summary["privacy"]["from_transcript"]["epsilon"] == pytest.approx(7.996, abs=1e-3)


def test_ccvr_stopped_after_its_release_before_its_checkpoint_releases_it_once(
        tiny_cfg, tmp_path, monkeypatch):
    """CCVR's post-training release made, the run stopped before the checkpoint that
    records it: the resume makes the release again from the journal, the same values."""
    run = tmp_path / "run"
    cfg = tiny_cfg(method="ccvr", dp_eps=8.0, transcript=True)
    summary = stopped_and_resumed(
        cfg, run, monkeypatch, simulator, "save_checkpoint", 1,
        {"when": lambda d, p, **_: d.name == "checkpoint" and p.get("post_training")})
    assert_charged(summary)
    uploads = [e for e in index(run) if e["label"] == "ccvr-stats"
               and e["view"] == "plain-upload"]
    assert sorted(e["client"] for e in uploads) == [0, 0, 1, 1, 2, 2, 3, 3]
    for c in range(4):
        assert same_tensors(run, [e for e in uploads if e["client"] == c])


def test_dp_sgd_updates_of_a_redone_round_are_the_journaled_ones(tiny_cfg, tmp_path,
                                                                 monkeypatch):
    """--dp-train: a client's DP-SGD update is a release; the redone round re-sends it
    instead of training again with fresh noise and fresh Poisson batches."""
    run = tmp_path / "run"
    cfg = tiny_cfg(method="fedavg", dp_eps=8.0, dp_train=True, transcript=True)
    summary = stopped_and_resumed(cfg, run, monkeypatch, simulator, "save_checkpoint", 1,
                                  {"when": at_checkpoint(2)})
    assert_charged(summary)
    updates = [e for e in index(run) if e["label"] == "model-update" and e["round"] == 2]
    assert sorted(e["client"] for e in updates) == [0, 0, 1, 1, 2, 2, 3, 3]
    for c in range(4):
        assert same_tensors(run, [e for e in updates if e["client"] == c])


def test_dp_updates_under_secure_aggregation_resend_their_noise_shares(tiny_cfg, tmp_path,
                                                                       monkeypatch):
    """--dp-updates --secagg-updates: each client's clipped update with its noise share is
    journaled, and the key holder's sum of them; the redone round's sum is the first one."""
    run = tmp_path / "run"
    cfg = tiny_cfg(dp_updates=True, secagg_updates=True, dp_eps=8.0, transcript=True)
    summary = stopped_and_resumed(cfg, run, monkeypatch, simulator, "save_checkpoint", 1,
                                  {"when": at_checkpoint(2)})
    assert_charged(summary)
    sums = [e for e in index(run) if e["view"] == "aggregate" and e["round"] == 2]
    assert len(sums) == 2 and same_tensors(run, sums)


def test_central_dp_updates_resend_the_servers_noisy_sum(tiny_cfg, tmp_path, monkeypatch):
    """--dp-updates with central noise: the server's noisy sum of round 2 is journaled, so
    the redone round ends on the model the first attempt had reached."""
    run = tmp_path / "run"
    cfg = tiny_cfg(dp_updates=True, dp_eps=8.0, transcript=True, rounds=3)
    seen = []
    with monkeypatch.context() as m:
        original = simulator.Simulator.apply_round

        def keep(self, averaged, *args):
            sent = original(self, averaged, *args)
            seen.append({k: v.clone() for k, v in self.global_state.items()})
            return sent

        m.setattr(simulator.Simulator, "apply_round", keep)
        summary = stopped_and_resumed(cfg, run, monkeypatch, simulator, "save_checkpoint",
                                      1, {"when": at_checkpoint(2)})
    assert_charged(summary)
    first, redone = seen[1], seen[2]  # round 2, then round 2 again
    assert all(torch.equal(first[k], redone[k]) for k in first)


def dp_sgd_cfg(tiny_cfg):
    return tiny_cfg(method="fedavg", dp_eps=8.0, dp_train=True, rounds=3, transcript=True)


def is_update(_self, **kw):
    return kw["label"] == "model-update"


STEPS = {  # a step of round 2 of a 3-round run, and where the stop falls
    "before an upload": (creff_cfg, Uplink, "client_side", 3, {}),
    "after an upload": (creff_cfg, Uplink, "client_side", 3, {"after": True}),
    "after the release": (creff_cfg, Transcript, "record", 2,
                          {"after": True, "when": lambda self, **kw: kw["view"] == "aggregate"}),
    "before the checkpoint": (creff_cfg, simulator, "save_checkpoint", 1,
                              {"when": at_checkpoint(2)}),
    "after the checkpoint": (creff_cfg, ReleaseJournal, "prune_through", 2, {}),
    "after a DP-SGD update": (dp_sgd_cfg, Transcript, "record", 6,
                              {"after": True, "when": is_update}),
}


@pytest.mark.slow
@pytest.mark.parametrize("step", sorted(STEPS))
def test_a_run_stopped_at_any_step_of_a_round_holds_each_release_once(
        step, tiny_cfg, tmp_path, monkeypatch):
    run = tmp_path / "run"
    make, *stop = STEPS[step]
    summary = stopped_and_resumed(make(tiny_cfg), run, monkeypatch, *stop)
    assert_charged(summary)
    held: dict[tuple, list] = {}
    for e in index(run):
        if e["view"] in ("aggregate", "plain-upload") and e["label"] != "round":
            held.setdefault((e["round"], e["label"], e["client"]), []).append(e)
    assert {r for r, _, _ in held} == {1, 2, 3}
    assert all(same_tensors(run, group) for group in held.values())


def test_a_stop_while_the_checkpoint_is_written_leaves_it_complete(tiny_cfg, tmp_path,
                                                                     monkeypatch):
    """The round's checkpoint is written on the writer thread: a Ctrl-C on the round's
    thread just after the hand-over waits for it, so the run resumes from that round."""
    import time

    from privfedcal.federation.checkpoint import checkpoint_round

    real = simulator.save_checkpoint

    def slow(directory, payload, **kw):
        time.sleep(0.2)
        real(directory, payload, **kw)

    run = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(simulator, "save_checkpoint", slow)
        stop_at(m, simulator.Simulator, "save", 2, after=True)
        with pytest.raises(KeyboardInterrupt):
            build_simulator(dp_sgd_cfg(tiny_cfg), run).run()
    assert checkpoint_round(run) == 2
    assert not (run / "checkpoint.tmp").exists()
    privfedcal.resume_simulator(run).run()
    assert checkpoint_round(run) == 3


def test_a_failed_checkpoint_stops_the_run_before_the_next_rounds_releases(tiny_cfg, tmp_path,
                                                                          monkeypatch):
    """A write error on the writer thread reaches the round's thread before its next DP
    release leaves (``ReleaseJournal.before_put``): the run resumes from the previous
    checkpoint with only the failed round's releases to re-send."""
    from privfedcal.federation.checkpoint import checkpoint_round

    def full_disk(directory, payload, **_):
        raise OSError("no space left on device")

    run = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(simulator, "save_checkpoint", full_disk)
        with pytest.raises(OSError, match="no space"):
            build_simulator(dp_sgd_cfg(tiny_cfg), run).run()
    assert checkpoint_round(run) == 0
    assert ReleaseJournal(run / "journal").rounds() == [1]
    summary = privfedcal.resume_simulator(run).run()
    assert_charged(summary)
