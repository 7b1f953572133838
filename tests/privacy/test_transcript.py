"""privacy/transcript.py: the server's view, release by release, on disk."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from privfedcal.errors import UsageError
from privfedcal.privacy.transcript import (
    Transcript,
    load_transcript,
    record_model_updates,
    record_round,
    state_bytes,
)


def test_record_writes_index_and_one_safetensors_file_per_batch(tmp_path):
    tr = Transcript(tmp_path / "transcript")
    tr.record(round_=1, label="ccvr-stats", view="plain-upload", client=3,
              tensors={"sum": torch.tensor([1.0, 2.0])}, bytes=8)
    tr.record(round_=1, label="ccvr-stats", view="ciphertext", client=4, bytes=1000)
    tr.record(round_=1, label="ccvr-stats", view="aggregate", client=None,
              tensors={"sum": torch.tensor([3.0, 5.0])}, bytes=16)
    tr.flush()  # the file is written by a thread; flush waits for it, then the index
    index = json.loads((tmp_path / "transcript" / "index.json").read_text())
    batch = "00000-r1-records.safetensors"  # the records since the last flush: one file
    assert index == [
        {"round": 1, "label": "ccvr-stats", "view": "plain-upload", "client": 3, "bytes": 8,
         "file": batch, "key": "00000"},
        {"round": 1, "label": "ccvr-stats", "view": "ciphertext", "client": 4, "bytes": 1000},
        {"round": 1, "label": "ccvr-stats", "view": "aggregate", "client": None, "bytes": 16,
         "file": batch, "key": "00002"},
    ]
    assert [p.name for p in (tmp_path / "transcript").glob("*.safetensors")] == [batch]
    # a plain safetensors file: each record's tensors under its key
    assert set(load_file(str(tmp_path / "transcript" / batch))) == {"00000/sum", "00002/sum"}
    # calibration uploads only: the aggregate is not an upload
    assert tr.uploaded_bytes() == 1008
    loaded = load_transcript(tmp_path / "transcript")
    assert torch.equal(loaded[0]["tensors"]["sum"], torch.tensor([1.0, 2.0]))
    assert "tensors" not in loaded[1]
    assert torch.equal(loaded[2]["tensors"]["sum"], torch.tensor([3.0, 5.0]))


def test_a_resume_keeps_what_the_server_received_and_tags_the_redo(tmp_path):
    """Resumed from round 1's checkpoint, rounds 2 and 3 are redone: their first attempt
    stays on record (the server holds it), the redo's entries carry attempt 1, and its
    files never take the name of a file of the first attempt."""
    d = tmp_path / "t"
    tr = Transcript(d)
    for r in (1, 2, 3):
        tr.record(round_=r, label="creff-grad", view="aggregate", client=None, bytes=r,
                  tensors={"g": torch.full((1,), float(r))})
        tr.flush()  # a checkpoint a round
    again = Transcript(d)
    assert [e["round"] for e in again.entries] == [1, 2, 3]
    again.resume_after(1)
    assert again.attempt == 1
    again.record(round_=2, label="creff-grad", view="aggregate", client=None, bytes=2,
                 tensors={"g": torch.full((1,), 2.0)})
    again.flush()
    index = json.loads((d / "index.json").read_text())
    assert [(e["round"], e.get("attempt", 0)) for e in index] == [(1, 0), (2, 0), (3, 0),
                                                                  (2, 1)]
    assert len({e["file"] for e in index}) == 4 and "-a1-" in index[-1]["file"]
    third = Transcript(d)
    third.resume_after(1)  # stopped again: the next redo is attempt 2
    assert third.attempt == 2
    third.resume_after(3)  # nothing after the checkpoint: the attempt stays
    assert third.attempt == 2


def test_files_a_killed_process_left_unlisted_are_never_written_over(tmp_path):
    """Killed before its index was rewritten, a process leaves files the index does not
    name; the redo writes its own beside them."""
    d = tmp_path / "t"
    tr = Transcript(d)
    tr.record(round_=1, label="creff-grad", view="aggregate", client=None,
              tensors={"g": torch.ones(1)})
    tr.flush()
    tr.record(round_=2, label="creff-grad", view="aggregate", client=None,
              tensors={"g": torch.full((1,), 2.0)})
    tr.seal()
    tr._writer.wait()  # the file is on disk; the index is not rewritten (killed)
    again = Transcript(d)
    assert len(again.entries) == 1
    again.resume_after(1)
    again.record(round_=2, label="creff-grad", view="aggregate", client=None,
                 tensors={"g": torch.full((1,), 3.0)})
    again.flush()
    files = sorted(p.name for p in d.glob("*.safetensors"))
    assert files == ["00000-r1-records.safetensors", "00001-a1-r2-records.safetensors",
                     "00001-r2-records.safetensors"]
    tr._writer.stop()  # the killed process's writer, without its index


def test_no_directory_keeps_nothing_on_disk(tmp_path):
    tr = Transcript(None)
    tr.record(round_=1, label="x", view="plain-upload", client=0,
              tensors={"a": torch.ones(1)}, bytes=4)
    assert tr.entries == [{"round": 1, "label": "x", "view": "plain-upload", "client": 0,
                           "bytes": 4, "file": None}]
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match="no transcript"):
        load_transcript(tmp_path)


def test_a_transcript_without_files_is_kept_by_the_checkpoint(tmp_path):
    """``--no-transcript``: the entries live in memory only, so the checkpoint keeps them
    (a resumed run still counts every upload); one on disk is read back from its index."""
    tr = Transcript(None)
    for r in (1, 2, 3):
        tr.record(round_=r, label="creff-grad", view="ciphertext", client=r, bytes=10 * r,
                  participants=[0, r])
    state = json.loads(json.dumps(tr.state_dict()))  # the checkpoint's JSON skeleton
    again = Transcript(None)
    again.load_state_dict(state)
    again.resume_after(2)  # round 3's ciphertext reached the server: it counts
    assert again.entries == tr.entries and again.uploaded_bytes() == 60
    assert again.attempt == 1
    on_disk = Transcript(tmp_path / "t")
    assert on_disk.state_dict() == {}
    on_disk.load_state_dict(state)  # its own index holds its entries
    assert on_disk.entries == []
    with pytest.raises(UsageError, match="list of objects"):
        Transcript(None).load_state_dict({"entries": [1, 2]})


def test_model_states_and_updates_are_recorded_with_weights_sizes_and_recipe(tmp_path):
    tr = Transcript(tmp_path)
    state = {"w": torch.zeros(2, 3), "n": torch.zeros(1, dtype=torch.int64)}
    assert state_bytes(state) == 2 * 3 * 4 + 8
    record_round(tr, 2, state, [5, 1])
    recipe = {"local_epochs": 1, "batch_size": 32, "lr": 0.01}
    record_model_updates(tr, 2, [5, 1], [state, state], [0.25, 0.75], recipe)
    record_model_updates(tr, 3, [0], [state], None, recipe)
    e = tr.entries
    assert e[0] == {"round": 2, "label": "round", "view": "model-state", "client": None,
                    "participants": [5, 1], "file": "00000-r2-records.safetensors",
                    "key": "00000"}
    assert [(x["client"], x["weight"], x["bytes"]) for x in e[1:]] == [(5, 0.25, 32),
                                                                       (1, 0.75, 32),
                                                                       (0, None, 32)]
    assert all(x["label"] == "model-update" and x["lr"] == 0.01 for x in e[1:])
    # model updates are counted apart from the calibration uploads
    assert tr.uploaded_bytes() == 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.one_of(st.integers(1, 4), st.just("resume"), st.just("reopen")),
                max_size=12))
def test_index_on_disk_always_equals_the_entries_in_memory(tmp_path_factory, ops):
    # Entries are encoded once when recorded; whatever sequence of records, resumes and re-openings, the index file must hold exactly the entries in memory.
    d = tmp_path_factory.mktemp("t") / "transcript"
    tr = Transcript(d)
    for op in ops:
        if op == "resume":
            tr.resume_after(2)
        elif op == "reopen":  # a resume reads what the last flush (checkpoint) wrote
            tr.flush()
            tr = Transcript(d)
        else:
            tr.record(round_=op, label="creff-grad", view="plain-upload", client=op % 3,
                      tensors={"g": torch.full((2,), float(op))}, bytes=8, note=[op, "x"])
        tr.flush()
        index = json.loads((d / "index.json").read_text())
        assert index == tr.entries
        assert all((d / e["file"]).is_file() for e in index)
    tr.close()
    assert Transcript(d).entries == tr.entries


def test_files_hold_the_tensors_as_they_were_when_recorded(tmp_path):
    # the batch keeps a copy: a caller that reuses its tensors after record cannot change
    # what the transcript holds
    tr = Transcript(tmp_path)
    t = torch.zeros(1000)
    for v in range(5):
        t.fill_(float(v))
        tr.record(round_=v, label="x", view="plain-upload", client=0, tensors={"a": t})
    tr.close()
    loaded = load_transcript(tmp_path)
    assert [float(e["tensors"]["a"].unique()) for e in loaded] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_failed_write_is_raised_by_the_next_flush_and_the_index_is_not_rewritten(tmp_path):
    d = tmp_path / "t"
    tr = Transcript(d)
    tr.record(round_=1, label="x", view="plain-upload", client=0, tensors={"a": torch.ones(1)})
    tr.flush()
    (d / "00001-r1-records.safetensors").mkdir()  # the next file cannot be written
    tr.record(round_=1, label="x", view="plain-upload", client=1, tensors={"a": torch.ones(1)})
    with pytest.raises(IsADirectoryError):
        tr.flush()
    assert len(json.loads((d / "index.json").read_text())) == 1


def test_a_flush_appends_to_the_index_it_wrote_and_rewrites_one_changed_since(tmp_path):
    """Later flushes write only the new entries over the closing bracket: the file is byte
    for byte the full rewrite; a file changed by someone else is written whole again."""
    d = tmp_path / "t"
    tr = Transcript(d)
    for r in (1, 2, 3):
        tr.record(round_=r, label="x", view="ciphertext", client=r, bytes=r)
        tr.flush()
        whole = "[\n" + ",\n".join(json.dumps(e) for e in tr.entries) + "\n]\n"
        assert (d / "index.json").read_text() == whole
    (d / "index.json").write_text("[]\n")  # not what this process wrote: rewritten whole
    tr.record(round_=4, label="x", view="ciphertext", client=4, bytes=4)
    tr.flush()
    assert json.loads((d / "index.json").read_text()) == tr.entries
