"""The jobs of ``privfedcal attack`` as the command runs them (privfedcal/api/attack_jobs.py):
called with parsed values and a ``Shown`` of one's own, without the CLI, they write the
command's files, return what it prints and report their progress to that ``Shown``."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest

import privfedcal
from privfedcal.api.attack_jobs import (
    AttackOutcome,
    classes_for_cli,
    invert_for_cli,
    whole_for_cli,
)
from privfedcal.attacks.release_attacks import release_attack
from privfedcal.errors import UsageError

FAST = dict(clients=3, rounds=2, local_epochs=1, threads=1, device="cpu", alpha=0.5)


class Recorded:
    """A ``Shown`` that keeps what it was given."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.opened: list[str] = []
        self.seen: list[object] = []

    def say(self, line: str) -> None:
        self.lines.append(line)

    def train(self, sim):
        return sim.run()

    @contextmanager
    def progress(self, kind: str):
        self.opened.append(kind)
        yield self.seen.append


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("attack_jobs") / "ccvr"
    privfedcal.train(method="ccvr", out=out, progress=False, **FAST)
    return out


def test_invert_writes_the_commands_files_and_reports_progress(run, tmp_path):
    stats = release_attack("stats")
    shown = Recorded()
    done = invert_for_cli([stats], {"stats": stats.options(steps=10, restarts=1, raw_samples=1)},
                          run=run, out=tmp_path / "inv", clients=[0], classes=None,
                          device="cpu", threads=None, seed=0, resume=False, overwrite=False,
                          shown=shown)
    assert isinstance(done, AttackOutcome) and done.kind == "stats" and done.run == run
    assert sorted(p.name for p in (tmp_path / "inv").iterdir()) == sorted(done.files)
    assert json.loads((tmp_path / "inv" / "attack.json").read_text()) == done.records
    assert {r["client"] for r in done.records} == {0}
    assert shown.opened == ["stats"] and shown.seen and shown.lines == []
    with pytest.raises(UsageError, match="--overwrite"):  # its messages name the flags
        invert_for_cli([stats], {"stats": stats.options(steps=10, restarts=1)}, run=run,
                       out=tmp_path / "inv", clients=[0], classes=None, device="cpu",
                       threads=None, seed=0, resume=False, overwrite=False, shown=shown)


def test_classes_and_a_whole_run_attack(run, tmp_path):
    from privfedcal.attacks.reconstruction.uploads import ClassesOptions

    shown = Recorded()
    done = classes_for_cli(ClassesOptions(), run=run, out=None, seed=0, device="cpu",
                           threads=None, overwrite=False, shown=shown)
    assert done.out_dir == run / "attack-classes" and shown.opened == ["classes"]
    assert len(done.records) == FAST["clients"]
    disaggregate = release_attack("disaggregate")
    with pytest.raises(UsageError, match="nothing to disaggregate"):  # no secure sums here
        whole_for_cli(disaggregate, disaggregate.options(), run=run, out=tmp_path / "d",
                      device="cpu", overwrite=False)
