"""Your own data with no code (npz, image folder, multi-domain folder, LEAF JSON), made tiny by the tests: each
trains 2 rounds through ``fedrcl fit``, resumes bitwise, and ``fedrcl report`` reads the runs; every bad file is
one line naming it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_same_state, run_cli
from fedrcl.analysis.runs import load_scalars
from fedrcl.cli import main
from fedrcl.data.datamodule import FederatedDataModule
from fedrcl.data.sources import read_own_data

FEDAVG = "fedrcl.algorithms.FedAvg"
TINY = ("--data.batch_size", "6", "--data.eval_batch_size", "16")


def class_images(n_per_class: int, classes: int = 3, size: int = 8, channels: int = 3, seed: int = 0):
    """Images whose brightness says the class (learnable in a few steps), labels 0..classes-1."""
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(classes), n_per_class)
    x = rng.integers(0, 50, (len(y), size, size, channels)) + (y * 80)[:, None, None, None]
    return x.astype(np.uint8), y


@pytest.fixture(scope="module")
def npz_file(tmp_path_factory) -> Path:
    x, y = class_images(40)
    xt, yt = class_images(8, seed=1)
    path = tmp_path_factory.mktemp("npz") / "three.npz"
    np.savez(path, x_train=x, y_train=y, x_test=xt, y_test=yt, classes=np.array(["dark", "grey", "light"]))
    return path


def write_pngs(folder: Path, x: np.ndarray, y: np.ndarray, classes: list[str]) -> None:
    from PIL import Image

    for i, (image, label) in enumerate(zip(x, y)):
        (folder / classes[label]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / classes[label] / f"{i}.png")


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("folder")
    x, y = class_images(30, size=12)
    write_pngs(root / "train", x, y, ["cat", "dog", "owl"])
    xt, yt = class_images(6, size=12, seed=1)
    write_pngs(root / "test", xt, yt, ["cat", "dog", "owl"])
    return root


@pytest.fixture(scope="module")
def domain_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("domains")
    for d, (name, invert) in enumerate((("photo", False), ("sketch", True))):
        x, y = class_images(30, seed=d)
        write_pngs(root / name, 255 - x if invert else x, y, ["a", "b", "c"])
    return root


@pytest.fixture(scope="module")
def leaf_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("leaf")
    rng = np.random.default_rng(0)
    for part, n in (("train", 12), ("test", 4)):
        users = [f"f{i:04d}" for i in range(5)]
        user_data = {}
        for i, u in enumerate(users):
            y = rng.integers(0, 3, n + i)
            x = rng.random((len(y), 64)) * 0.3 + (y[:, None] * 0.3)
            user_data[u] = {"x": x.tolist(), "y": y.tolist()}
        (root / part).mkdir()
        (root / part / "all_data_0.json").write_text(json.dumps(
            {"users": users, "num_samples": [len(v["y"]) for v in user_data.values()], "user_data": user_data}))
    return root


def fit_resume_report(data_args: tuple[str, ...], tmp_path: Path, capsys) -> dict:
    """Fit 2 rounds; fit 1 and resume to 2 (bitwise the same weights); ``fedrcl report`` lists the run."""
    args = (*data_args, *TINY, "--data.num_clients", "4", "--trainer.clients_per_round", "2")
    full = run_cli(Path("unused"), tmp_path / "full", *args, model=FEDAVG, rounds=2)
    run_cli(Path("unused"), tmp_path / "split", *args, model=FEDAVG, rounds=1)
    resumed = run_cli(Path("unused"), tmp_path / "split", *args, "--ckpt_path", "last", model=FEDAVG, rounds=2)
    a = torch.load(Path(full.trainer.logger.log_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(Path(resumed.trainer.logger.log_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    assert_same_state(a["state_dict"], b["state_dict"])
    capsys.readouterr()
    main(["report", str(tmp_path / "full")])
    out = capsys.readouterr().out
    assert "version_0" in out and data_args[1] in out, out
    return load_scalars(full.trainer.logger.log_dir)


def test_npz_trains_resumes_and_is_reported(npz_file, tmp_path, capsys):
    curves = fit_resume_report(("--data.dataset", "npz", "--data.root", str(npz_file)), tmp_path, capsys)
    assert list(curves["val/acc"][0]) == [1, 2]


def test_the_model_takes_classes_channels_and_size_from_the_data(image_folder, npz_file, tmp_path):
    cli = run_cli(Path("unused"), tmp_path, "--data.dataset", "imagefolder", "--data.root", str(image_folder),
                  "--data.image_size", "8", *TINY, "--data.num_clients", "4", model=FEDAVG, rounds=1)
    assert cli.model.backbone.fc.out_features == 3 and cli.model.backbone.conv1.in_channels == 3
    assert cli.datamodule.x_train.shape[1:] == (8, 8, 3)  # 12 px PNGs resized once at load
    assert cli.datamodule.classes == ["cat", "dog", "owl"]


def test_image_folder_trains_resumes_and_is_reported(image_folder, tmp_path, capsys):
    fit_resume_report(("--data.dataset", "imagefolder", "--data.root", str(image_folder)), tmp_path, capsys)


def test_two_domain_folder_logs_accuracy_per_domain(domain_folder, tmp_path, capsys):
    curves = fit_resume_report(("--data.dataset", "domainfolder", "--data.root", str(domain_folder)),
                               tmp_path, capsys)
    for tag in ("val/acc/photo", "val/acc/sketch"):
        assert list(curves[tag][0]) == [1, 2], tag
    # the union's accuracy is the per-domain accuracies weighted by their test sizes (equal here: 6 and 6 x 3)
    union = (curves["val/acc/photo"][1] + curves["val/acc/sketch"][1]) / 2
    np.testing.assert_allclose(curves["val/acc"][1], union, atol=1e-6)
    main(["report", str(tmp_path / "full"), "--tags", "val/acc/photo", "val/acc/sketch"])
    out = capsys.readouterr().out
    assert "val/acc/sketch mean" in out
    assert f"{100 * curves['val/acc/sketch'][1][-1]:.2f} @2" in out  # per-domain accuracies in %, as val/acc


def test_domain_split_one_gives_each_client_one_domain(domain_folder):
    data = read_own_data("domainfolder", domain_folder)
    assert data.domains == ["photo", "sketch"] and len(data.y_test) == 2 * 3 * 6  # 20% of each class and domain
    dm = FederatedDataModule("domainfolder", str(domain_folder), num_clients=4, batch_size=4, partition="iid")
    dm.setup("validate")
    domain_train = read_own_data("domainfolder", domain_folder).domain_train
    assert domain_train is not None
    for k, part in enumerate(dm.client_indices):
        assert set(domain_train[part].tolist()) == {int(dm.client_domain[k])}
    assert sorted(dm.client_domain.tolist()) == [0, 0, 1, 1]
    mixed = FederatedDataModule("domainfolder", str(domain_folder), num_clients=4, batch_size=4,
                                domain_split="dirichlet", domain_alpha=100.0)
    mixed.setup("validate")
    assert all(len(set(domain_train[p].tolist())) == 2 for p in mixed.client_indices)  # alpha 100: both domains


def test_leaf_json_gives_a_client_per_user(leaf_folder, tmp_path, capsys):
    dm = FederatedDataModule("leaf", str(leaf_folder), num_clients=3, batch_size=4, partition="natural")
    dm.setup("validate")
    # the 3 users with the most training samples (12 + i for user i): users 4, 3, 2, with their own test parts
    assert [len(p) for p in dm.client_indices] == [16, 15, 14]
    assert len(dm.y_test) == 8 + 7 + 6
    assert dm.x_train.shape[1:] == (8, 8, 1)
    fit_resume_report(("--data.dataset", "leaf", "--data.root", str(leaf_folder), "--data.partition", "natural",
                       "--data.hflip", "false"), tmp_path, capsys)


def test_natural_partition_refuses_more_clients_than_users(leaf_folder):
    dm = FederatedDataModule("leaf", str(leaf_folder), num_clients=9, batch_size=4, partition="natural")
    with pytest.raises(ValueError, match=r"^data.num_clients 9 is more than the data's 5 natural clients"):
        dm.setup("validate")


def bad_npz(tmp_path: Path, **change) -> Path:
    x, y = class_images(10)
    arrays = dict(x_train=x, y_train=y, x_test=x[:6], y_test=y[:6])
    arrays.update(change)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("change, message", [
    ({"x_train": np.zeros((30, 8), np.uint8)}, r"array 'x_train' has shape \(30, 8\), expected \[N, H, W, C\]"),
    ({"y_train": np.full(30, 7), "classes": np.array(["a", "b", "c"])}, r"'y_train' has labels up to 7, expected values in \[0, 3\)"),
    ({"y_test": np.arange(5)}, r"array 'y_test' has length 5, expected 6"),
    ({"x_test": np.zeros((6, 4, 4, 3), np.uint8)}, r"'x_train' has images of shape \(8, 8, 3\), 'x_test' \(4, 4, 3\)"),
    ({"x_train": np.full((30, 8, 8, 3), 2.0)}, r"float with values in \[2, 2\].*expected \[0, 1\]"),
    ({"y_test": None}, r"missing array 'y_test'"),
    ({"classes": np.array(["a", "b", "c", "d"])}, r"class 'd' has no training sample"),
])
def test_a_bad_npz_is_one_line_naming_the_array(tmp_path, change, message):
    path = bad_npz(tmp_path, **change)
    with pytest.raises(ValueError, match=message) as info:
        read_own_data("npz", path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_a_bad_image_folder_is_one_line_naming_the_file(image_folder, tmp_path):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(image_folder, root)
    (root / "train" / "dog" / "0broken.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"0broken.png: not a readable image") as info:
        read_own_data("imagefolder", root)
    assert "\n" not in str(info.value)
    (root / "train" / "dog" / "0broken.png").unlink()
    (root / "train" / "eel").mkdir()
    with pytest.raises(ValueError, match=r"train/eel: an empty class"):
        read_own_data("imagefolder", root)
    (root / "train" / "eel").rmdir()
    from PIL import Image

    Image.new("RGB", (5, 7)).save(root / "train" / "dog" / "odd.png")
    with pytest.raises(ValueError, match=r"odd.png: image of size 5x7, but .* is 12x12; set data.image_size"):
        read_own_data("imagefolder", root)
    assert read_own_data("imagefolder", root, image_size=6).x_train.shape[1:] == (6, 6, 3)


def test_a_bad_file_stops_fedrcl_fit_in_one_line_before_training(tmp_path, capsys):
    path = bad_npz(tmp_path, y_train=np.full(30, 7), classes=np.array(["a", "b", "c"]))
    with pytest.raises(SystemExit):
        main(["fit", "--config", "configs/quickstart.yaml", "--data.dataset", "npz", "--data.root", str(path),
              "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert any("'y_train' has labels up to 7" in line for line in err), err
    assert not (tmp_path / "runs").exists()


def test_bad_leaf_files_are_one_line_naming_the_file(leaf_folder, tmp_path):
    import shutil

    root = tmp_path / "leaf"
    shutil.copytree(leaf_folder, root)
    (root / "test" / "all_data_0.json").write_text('{"users": ["f0000"], "user_data": {"f0000": {"x": [[0.5]]}}}')
    with pytest.raises(ValueError, match=r"all_data_0.json: user 'f0000' has no 'x' and 'y'") as info:
        read_own_data("leaf", root)
    assert "\n" not in str(info.value)
    (root / "test" / "all_data_0.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"test/all_data_0.json: not readable as JSON"):
        read_own_data("leaf", root)


def test_an_npz_gives_natural_clients_and_domains_by_its_arrays(tmp_path):
    x, y = class_images(20)
    clients = np.arange(len(y)) % 4
    path = tmp_path / "both.npz"
    np.savez(path, x_train=x, y_train=y, x_test=x[::5], y_test=y[::5], client_train=clients,
             domain_train=(np.arange(len(y)) % 2), domain_test=(np.arange(12) % 2), domains=np.array(["a", "b"]))
    dm = FederatedDataModule("npz", str(path), num_clients=4, batch_size=4, partition="natural")
    dm.setup("validate")
    assert [sorted(set(clients[p.numpy()].tolist())) for p in dm.client_indices] == [[0], [1], [2], [3]]
    assert dm.domains == ["a", "b"] and [d for d, _, _ in dm._test_ranges] == [0, 1]
    bad = tmp_path / "bad.npz"
    np.savez(bad, x_train=x, y_train=y, x_test=x[::5], y_test=y[::5], domain_train=np.zeros(len(y), int))
    with pytest.raises(ValueError, match=r"domains need all three arrays"):
        read_own_data("npz", bad)
