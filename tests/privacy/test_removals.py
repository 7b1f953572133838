"""privacy/removals.py: files and folders removed on one background thread."""

from __future__ import annotations

import pytest

from privfedcal.privacy.removals import pending, remove_later, wait_for_removals


def test_files_and_folders_are_gone_after_the_wait(tmp_path):
    folder = tmp_path / "ck.old"
    folder.mkdir()
    (folder / "state.safetensors").write_bytes(b"x" * 1000)
    file = tmp_path / "r00001-x.safetensors"
    file.write_bytes(b"y")
    remove_later([folder, file, tmp_path / "never-existed"])
    wait_for_removals()
    assert list(tmp_path.iterdir()) == [] and not pending(folder)


def test_an_error_is_raised_by_the_next_wait(tmp_path, monkeypatch):
    import privfedcal.privacy.removals as module

    def refuse(path):
        raise PermissionError(f"cannot remove {path}")

    folder = tmp_path / "kept"
    folder.mkdir()
    monkeypatch.setattr(module.shutil, "rmtree", refuse)
    remove_later([folder])
    with pytest.raises(PermissionError, match="cannot remove"):
        wait_for_removals()
    wait_for_removals()  # raised once
    assert folder.is_dir()
