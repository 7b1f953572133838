"""The release journal: what a party released, on disk before it leaves, re-sent once."""

from __future__ import annotations

import torch

from privfedcal.privacy.release_journal import (
    ReleaseJournal,
    charge_of,
    contributors_party,
)
from privfedcal.privacy.removals import wait_for_removals


def test_a_release_is_journaled_then_resent_instead_of_the_fresh_one(tmp_path):
    journal = ReleaseJournal(tmp_path / "journal")
    first = {"grad": torch.tensor([1.0, 2.0]), "count": torch.tensor([3.0])}
    sent = journal.once(3, "creff-grad", 1, first, charge={"noise_multiplier": 2.0})
    assert sent is first and journal.reused == 0
    assert not list((tmp_path / "journal").glob("*.tmp"))  # renamed into place
    again = ReleaseJournal(tmp_path / "journal")  # the resumed process
    fresh = {"grad": torch.tensor([9.0, 9.0]), "count": torch.tensor([9.0])}
    resent = again.once(3, "creff-grad", 1, fresh)
    assert all(torch.equal(resent[k], first[k]) for k in first) and again.reused == 1
    tensors, record = again.get(3, "creff-grad", 1)
    assert record == {"round": 3, "label": "creff-grad", "party": 1,
                      "charge": {"noise_multiplier": 2.0}}
    # another client, label or round is another release
    assert again.get(3, "creff-grad", 2) is None and again.get(4, "creff-grad", 1) is None


def test_labels_with_separators_and_named_parties_have_their_own_files(tmp_path):
    journal = ReleaseJournal(tmp_path)
    journal.put(1, "quantile/1", "server", {"v": torch.ones(1)})
    journal.put(1, "quantile/2", "server", {"v": torch.zeros(1)})
    assert torch.equal(journal.get(1, "quantile/1", "server")[0]["v"], torch.ones(1))
    assert torch.equal(journal.get(1, "quantile/2", "server")[0]["v"], torch.zeros(1))


def test_a_checkpoint_prunes_the_rounds_it_holds(tmp_path):
    for journal in (ReleaseJournal(tmp_path / "j"), ReleaseJournal(None)):
        for r in (1, 2, 3):
            journal.put(r, "ccvr-stats", 0, {"v": torch.full((1,), float(r))})
        assert journal.rounds() == [1, 2, 3]
        journal.prune_through(2)
        assert journal.rounds() == [3]
        assert journal.get(2, "ccvr-stats", 0) is None
    ReleaseJournal(tmp_path / "never").prune_through(5)  # nothing released: no folder
    assert not (tmp_path / "never").exists()


def test_the_key_holder_journals_each_set_of_contributors_apart():
    assert contributors_party([3, 1, 2]) == contributors_party([1, 2, 3])
    assert contributors_party([1, 2]) != contributors_party([1, 2, 3])
    assert contributors_party([1, 2]).startswith("keyholder-")


def test_the_charge_is_the_plans_multiplier_rate_and_steps():
    class Plan:
        sigmas = {"dpsgd": 1.5}
        rates = {"dpsgd": 0.1}
        steps = {"dpsgd": 20}

    assert charge_of(Plan, "dpsgd") == {"noise_multiplier": 1.5, "sample_rate": 0.1,
                                        "steps": 20}
    assert charge_of(Plan, "ccvr-stats") is None and charge_of(None, "dpsgd") is None


def test_a_pruning_in_the_background_spares_what_is_journaled_after_it(tmp_path):
    journal = ReleaseJournal(tmp_path / "j")
    for r in (1, 2):
        journal.put(r, "ccvr-stats", 0, {"v": torch.full((1,), float(r))})
    journal.prune_through(2, background=True)
    journal.put(2, "post", "server", {"v": torch.ones(1)})  # a release made after the prune
    wait_for_removals()
    assert journal.rounds() == [2] and journal.get(2, "ccvr-stats", 0) is None
    assert journal.get(2, "post", "server") is not None
