"""Client splits in files: fedrcl's JSON export (written beside every run) and the authors' dict literals."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import REPO, run_cli
from fedrcl.data.datamodule import FederatedDataModule
from fedrcl.data.partition import dirichlet_partition
from fedrcl.data.split_file import (SPLIT_FORMAT, authors_split_name, label_fingerprint, labels_differ, read_split,
                                     read_split_file, write_split)


def authors_text(parts: dict[int, list[int]]) -> str:
    """A file in the layout of the authors' client_data/*.txt: one dict literal on one line."""
    return "{" + ", ".join(f"{k}: [{', '.join(map(str, v))}]" for k, v in parts.items()) + "}\n"


def test_json_round_trip(tmp_path):
    parts = [np.array([4, 0, 9]), np.array([5], dtype=np.int64), np.array([7, 1])]
    path = write_split(tmp_path / "split.json", parts, "cifar10")
    doc = json.loads(path.read_text())
    assert doc == {"format": SPLIT_FORMAT, "dataset": "cifar10", "num_clients": 3,
                   "clients": [[4, 0, 9], [5], [7, 1]]}
    got = read_split(path, num_clients=3, num_samples=10, dataset="cifar10")
    assert [p.tolist() for p in got] == [[0, 4, 9], [5], [1, 7]]
    assert all(p.dtype == np.int64 for p in got)
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_authors_format_is_parsed_by_client_id(tmp_path):
    path = tmp_path / "dirichlet0.05_clients3.txt"
    path.write_text(authors_text({1: [5, 3], 0: [2, 0, 8], 2: [7, 1]}))
    assert [p.tolist() for p in read_split(path, 3, 9)] == [[0, 2, 8], [3, 5], [1, 7]]  # by id, sorted
    path.write_text("{1: [5, 3],\n 0: [2, 0, 8], 2: [7, 1,],\n}\n")  # line breaks, trailing commas
    assert [p.tolist() for p in read_split(path, 3, 9)] == [[0, 2, 8], [3, 5], [1, 7]]
    assert authors_split_name(path) == (0.05, 3)
    assert authors_split_name(tmp_path / "split.json") is None


MALFORMED = [
    ("{0: [1, 2], 1: [3, 4]", r"cannot parse \(line 1"),
    ("{0: [1, 2] 1: [3]}", r"cannot parse"),
    ("{0, 1}", r"holds set .{0, 1}. \(line 1\), not a dict"),
    ("{0: [1, 2.0], 1: [3]}", r"client 0 holds '2\.0' \(line 1\), not an integer index"),
    ("{0: [1, '2'], 1: [3]}", r"not an integer index"),
    ("{0: [1, True], 1: [3]}", r"client 0 holds 'True'"),
    ("{0: [1, 2], 'b': [3]}", r"client id \"'b'\" \(line 1\) is not an integer"),
    ("{0: [1, 2], 1: (3, 4)}", r"client 1 maps to '\(3, 4\)' \(line 1\), not a list"),
    ("{0: [1, 2], 1: [2, 3]}", r"index 2 is held by clients 0 and 1"),
    ("{0: [1, 1], 1: [3]}", r"index 1 is held by client 0 twice"),
    ("{0: [1, 2], 1: []}", r"client 1 holds no samples; every client needs at least one"),
    ("{0: [], 1: []}", r"client 0 holds no samples \(and 1 more: 1\)"),
    ("{0: [1, 2], 1: [3, 10]}", r"client 1 holds index 10, outside the train set: indices must be 0 \.\. 9"),
    ("{0: [-1, 2], 1: [3]}", r"client 0 holds index -1, outside the train set"),
    ("{0: [1], 1: [2], 2: [3]}", r"holds 3 clients, but data.num_clients is 2"),
    ("{0: [1], 2: [3]}", r"ids 0 \.\. 1; missing 1"),
    ("{0: [1], 0: [3]}", r"client id 0 appears twice"),
    ("{0: [1], **x}", r"'\*\*' unpacking"),
    ('{"0": [1], "1": [2]}', r"a JSON file but not a fedrcl-split/1 split"),
    ("", r"cannot parse"),
]


