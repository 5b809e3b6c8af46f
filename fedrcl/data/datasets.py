"""Image data sets read once into uint8 arrays and cached as ``<root>/<name>.npz``.

Everything downstream (partitioning, per-client loaders, on-device augmentation)
works on the whole data set held as tensors, so each data set is decoded once
and stored as four arrays plus the class names:

``x_train`` / ``x_test``  uint8 ``[N, H, W, C]``
``y_train`` / ``y_test``  int64 ``[N]``
``classes``               str ``[num_classes]``
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import Tensor

__all__ = ["DatasetInfo", "DATASETS", "dataset_info", "ImageData", "load_dataset", "DataUnavailableError",
           "TINYIMAGENET_URL"]

TINYIMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"


class DataUnavailableError(FileNotFoundError):
    """The data set is neither in ``root`` nor could be fetched; the message says what to do by hand."""


@dataclass(frozen=True)
class DatasetInfo:
    """Static facts about a data set, used by models and augmentation."""

    name: str
    num_classes: int
    in_channels: int
    image_size: int
    mean: tuple
    std: tuple
    crop_padding: int
    hflip: bool
    rotation: float


DATASETS: dict[str, DatasetInfo] = {
    "cifar10": DatasetInfo(
        name="cifar10", num_classes=10, in_channels=3, image_size=32,
        mean=(0.4914, 0.4822, 0.4465), std=(0.2023, 0.1994, 0.2010),
        crop_padding=4, hflip=True, rotation=10.0,
    ),
    "cifar100": DatasetInfo(
        name="cifar100", num_classes=100, in_channels=3, image_size=32,
        mean=(0.5071, 0.4867, 0.4408), std=(0.2675, 0.2565, 0.2761),
        crop_padding=4, hflip=True, rotation=10.0,
    ),
    "tinyimagenet": DatasetInfo(
        name="tinyimagenet", num_classes=200, in_channels=3, image_size=64,
        mean=(0.4802, 0.4481, 0.3975), std=(0.2770, 0.2691, 0.2821),
        crop_padding=8, hflip=True, rotation=10.0,
    ),
    # scikit-learn's bundled 8x8 digits; mean/std of the training split
    # (80/20 stratified, random_state=0) after scaling to [0, 1].
    "digits": DatasetInfo(
        name="digits", num_classes=10, in_channels=1, image_size=8,
        mean=(0.3054,), std=(0.3760,),
        crop_padding=1, hflip=False, rotation=10.0,
    ),
}


def dataset_info(name: str) -> DatasetInfo:
    """The :class:`DatasetInfo` registered under ``name``."""
    try:
        return DATASETS[name]
    except (KeyError, TypeError):
        allowed = ", ".join(sorted(DATASETS))
        raise ValueError(f"unknown dataset {name!r}; allowed: {allowed}") from None


@dataclass
class ImageData:
    """A whole data set as CPU tensors (images uint8 NHWC, labels int64), with what a researcher's own data may
    add (``fedrcl.data.sources``): a domain id per sample and the domains' names (domain skew), a natural client
    id per sample (a writer, a LEAF user) and the clients' names."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    classes: list[str]
    domain_train: Optional[Tensor] = None
    domain_test: Optional[Tensor] = None
    domains: Optional[list[str]] = None
    client_train: Optional[Tensor] = None
    client_test: Optional[Tensor] = None
    client_names: Optional[list[str]] = None


_ARRAYS = ("x_train", "y_train", "x_test", "y_test", "classes")


