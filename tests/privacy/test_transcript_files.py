"""privacy/transcript_files.py: batches of records in one safetensors file, the writer
thread, and reading both layouts (a batch per file, a file per record)."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from privfedcal.privacy import transcript_files as module
from privfedcal.privacy.transcript import Transcript, load_transcript
from privfedcal.privacy.transcript_epsilon import file_loader
from privfedcal.privacy.transcript_files import read_entry, write_records, write_tensors


def test_a_batch_is_a_safetensors_file_of_every_dtype_shape_and_size(tmp_path):
    records = [("00000", {"w": torch.randn(3, 4), "b": torch.randn(4).to(torch.bfloat16),
                          "n": torch.tensor(7), "mask": torch.tensor([True, False, True])}),
               ("00001", {"w": torch.arange(6, dtype=torch.int64).reshape(2, 3),
                          "empty": torch.zeros(0, 5), "h": torch.ones(3).half()})]
    write_records(str(tmp_path / "b.safetensors"), records)
    loaded = load_file(str(tmp_path / "b.safetensors"))  # safetensors' own reader
    expected = {f"{key}/{name}": t for key, ts in records for name, t in ts.items()}
    assert loaded.keys() == expected.keys()
    for k, t in expected.items():
        assert loaded[k].dtype == t.dtype and torch.equal(loaded[k], t)
    raw = (tmp_path / "b.safetensors").read_bytes()  # every tensor aligned to its elements
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert all(header[k]["data_offsets"][0] % t.element_size() == 0
               for k, t in expected.items())


def test_a_file_is_byte_for_byte_the_one_safetensors_writes(tmp_path):
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
    tensors = {f"{'zyx'[i % 3]}.{i}": (torch.randn(i % 4 + 1, 3) * 9).to(d)
               for i, d in enumerate(dtypes * 2)}
    write_tensors(str(tmp_path / "ours.safetensors"), tensors)
    save_file(tensors, str(tmp_path / "theirs.safetensors"))
    assert ((tmp_path / "ours.safetensors").read_bytes()
            == (tmp_path / "theirs.safetensors").read_bytes())


def test_a_dtype_outside_the_table_is_written_by_safetensors(tmp_path):
    records = [("00000", {"z": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)})]
    write_records(str(tmp_path / "c.safetensors"), records)
    assert torch.equal(load_file(str(tmp_path / "c.safetensors"))["00000/z"],
                       records[0][1]["z"])


def test_writer_holds_a_bounded_number_of_pending_bytes(tmp_path, monkeypatch):
    """A file that would take the queued bytes past the bound waits until the writer has
    written the earlier ones (the disk is held back here by a gate)."""
    gate, real_write = threading.Event(), module.write_records

    def gated_write(path, records):
        gate.wait()
        real_write(path, records)

    monkeypatch.setattr(module, "write_records", gated_write)
    records = [("00000", {"x": torch.zeros(1000)})]  # 4,000 bytes
    writer = module.Writer(max_pending=6000)
    writer.put(list(records), str(tmp_path / "a.safetensors"), 4000)  # accepted
    returned = threading.Event()

    def second():
        writer.put(list(records), str(tmp_path / "b.safetensors"), 4000)
        returned.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert not returned.wait(0.5)  # 8,000 would pass 6,000: waits for the first file
    gate.set()
    assert returned.wait(10)
    thread.join()
    writer.wait()
    writer.stop()
    assert (tmp_path / "a.safetensors").exists() and (tmp_path / "b.safetensors").exists()


def test_a_batch_past_its_size_is_written_without_waiting_for_a_seal(tmp_path, monkeypatch):
    monkeypatch.setattr("privfedcal.privacy.transcript.BATCH_BYTES", 10_000)
    tr = Transcript(tmp_path)
    for c in range(5):  # 4,000 bytes each: a file after every third record
        tr.record(round_=1, label="x", view="plain-upload", client=c,
                  tensors={"a": torch.full((1000,), float(c))})
    tr.close()
    assert [e["file"] for e in tr.entries] == (["00000-r1-records.safetensors"] * 3
                                               + ["00003-r1-records.safetensors"] * 2)
    loaded = load_transcript(tmp_path)
    assert [float(e["tensors"]["a"][0]) for e in loaded] == [0.0, 1.0, 2.0, 3.0, 4.0]


def old_layout(d, rounds=(1, 2)):
    """A transcript as privfedcal wrote one before batches: a file per record, named
    after it, no ``key`` in the index."""
    d.mkdir(parents=True)
    index = []
    for r in rounds:
        for c in (None, 0, 1):
            tag = f"r{r}-round-model-state" if c is None else f"r{r}-model-update-plain-upload-c{c}"
            name = f"{len(index):05d}-{tag}.safetensors"
            save_file({"w": torch.full((2, 2), 10.0 * r + (c or 0))}, str(d / name))
            index.append({"round": r, "label": "round" if c is None else "model-update",
                          "view": "model-state" if c is None else "plain-upload",
                          "client": c, "file": name})
    (d / "index.json").write_text(json.dumps(index))
    return index


def test_a_transcript_of_one_file_per_record_is_read_and_resumed(tmp_path):
    d = tmp_path / "t"
    index = old_layout(d)
    loaded = load_transcript(d)
    assert [float(e["tensors"]["w"][0, 0]) for e in loaded] == [10, 10, 11, 20, 20, 21]
    assert float(read_entry(d, index[2])["w"][0, 0]) == 11.0
    assert float(file_loader(d)(index[5])["w"][0, 0]) == 21.0
    tr = Transcript(d)  # resumed from round 1's checkpoint: round 2 redone in batches
    tr.resume_after(1)
    tr.record(round_=2, label="round", view="model-state", client=None,
              tensors={"w": torch.full((2, 2), 20.0)}, participants=[0, 1])
    tr.close()
    both = load_transcript(d)
    assert len(both) == 7 and both[-1]["file"] == "00006-a1-r2-records.safetensors"
    assert [float(e["tensors"]["w"][0, 0]) for e in both] == [10, 10, 11, 20, 20, 21, 20]


def test_a_missing_file_reads_as_none(tmp_path):
    assert read_entry(tmp_path, {"file": "gone.safetensors", "key": "00000"}) is None
    assert read_entry(tmp_path, {"file": None}) is None


@pytest.mark.parametrize("copy", [True, False])
def test_tensors_handed_over_are_kept_without_a_copy(tmp_path, copy):
    tr = Transcript(tmp_path)
    t = torch.zeros(4)
    tr.record(round_=1, label="x", view="plain-upload", client=0, tensors={"a": t}, copy=copy)
    kept = tr._batch[1][0][1]["a"]
    assert (kept.data_ptr() == t.data_ptr()) is not copy
    tr.close()


def _upload(transcript, round_):
    transcript.record(round_=round_, label="x", view="plain-upload", client=0,
                      tensors={"w": torch.full((2,), float(round_))})


def test_a_job_handed_over_runs_after_its_files_and_the_index_of_its_entries(tmp_path):
    """``hand_over``: the job (a checkpoint) sees the round's file on disk and the index
    listing the entries recorded before it, not those recorded while it waits."""
    t = Transcript(tmp_path)
    _upload(t, 1)
    gate, seen = threading.Event(), []

    def job():
        gate.wait(10)
        index = json.loads((tmp_path / "index.json").read_text())
        seen.append((len(index), all((tmp_path / e["file"]).is_file() for e in index)))

    t.hand_over(job)
    _upload(t, 2)  # recorded while the job is pending
    gate.set()
    t.wait_for_jobs()
    assert seen == [(1, True)]
    t.close()
    assert len(json.loads((tmp_path / "index.json").read_text())) == 2


def test_a_jobs_error_is_raised_on_the_recording_thread_and_later_files_are_written(tmp_path):
    t = Transcript(tmp_path)
    _upload(t, 1)

    def full_disk():
        raise OSError("no space left")

    t.hand_over(full_disk)
    _upload(t, 2)
    with pytest.raises(OSError, match="no space"):
        t.seal()  # raises if the job has failed already (the batch stays open), else:
        t.wait_for_jobs()
    t.close()
    index = json.loads((tmp_path / "index.json").read_text())
    assert [read_entry(tmp_path, e)["w"][0].item() for e in index] == [1.0, 2.0]


def test_a_file_that_failed_skips_the_job_after_it(tmp_path, monkeypatch):
    """A checkpoint never follows a record that did not reach the disk."""
    def failing(path, records):
        raise OSError("disk error")

    monkeypatch.setattr(module, "write_records", failing)
    t = Transcript(tmp_path)
    _upload(t, 1)
    ran = []
    t.hand_over(lambda: ran.append(True))
    with pytest.raises(OSError, match="disk error"):
        t.wait()
    assert ran == []
    monkeypatch.undo()
    t.close()


def test_a_transcript_without_files_runs_its_jobs_in_turn():
    """``--no-transcript``: no files, but the checkpoint still goes to the writer thread."""
    t = Transcript(None)
    ran = []
    for i in range(3):
        t.hand_over(lambda i=i: ran.append(i))
    t.close()
    assert ran == [0, 1, 2]