@pytest.mark.parametrize("text, message", MALFORMED, ids=[m[1][:30] for m in MALFORMED])
def test_malformed_authors_files_are_rejected_naming_the_file(tmp_path, text, message):
    path = tmp_path / "clients.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        read_split(path, num_clients=2, num_samples=10)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("payload", [
    "__import__('pathlib').Path({marker!r}).touch()",
    "[__import__('pathlib').Path({marker!r}).touch()]",
    "(lambda: __import__('pathlib').Path({marker!r}).touch())()",
])
def test_code_in_a_split_file_never_runs(tmp_path, payload):
    marker = tmp_path / "ran"
    code = payload.format(marker=str(marker))
    for text in (f"{{0: [1], 1: {code}}}", f"{{0: [1, {code}], 1: [2]}}", f"{{{code}: [1], 1: [2]}}", code):
        path = tmp_path / "clients.txt"
        path.write_text(text)
        with pytest.raises(ValueError, match=str(path)):
            read_split(path, num_clients=2, num_samples=10)
    assert not marker.exists()
    eval(code)  # the payload is live: evaluated, it leaves the marker the reader must never leave
    assert marker.exists()


@pytest.mark.parametrize("change, message", [
    ({"format": "fedrcl-split/2"}, r"not a fedrcl-split/1 split"),
    ({"dataset": "cifar100"}, r"a split of 'cifar100', but data.dataset is 'cifar10'"),
    ({"num_clients": 3}, r'"num_clients" is 3 but "clients" holds 2 lists'),
    ({"clients": [[0, 1], [2, 2.5]]}, r'"clients"\[1\] must be a list of integers'),
    ({"clients": [[0, 1], [2, True]]}, r'"clients"\[1\] must be a list of integers'),
    ({"clients": [[0, 1], [1, 2]]}, r"index 1 is held by clients 0 and 1"),
    ({"clients": [[0, 1], [2, 99]]}, r"client 1 holds index 99"),
    ({"seed": 0}, r"unknown seed"),
])
def test_malformed_json_splits_are_rejected(tmp_path, change, message):
    doc = {"format": SPLIT_FORMAT, "dataset": "cifar10", "num_clients": 2, "clients": [[0, 1], [2, 3]]}
    doc.update(change)
    path = tmp_path / "split.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        read_split(path, num_clients=2, num_samples=10, dataset="cifar10")


def test_a_split_that_cannot_be_written_names_the_file(tmp_path, monkeypatch):
    """A full disk at a run's start: ``split.json`` is its first file; the error named no file."""
    import errno
    import os

    from fedrcl.errors import disk_error

    real_fdopen = os.fdopen

    class Full:
        def __init__(self, handle):
            self.file = real_fdopen(handle, "w")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda handle, mode: Full(handle))
    path = tmp_path / "run" / "split.json"
    with pytest.raises(OSError) as info:
        write_split(path, [np.array([0, 1])], "digits")
    assert str(info.value) == f"[Errno 28] {path} not written (No space left on device)"
    assert disk_error(info.value) is info.value  # fedrcl's one line, from its own raise
    assert not list(path.parent.iterdir())  # no temporary file left


def test_missing_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match=re.escape(f"data.partition_file: {missing} does not exist")):
        read_split(tmp_path / "nope.txt")


def test_datamodule_checks_the_file_against_its_settings(tmp_path, data_root):
    path = tmp_path / "dirichlet0.05_clients3.txt"
    path.write_text(authors_text({0: [0, 1], 1: [2, 3], 2: [4, 5]}))
    common = dict(dataset="digits", root=str(data_root), num_clients=3, batch_size=2)
    with pytest.raises(ValueError, match=r"alpha 0\.05; set data.partition dirichlet and data.alpha 0\.05"):
        FederatedDataModule(**common, alpha=0.3, partition_file=str(path))
    with pytest.raises(ValueError, match=r"holds 3 clients, but data.num_clients is 4"):
        FederatedDataModule(**{**common, "num_clients": 4}, alpha=0.05, partition_file=str(path))
    dm = FederatedDataModule(**common, alpha=0.05, partition_file=str(path))
    dm.setup("fit")  # no trainer: nothing is written
    assert [p.tolist() for p in dm.client_indices] == [[0, 1], [2, 3], [4, 5]]
    # indices are checked against the train set when the data is loaded (digits: 1437 training images)
    path.write_text(authors_text({0: [0, 1], 1: [2, 3], 2: [4, 1437]}))
    dm = FederatedDataModule(**common, alpha=0.05, partition_file=str(path))
    with pytest.raises(ValueError, match=r"data.partition_file .*client 2 holds index 1437.*1437 samples"):
        dm.setup("fit")