def load_dataset(name: str, root: str | Path, download: bool = False) -> ImageData:
    """Load data set ``name`` from the cache ``<root>/<name>.npz``, building it if absent.

    The cache is validated on every load; a malformed file raises ``ValueError``
    naming the file and the offending array (delete it to rebuild).  Building:

    * ``cifar10`` / ``cifar100``: torchvision's data set under ``root``
      (downloaded there when ``download`` is true; an archive put in ``root``
      by hand is checked and unpacked, with no download).
    * ``tinyimagenet``: the standard ``<root>/tiny-imagenet-200`` folder
      (``TINYIMAGENET_URL`` unzipped); its ``val`` split is the test set.
      Never downloaded.
    * ``digits``: scikit-learn's bundled digits, split 80/20 (stratified,
      ``random_state=0``).

    Data neither found nor fetched raises :class:`DataUnavailableError`.
    """
    info = dataset_info(name)
    root = Path(root).expanduser()
    path = root / f"{name}.npz"
    if path.exists():
        arrays = _read_npz(path)
        _validate(arrays, info, str(path))
        return _to_image_data(arrays)

    if name in ("cifar10", "cifar100"):
        arrays = _build_cifar(name, root, path, download)
    elif name == "tinyimagenet":
        arrays = _build_tinyimagenet(root)
    elif name == "digits":
        arrays = _build_digits()
    else:  # pragma: no cover - DATASETS and the builders must agree
        raise AssertionError(f"no builder for {name!r}")
    _validate(arrays, info, f"data built for {name!r}")
    _save_npz(arrays, root, path)
    return _to_image_data(arrays)


