"""attacks/view.py: the transcript grouped into releases, and the uploaded-feature map."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from privfedcal.attacks.view import RunView, UploadedFeatures, load_run
from privfedcal.calibration.ccvr import CCVR_RELEASE as STATS_LABEL
from privfedcal.calibration.creff import CREFF_RELEASE as GRAD_LABEL
from privfedcal.errors import UsageError
from privfedcal.models.feature_classifier import FeatureClassifier


def _t(v: float) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor([v])}


ENTRIES = [
    {"round": 1, "label": GRAD_LABEL, "view": "model-state", "client": None, "tensors": _t(0)},
    {"round": 1, "label": GRAD_LABEL, "view": "plain-upload", "client": 2, "tensors": _t(1)},
    {"round": 1, "label": GRAD_LABEL, "view": "plain-upload", "client": 0, "tensors": _t(2)},
    {"round": 2, "label": GRAD_LABEL, "view": "model-state", "client": None, "tensors": _t(3)},
    {"round": 2, "label": GRAD_LABEL, "view": "ciphertext", "client": 1, "bytes": 900},
    {"round": 2, "label": GRAD_LABEL, "view": "aggregate", "client": None, "tensors": _t(4)},
    {"round": 3, "label": GRAD_LABEL, "view": "model-state", "client": None, "tensors": _t(5)},
    {"round": 3, "label": "model-update", "view": "plain-upload", "client": 1,
     "tensors": _t(6)},
]


def _view(entries) -> RunView:
    return RunView(Path("run"), None, {}, None, entries)


def test_releases_group_the_server_view_by_round():
    rels = _view(ENTRIES).releases(GRAD_LABEL)
    assert [r.round for r in rels] == [1, 2, 3]
    r1, r2, r3 = rels
    assert float(r1.state["x"]) == 0 and sorted(r1.uploads) == [0, 2]
    assert float(r1.uploads[2]["x"]) == 1 and r1.aggregate is None and r1.ciphertext_bytes == {}
    assert r2.uploads == {} and float(r2.aggregate["x"]) == 4 and r2.ciphertext_bytes == {1: 900}
    assert r3.uploads == {} and r3.aggregate is None  # skipped: nothing reached the server
    assert _view(ENTRIES).releases(STATS_LABEL) == []


def test_release_picks_the_last_or_the_asked_round_and_explains_what_is_missing():
    view = _view(ENTRIES)
    assert view.release(GRAD_LABEL, None).round == 2  # round 3 was skipped
    assert view.release(GRAD_LABEL, 1).round == 1
    with pytest.raises(UsageError, match="no 'creff-grad' release in round 3; rounds: 1, 2"):
        view.release(GRAD_LABEL, 3)
    with pytest.raises(UsageError, match=r"holds no 'ccvr-stats' release \(it has: "
                                         r"creff-grad, model-update\)"):
        view.release(STATS_LABEL, None)
    with pytest.raises(UsageError, match="was skipped"):
        _view(ENTRIES[6:7]).release(GRAD_LABEL, None)


class _Id(FeatureClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.feature_dim, self.num_classes = 2, 2
        self.classifier = nn.Linear(2, 2)

    def features(self, x):
        return x


def test_uploaded_features_apply_tukey_then_the_clip():
    z = torch.tensor([[4.0, -1.0], [9.0, 16.0], [0.01, 0.0]])
    up = UploadedFeatures(_Id(), 0.5, 2.0)
    assert up.classifier is up.inner.classifier and up.feature_dim == 2
    # relu then sqrt: [2, 0] (norm 2), [3, 4] (norm 5 -> clipped to 2), [0.1, 0] (kept)
    torch.testing.assert_close(up.features(z), torch.tensor([[2.0, 0.0], [1.2, 1.6],
                                                             [0.1, 0.0]]))
    torch.testing.assert_close(UploadedFeatures(_Id(), None, 1.0).features(z),
                               torch.tensor([[4 / 17**0.5, -1 / 17**0.5], [9 / 337**0.5, 16 / 337**0.5],
                                             [0.01, 0.0]]))


def test_load_run_refuses_folders_without_config_or_transcript(tmp_path):
    with pytest.raises(UsageError, match="is not a run folder"):
        load_run(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="no transcript"):
        load_run(tmp_path)