@pytest.mark.slow
def test_every_run_writes_its_split_and_a_run_can_train_on_it(tmp_path, data_root):
    first = run_cli(data_root, tmp_path / "runs", rounds=1, model="fedrcl.algorithms.FedAvg")
    log_dir = first.trainer.log_dir
    written = read_split(f"{log_dir}/split.json", num_clients=10, dataset="digits")
    assert [p.tolist() for p in written] == [p.tolist() for p in first.datamodule.client_indices]
    assert Path(log_dir) == tmp_path / "runs" / "quickstart" / "version_0"
    assert (Path(log_dir) / "config.yaml").exists()  # split.json lies beside the run's config

    # with data.seed 7 the computed split differs; with the file, the run trains on the file's split
    seed7 = FederatedDataModule(dataset="digits", root=str(data_root), num_clients=10, seed=7)
    assert any(not np.array_equal(a, b.cpu().numpy())
               for a, b in zip(seed7.split(first.datamodule.y_train.cpu()), first.datamodule.client_indices))
    second = run_cli(data_root, tmp_path / "runs", "--data.seed", "7",
                     "--data.partition_file", f"{log_dir}/split.json",
                     rounds=1, model="fedrcl.algorithms.FedAvg")
    for a, b in zip(first.datamodule.client_indices, second.datamodule.client_indices):
        assert torch.equal(a, b)
    assert (tmp_path / "runs" / "quickstart" / "version_1" / "split.json").read_text() == \
        (tmp_path / "runs" / "quickstart" / "version_0" / "split.json").read_text()


COMMITTED_SPLIT = REPO / "docs" / "splits" / "cifar10_a01_seed0.json"
DIGITS_SPLIT = REPO / "docs" / "splits" / "digits_iid20_seed0.json"  # docs/data_runs' one split
DP_SPLIT = REPO / "docs" / "splits" / "digits_dirichlet03_479_seed0.json"  # docs/privacy_runs' one split
SHARED_LABELS = REPO.parent / "shared" / "data" / "cifar10_jpeg" / "labels.npz"