# --------------------------------------------------------------------- cache


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    """The known arrays present in ``path``; a missing one is reported by :func:`_validate`."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return {key: z[key] for key in _ARRAYS if key in z.files}
    except Exception as e:  # BadZipFile, OSError, EOFError, object arrays without pickle, ...
        raise ValueError(f"{path}: cannot read cached data set ({e}); delete it to rebuild") from e


def _validate(a: dict[str, np.ndarray], info: DatasetInfo, where: str) -> None:
    s, c = info.image_size, info.in_channels

    def bad(key: str, msg: str) -> ValueError:
        return ValueError(f"{where}: array '{key}' {msg}")

    for key in _ARRAYS:
        if key not in a:
            raise ValueError(f"{where}: missing array '{key}' (expected {', '.join(_ARRAYS)})")
    for split in ("train", "test"):
        xk, yk = f"x_{split}", f"y_{split}"
        x, y = a[xk], a[yk]
        if x.dtype != np.uint8:
            raise bad(xk, f"has dtype {x.dtype}, expected uint8")
        if x.ndim != 4:
            raise bad(xk, f"has shape {x.shape}, expected 4-D [N, {s}, {s}, {c}]")
        if x.shape[1:] != (s, s, c):
            raise bad(xk, f"has images of shape {x.shape[1:]} (H, W, C), expected ({s}, {s}, {c})")
        if y.dtype != np.int64:
            raise bad(yk, f"has dtype {y.dtype}, expected int64")
        if y.ndim != 1:
            raise bad(yk, f"has shape {y.shape}, expected 1-D")
        if len(y) != len(x):
            raise bad(yk, f"has length {len(y)}, expected {len(x)} (the length of '{xk}')")
        if len(y) and (y.min() < 0 or y.max() >= info.num_classes):
            raise bad(
                yk, f"has labels in [{y.min()}, {y.max()}], expected values in [0, {info.num_classes})"
            )
    cl = a["classes"]
    if cl.ndim != 1 or cl.dtype.kind not in "US":
        raise bad("classes", f"has dtype {cl.dtype} and shape {cl.shape}, expected a 1-D array of str")
    if len(cl) != info.num_classes:
        raise bad("classes", f"has {len(cl)} entries, expected {info.num_classes}")


def _save_npz(arrays: dict[str, np.ndarray], root: Path, path: Path) -> None:
    """Write atomically: a temp file in the same folder, then ``os.replace``."""
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{path.stem}.", suffix=".npz.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stubs: a key could be allow_pickle
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _to_image_data(a: dict[str, np.ndarray]) -> ImageData:
    def t(key: str) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a[key]))

    return ImageData(
        x_train=t("x_train"),
        y_train=t("y_train"),
        x_test=t("x_test"),
        y_test=t("y_test"),
        classes=[str(c) for c in a["classes"].tolist()],
    )


# ------------------------------------------------------------------ builders


def _build_cifar(name: str, root: Path, path: Path, download: bool) -> dict[str, np.ndarray]:
    from torchvision import datasets as tvd

    cls = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100
    archive = root / cls.filename
    by_hand = (f"put {cls.filename} from that address in '{root}' by hand and run again (it is checked and "
               f"unpacked there, nothing is fetched), or give --data.root a folder holding a prepared "
               f"{path.name} (the file fedrcl writes on a first load, e.g. copied from a machine with internet)")
    out: dict[str, np.ndarray] = {}
    for split, train in (("train", True), ("test", False)):
        try:  # an archive put in root by hand: torchvision checks its md5 and unpacks it, fetching nothing
            ds = cls(root=str(root), train=train, download=download or archive.is_file())
        except (OSError, RuntimeError) as e:
            if not (download or archive.is_file()):
                raise DataUnavailableError(
                    f"{name} not found under '{root}' (no '{root / cls.base_folder}', no cache '{path}'): "
                    f"set --data.download true to fetch {cls.url} there, or {by_hand}") from None
            raise DataUnavailableError(
                f"could not get {name}: fetching {cls.url} into '{root}' failed ({type(e).__name__}: {e}). "
                f"Without internet: {by_hand}; --data.download false never tries the network") from None
        out[f"x_{split}"] = np.ascontiguousarray(ds.data, dtype=np.uint8)
        out[f"y_{split}"] = np.asarray(ds.targets, dtype=np.int64)
        out["classes"] = np.asarray(list(ds.classes), dtype=str)
    return out


def _read_rgb(path: Path, size: int) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
    if arr.shape != (size, size, 3):
        raise ValueError(f"{path}: image of shape {arr.shape}, expected ({size}, {size}, 3)")
    return arr


def _decode_all(files: list[Path], size: int) -> np.ndarray:
    x = np.empty((len(files), size, size, 3), dtype=np.uint8)
    workers = min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i, arr in enumerate(pool.map(lambda f: _read_rgb(f, size), files, chunksize=64)):
            x[i] = arr
    return x


def _build_tinyimagenet(root: Path) -> dict[str, np.ndarray]:
    base = root / "tiny-imagenet-200"
    if not base.is_dir():
        raise DataUnavailableError(
            f"Tiny ImageNet folder not found: '{base}' (expected wnids.txt, train/, val/ inside). It is not "
            f"downloaded automatically: fetch {TINYIMAGENET_URL} (about 240 MB) and unzip it in '{root}'"
        )
    wnids_file = base / "wnids.txt"
    if not wnids_file.is_file():
        raise FileNotFoundError(f"Tiny ImageNet class list not found: '{wnids_file}'")
    wnids = sorted({w.strip() for w in wnids_file.read_text().splitlines() if w.strip()})
    index = {w: i for i, w in enumerate(wnids)}
    size = DATASETS["tinyimagenet"].image_size

    train_files: list[Path] = []
    train_labels: list[int] = []
    for w in wnids:
        img_dir = base / "train" / w / "images"
        if not img_dir.is_dir():
            continue
        files = sorted(p for p in img_dir.iterdir() if p.suffix.lower() == ".jpeg")
        train_files += files
        train_labels += [index[w]] * len(files)
    if not train_files:
        raise FileNotFoundError(f"no training images found under '{base / 'train'}'")

    ann = base / "val" / "val_annotations.txt"
    if not ann.is_file():
        raise FileNotFoundError(f"Tiny ImageNet validation annotations not found: '{ann}'")
    val_files: list[Path] = []
    val_labels: list[int] = []
    for lineno, line in enumerate(ann.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise ValueError(f"{ann}:{lineno}: expected 'filename<TAB>wnid...' with a wnid from wnids.txt")
        val_files.append(base / "val" / "images" / fields[0])
        val_labels.append(index[fields[1]])

    return {
        "x_train": _decode_all(train_files, size),
        "y_train": np.asarray(train_labels, dtype=np.int64),
        "x_test": _decode_all(val_files, size),
        "y_test": np.asarray(val_labels, dtype=np.int64),
        "classes": np.asarray(wnids, dtype=str),
    }


def _build_digits() -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = np.round(d.images * 255.0 / 16.0).astype(np.uint8)[..., None]  # [N, 8, 8, 1]
    y = np.asarray(d.target, dtype=np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return {
        "x_train": np.ascontiguousarray(x_tr),
        "y_train": np.ascontiguousarray(y_tr),
        "x_test": np.ascontiguousarray(x_te),
        "y_test": np.ascontiguousarray(y_te),
        "classes": np.asarray([str(i) for i in range(10)], dtype=str),
    }
