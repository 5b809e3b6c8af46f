import dataclasses
import re

import numpy as np
import pytest
import torch
from PIL import Image

from fedrcl.data.datasets import DATASETS, DatasetInfo, ImageData, dataset_info, load_dataset


def test_registry():
    assert sorted(DATASETS) == ["cifar10", "cifar100", "digits", "tinyimagenet"]
    for name, info in DATASETS.items():
        assert info.name == name
        assert len(info.mean) == len(info.std) == info.in_channels
    assert dataset_info("cifar100").num_classes == 100
    assert dataset_info("tinyimagenet").image_size == 64
    assert dataset_info("digits").hflip is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        dataset_info("cifar10").num_classes = 3  # type: ignore[misc]


def test_unknown_name():
    allowed = "allowed: cifar10, cifar100, digits, tinyimagenet"
    with pytest.raises(ValueError, match=rf"unknown dataset 'mnist'; {allowed}"):
        dataset_info("mnist")
    with pytest.raises(ValueError, match="allowed"):
        load_dataset("mnist", "/nonexistent")


def test_digits_build_and_cache(tmp_path):
    root = tmp_path / "sub" / "data"  # created on demand
    d = load_dataset("digits", root)
    assert isinstance(d, ImageData)
    assert (root / "digits.npz").is_file()
    assert not [p for p in root.iterdir() if p.name != "digits.npz"], "temp file left behind"
    assert d.x_train.dtype == torch.uint8 and d.x_test.dtype == torch.uint8
    assert d.y_train.dtype == torch.int64 and d.y_test.dtype == torch.int64
    assert tuple(d.x_train.shape) == (1437, 8, 8, 1)
    assert tuple(d.x_test.shape) == (360, 8, 8, 1)
    assert d.y_train.shape == (1437,) and d.y_test.shape == (360,)
    assert d.classes == [str(i) for i in range(10)]
    assert int(d.x_train.max()) == 255 and int(d.x_train.min()) == 0
    assert torch.bincount(d.y_test, minlength=10).min() >= 34  # stratified
    # the registered normalisation constants match the training split
    x = d.x_train.double() / 255
    info = dataset_info("digits")
    assert abs(x.mean().item() - info.mean[0]) < 1e-4
    assert abs(x.std(unbiased=False).item() - info.std[0]) < 1e-4

    again = load_dataset("digits", str(root))
    for f in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(d, f), getattr(again, f))
    assert again.classes == d.classes


def _write_good_digits(tmp_path):
    d = load_dataset("digits", tmp_path)
    return {
        "x_train": d.x_train.numpy(),
        "y_train": d.y_train.numpy(),
        "x_test": d.x_test.numpy(),
        "y_test": d.y_test.numpy(),
        "classes": np.asarray(d.classes),
    }


@pytest.mark.parametrize(
    "mutate, array, fragment",
    [
        (lambda a: a.pop("y_test"), "y_test", "missing"),
        (lambda a: a.pop("classes"), "classes", "missing"),
        (lambda a: a.__setitem__("x_train", a["x_train"].astype(np.float32)), "x_train", "uint8"),
        (lambda a: a.__setitem__("y_train", a["y_train"].astype(np.int32)), "y_train", "int64"),
        (lambda a: a.__setitem__("x_test", a["x_test"][..., 0]), "x_test", "4-D"),
        (lambda a: a.__setitem__("x_train", np.zeros((5, 16, 16, 1), np.uint8)), "x_train", r"\(8, 8, 1\)"),
        (lambda a: a.__setitem__("x_test", np.repeat(a["x_test"], 3, axis=3)), "x_test", r"\(8, 8, 1\)"),
        (lambda a: a.__setitem__("y_test", a["y_test"][:-1]), "y_test", "length"),
        (lambda a: a.__setitem__("y_train", a["y_train"] + 5), "y_train", r"\[0, 10\)"),
        (lambda a: a.__setitem__("classes", a["classes"][:3]), "classes", "expected 10"),
    ],
)
def test_bad_cache_rejected(tmp_path, mutate, array, fragment):
    arrays = _write_good_digits(tmp_path)
    mutate(arrays)
    path = tmp_path / "digits.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError) as e:
        load_dataset("digits", tmp_path)
    msg = str(e.value)
    assert str(path) in msg
    assert f"'{array}'" in msg
    assert re.search(fragment, msg), msg


def test_corrupt_cache_rejected(tmp_path):
    (tmp_path / "digits.npz").write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match="digits.npz"):
        load_dataset("digits", tmp_path)


def test_cifar_missing_without_download(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_dataset("cifar10", tmp_path, download=False)
    msg = str(e.value)
    assert "--data.download true" in msg and "cifar-10-python.tar.gz" in msg
    assert str(tmp_path) in msg
    assert str(tmp_path / "cifar10.npz") in msg
    assert not (tmp_path / "cifar10.npz").exists()


def test_tinyimagenet_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="tiny-imagenet-200"):
        load_dataset("tinyimagenet", tmp_path)


def _jpeg(path, color):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 64), color).save(path, quality=95)


def test_tinyimagenet_fake_folder(tmp_path):
    base = tmp_path / "tiny-imagenet-200"
    base.mkdir()
    # 200 wnids in non-sorted order; images only for two of them.
    wnids = [f"n{i:08d}" for i in range(200)]
    (base / "wnids.txt").write_text("\n".join(reversed(wnids)) + "\n")
    a, b = wnids[7], wnids[150]
    for i in range(3):
        _jpeg(base / "train" / a / "images" / f"{a}_{i}.JPEG", (250, 0, 0))
        _jpeg(base / "train" / b / "images" / f"{b}_{i}.JPEG", (0, 0, 250))
    (base / "train" / a / f"{a}_boxes.txt").write_text("")
    _jpeg(base / "val" / "images" / "val_0.JPEG", (0, 0, 250))
    _jpeg(base / "val" / "images" / "val_1.JPEG", (250, 0, 0))
    (base / "val" / "val_annotations.txt").write_text(
        f"val_0.JPEG\t{b}\t0\t0\t10\t10\nval_1.JPEG\t{a}\t1\t2\t3\t4\n"
    )

    d = load_dataset("tinyimagenet", tmp_path)
    assert d.classes == wnids
    assert tuple(d.x_train.shape) == (6, 64, 64, 3) and d.x_train.dtype == torch.uint8
    assert d.y_train.tolist() == [7, 7, 7, 150, 150, 150]
    assert d.y_test.tolist() == [150, 7]
    red = d.x_train[:3].float().mean(dim=(0, 1, 2))
    assert red[0] > 200 and red[2] < 50
    blue = d.x_test[0].float().mean(dim=(0, 1))
    assert blue[2] > 200 and blue[0] < 50
    assert (tmp_path / "tinyimagenet.npz").is_file()

    again = load_dataset("tinyimagenet", tmp_path)
    assert torch.equal(again.x_test, d.x_test) and again.classes == wnids


def test_datasetinfo_is_plain_dataclass():
    info = dataclasses.replace(dataset_info("cifar10"), rotation=0.0)
    assert isinstance(info, DatasetInfo) and info.rotation == 0.0
