"""``--partition natural`` from the command line: a tiny run on users read from an npz, the
partition command's size summary, and one-line refusals of bad user data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from privfedcal.cli.main import main

#: distinctive user names: the server's view must not hold any of them
NAMES = [f"writer-{c}-secret" for c in "abcd"]
SIZES = [14, 11, 20, 12]  # training samples of users 0..3


def write_users_npz(path, users, *, names=True) -> None:
    """8x8 grayscale images of 3 classes whose mean pixel tells the class (learnable)."""
    rng = np.random.default_rng(0)

    def images(n):
        y = rng.integers(0, 3, n)
        x = rng.integers(0, 60, (n, 8, 8)) + 80 * y[:, None, None]
        return x.astype(np.uint8), y

    x_tr, y_tr = images(len(users))
    x_te, y_te = images(12)
    extra = {"user_names": np.array(NAMES)} if names else {}
    np.savez(path, x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te, users=users, **extra)


@pytest.fixture
def users_npz(tmp_path):
    users = np.repeat(np.arange(4), SIZES)
    np.random.default_rng(1).shuffle(users)  # a user's samples need not be contiguous
    path = tmp_path / "users.npz"
    write_users_npz(path, users)
    return path, users


def fail(args, capsys) -> str:
    """The one line a refused command prints (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert exc.value.code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_train_one_client_per_user(users_npz, tmp_path):
    path, users = users_npz
    run = tmp_path / "run"
    main(["train", "--dataset", f"npz:{path}", "--partition", "natural", "--clients", "4",
          "--rounds", "2", "--local-epochs", "1", "--threads", "1", "--device", "cpu",
          "--out", str(run)])
    record = json.loads((run / "private" / "partition.json").read_text())
    assert record["partition"] == "natural" and record["sizes"] == SIZES
    assert record["client_users"] == NAMES
    for k, idx in enumerate(record["indices"]):
        assert idx == np.flatnonzero(users == k).tolist()
    summary = json.loads((run / "server" / "summary.json").read_text())
    assert len(summary["test_accuracy"] if "test_accuracy" in summary else [0]) >= 1
    # the user-to-client map stays on the clients' side: no file of the server's view
    # (public config, transcript, summary) names a user
    server_files = [p for p in (run / "server").rglob("*") if p.is_file()]
    assert server_files
    for p in server_files:
        data = p.read_bytes()
        assert not any(n.encode() in data for n in NAMES), p
    public = json.loads((run / "server" / "config.json").read_text())
    assert public["partition"] == "natural" and public["clients"] == 4


def test_partition_command_shows_the_size_distribution(users_npz, tmp_path, capsys):
    path, _ = users_npz
    out = tmp_path / "part"
    main(["partition", "--dataset", f"npz:{path}", "--partition", "natural", "--clients", "4",
          "--out", str(out)])
    stdout = capsys.readouterr().out
    assert ("client sizes (4 clients, 57 samples): min 11, p10 11.3, p25 11.75, median 13, "
            "p75 15.5, p90 18.2, max 20, mean 14.2") in stdout
    summary = json.loads((out / "partition.json").read_text())
    assert summary["sizes"] == SIZES and summary["client_users"] == NAMES
    assert summary["size_distribution"]["histogram"]["counts"] == [1, 1, 0, 1, 0, 0, 0, 0, 0, 1]


def test_many_users_print_the_summary_not_a_row_each(tmp_path, capsys):
    users = np.repeat(np.arange(120), 2)  # 120 users of 2 samples
    path = tmp_path / "many.npz"
    write_users_npz(path, users, names=False)
    out = tmp_path / "part"
    main(["partition", "--dataset", f"npz:{path}", "--partition", "natural", "--clients", "120",
          "--min-size", "2", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert "client sizes (120 clients, 240 samples): min 2" in stdout
    assert "  2 | " + "#" * 40 + " 120" in stdout
    assert "total" not in stdout  # no per-client table
    summary = json.loads((out / "partition.json").read_text())
    assert summary["client_users"] == [str(i) for i in range(120)]


def test_refusals(users_npz, tmp_path, capsys):
    path, users = users_npz
    common = ["--partition", "natural", "--rounds", "1", "--threads", "1", "--device", "cpu"]
    # --clients must equal the number of users: the line names both numbers
    line = fail(["train", "--dataset", f"npz:{path}", *common, "--out", str(tmp_path / "a")], capsys)
    assert "4 users, so set clients to 4, not 10" in line
    line = fail(["partition", "--dataset", f"npz:{path}", "--partition", "natural", "--clients",
                 "5", "--out", str(tmp_path / "b")], capsys)
    assert "set clients to 4, not 5" in line
    line = fail(["train", "--dataset", f"npz:{path}", *common, "--clients", "4", "--min-size",
                 "12", "--out", str(tmp_path / "c")], capsys)
    assert "user 1 (client 1) holds 11 training samples, fewer than min size 12" in line
    # no users array
    plain = tmp_path / "plain.npz"
    np.savez(plain, x_train=np.zeros((20, 8, 8), np.uint8), y_train=np.arange(20) % 2,
             x_test=np.zeros((4, 8, 8), np.uint8), y_test=np.arange(4) % 2)
    line = fail(["train", "--dataset", f"npz:{plain}", *common, "--clients", "2",
                 "--out", str(tmp_path / "d")], capsys)
    assert "natural partition needs a user id per training sample" in line
    # a users array of the wrong length, and non-integer ids
    for bad, needle in ((users[:-1], "57 images but user ids of shape (56,)"),
                        (users + 0.5, "user ids must be integers, not float64")):
        path_bad = tmp_path / "bad.npz"
        write_users_npz(path_bad, bad, names=False)
        if len(bad) != len(users):  # keep 57 training images beside 56 user ids
            with np.load(path_bad) as z:
                arrays = dict(z)
            arrays["x_train"] = np.concatenate([arrays["x_train"], arrays["x_train"][:1]])
            arrays["y_train"] = np.concatenate([arrays["y_train"], arrays["y_train"][:1]])
            np.savez(path_bad, **arrays)
        line = fail(["train", "--dataset", f"npz:{path_bad}", *common, "--clients", "4",
                     "--out", str(tmp_path / "e")], capsys)
        assert needle in line, line
    assert not any((tmp_path / d).exists() for d in "abcde")  # refused before a run folder