def test_committed_runs_all_trained_on_the_one_committed_split():
    """docs/splits/README.md: the runs under docs/ keep no split.json of their own; each saved config.yaml has
    the data keys of the one committed split (CIFAR-10, 100 clients, balanced Dirichlet 0.1, data.seed 0)."""
    docs = REPO / "docs"
    assert not list(docs.rglob("split.json"))
    data_runs = sorted((docs / "data_runs").rglob("config.yaml"))  # the digits' domain-skew runs: their own split
    privacy_runs = sorted((docs / "privacy_runs").rglob("config.yaml"))  # the digits' DP runs: theirs
    tuning_runs = sorted((docs / "tuning_runs").rglob("config.yaml"))  # docs/tuning.md's quickstart sweep
    unbalanced_runs = sorted((docs / "unbalanced_runs").rglob("config.yaml"))  # FedNova's setting: its own split
    configs = [p for p in sorted(docs.rglob("config.yaml"))
               if p not in data_runs and p not in privacy_runs and p not in tuning_runs and p not in unbalanced_runs]
    for path in unbalanced_runs:  # configs/cpu/cifar10_unbalanced_cnn.yaml's split, data.seed 0
        data = yaml.safe_load(path.read_text())["data"]
        keys = data["dataset"], data["num_clients"], data["partition"], data["alpha"], data["seed"]
        assert keys == ("cifar10", 16, "dirichlet_unbalanced", 0.1, 0), path
    for path in tuning_runs:  # the quickstart's own split (digits, 20 clients, Dirichlet 0.3), 10% held out
        data = yaml.safe_load(path.read_text())["data"]
        keys = data["dataset"], data["num_clients"], data["partition"], data["alpha"], data["seed"]
        assert keys == ("digits", 20, "dirichlet", 0.3, 0) and data["val_fraction"] == 0.1, path
    assert len(privacy_runs) == 24
    for path in privacy_runs:
        data = yaml.safe_load(path.read_text())["data"]
        keys = data["dataset"], data["num_clients"], data["partition"], data["alpha"], data["seed"]
        assert keys == ("digits", 479, "dirichlet", 0.3, 0), path
    dp = read_split(DP_SPLIT, num_clients=479, dataset="digits", num_samples=1437)
    assert {len(p) for p in dp} == {1437 // 479}  # balanced
    assert len(configs) >= 30  # the run folders of docs/cpu_runs, seed_runs and gpu_runs
    for path in data_runs:
        data = yaml.safe_load(path.read_text())["data"]
        keys = data["dataset"], data["num_clients"], data["partition"], data["seed"]
        assert keys == ("digits", 20, "iid", 0), path
    digits = read_split(DIGITS_SPLIT, num_clients=20, dataset="digits", num_samples=1437)
    held = np.concatenate(digits)
    assert {len(p) for p in digits} == {71} and len(set(held.tolist())) == 1420 == len(held)  # iid: 1437 // 20 each
    for path in configs:
        data = yaml.safe_load(path.read_text())["data"]
        keys = data["dataset"], data["num_clients"], data["partition"], data["alpha"], data["seed"]
        assert keys == ("cifar10", 100, "dirichlet", 0.1, 0) and data.get("partition_file") is None, path
    parts = read_split(COMMITTED_SPLIT, num_clients=100, dataset="cifar10", num_samples=50_000)
    assert sum(len(p) for p in parts) == 50_000 and {len(p) for p in parts} == {500}


@pytest.mark.skipif(not SHARED_LABELS.is_file(), reason="needs ../shared/data/cifar10_jpeg/labels.npz")
def test_committed_split_is_the_partition_of_cifar10_labels():
    """The committed file is what the partition computes from CIFAR-10's train labels, not a stale copy."""
    labels = np.load(SHARED_LABELS)["y_train"]
    split = read_split_file(COMMITTED_SPLIT, num_clients=100, dataset="cifar10")
    expected = dirichlet_partition(labels, 100, 0.1, seed=0, balanced=True)
    assert all(np.array_equal(a, b) for a, b in zip(split.parts, expected, strict=True))
    assert split.labels == label_fingerprint(labels, expected, 10)  # it knows the labels it was made for
    # in another order (as torchvision's CIFAR-10 is to this class-sorted copy) every client's labels differ
    shuffled = labels[np.random.default_rng(0).permutation(len(labels))]
    assert split.labels is not None
    assert "but 100 of 100 clients hold other labels" in str(labels_differ(split.labels,
                                                                          label_fingerprint(shuffled, split.parts, 10)))


# -- the labels a split was made for ------------------------------------------------------------------------
def test_a_split_records_the_labels_it_was_made_for(tmp_path):
    labels = np.array([0, 1, 1, 2, 0, 2])
    parts = [np.array([0, 3]), np.array([1, 2, 4, 5])]
    made_for = label_fingerprint(labels, parts, 3)
    path = write_split(tmp_path / "split.json", parts, "digits", made_for)
    doc = json.loads(path.read_text())
    assert doc["labels"]["num_samples"] == 6 and doc["labels"]["num_classes"] == 3
    assert doc["labels"]["sha256"] == hashlib.sha256(labels.astype("<i8").tobytes()).hexdigest()
    assert doc["labels"]["clients_sha256"] == [hashlib.sha256(np.array([0, 2], "<i8").tobytes()).hexdigest()[:16],
                                               hashlib.sha256(np.array([1, 1, 0, 2], "<i8").tobytes()).hexdigest()[:16]]
    assert read_split_file(path, 2, 6, "digits").labels == made_for
    assert labels_differ(made_for, label_fingerprint(labels, parts, 3)) is None
    assert labels_differ(made_for, label_fingerprint(labels[:5], [[0, 3], [1, 2, 4]], 3)) == \
        "made for 6 train samples, this data has 5"
    assert labels_differ(made_for, label_fingerprint(labels, parts, 4)) == "made for 3 classes, this data has 4"
    across = labels[[1, 0, 2, 3, 4, 5]]  # samples 0 (client 0) and 1 (client 1) trade labels
    assert "but 2 of 2 clients hold other labels" in str(labels_differ(made_for, label_fingerprint(across, parts, 3)))
    within = labels[[0, 1, 2, 3, 5, 4]]  # two of client 1's samples trade labels: its labels in order differ
    assert "but 1 of 2 clients hold other labels" in str(labels_differ(made_for, label_fingerprint(within, parts, 3)))
    held = [np.array([0, 3]), np.array([1, 2, 4])]  # sample 5 belongs to no client
    outside = labels.copy()
    outside[5] = 0
    assert labels_differ(label_fingerprint(labels, held, 3), label_fingerprint(outside, held, 3)) == \
        ("labels differ from those the split was made for: 6 samples in both, the clients' labels alike, other "
         "labels outside the split's indices")


@pytest.mark.parametrize("labels, message", [
    ({"num_samples": 10}, r'"labels" must be \{"num_samples": int'),
    ({"num_samples": 10, "num_classes": 2, "sha256": "x", "clients_sha256": ["a"]}, r"one per client \(2\)"),
    ([1, 2], r'"labels" must be'),
])
def test_a_malformed_labels_record_is_refused(tmp_path, labels, message):
    doc = {"format": SPLIT_FORMAT, "dataset": "cifar10", "num_clients": 2, "clients": [[0, 1], [2, 3]],
           "labels": labels}
    path = tmp_path / "split.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        read_split(path, num_clients=2)


def permuted_digits(data_root: Path, root: Path, seed: int = 1) -> Path:
    """The digits data in another order: the same images and the same labels (as a multiset), reordered."""
    data = dict(np.load(data_root / "digits.npz"))
    order = np.random.default_rng(seed).permutation(len(data["y_train"]))
    data["x_train"], data["y_train"] = data["x_train"][order], data["y_train"][order]
    root.mkdir(parents=True, exist_ok=True)
    np.savez(root / "digits.npz", **data)
    return root


def test_a_split_on_the_same_data_in_another_order_is_refused(data_root, tmp_path):
    """The split's indices on permuted data would give every client other samples, silently: refused before
    training, naming the file and what differs."""
    made = FederatedDataModule(dataset="digits", root=str(data_root), num_clients=10, alpha=0.1)
    made.setup("fit")
    parts = [p.numpy() for p in made.client_indices]
    path = write_split(tmp_path / "split.json", parts, "digits", label_fingerprint(made.y_train, parts, 10))
    common = dict(dataset="digits", num_clients=10, partition_file=str(path))
    same = FederatedDataModule(root=str(data_root), **common)
    same.setup("fit")
    assert all(torch.equal(a, b) for a, b in zip(same.client_indices, made.client_indices))
    other = FederatedDataModule(root=str(permuted_digits(data_root, tmp_path / "permuted")), **common)
    with pytest.raises(ValueError) as info:
        other.setup("fit")
    message = str(info.value)
    assert message.startswith(f"data.partition_file {path}: labels differ from those the split was made for: "
                              "1437 samples and 10 classes in both, but ")
    assert "of 10 clients hold other labels at the split's indices" in message, message


def test_a_split_file_without_labels_is_used_with_a_notice(data_root, tmp_path, caplog):
    path = write_split(tmp_path / "split.json", [np.arange(k, 1437, 3) for k in range(3)], "digits")
    dm = FederatedDataModule(dataset="digits", root=str(data_root), num_clients=3, partition_file=str(path))
    with caplog.at_level("INFO"):
        dm.setup("fit")
    notices = [r.getMessage() for r in caplog.records if "records no labels" in r.getMessage()]
    assert notices == [f"data.partition_file {path} records no labels it was made for (written before fedrcl "
                       "recorded them, or the authors' format): it cannot be checked against this data's order"]
