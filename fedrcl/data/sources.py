"""A researcher's own data, read with no code: an ``.npz`` file, an image folder, a multi-domain image folder,
LEAF's JSON files.

Each reader returns :class:`~fedrcl.data.datasets.ImageData` (uint8 ``[N, H, W, C]`` images, int64 labels, class
names; for data with domains or natural clients also a domain or client id per sample), decoded once; every bad
file or array is named in one line (``ValueError``) before anything trains. Layouts:

- ``npz``: ``FILE`` with ``x_train``, ``y_train``, ``x_test``, ``y_test`` (uint8 or float in [0, 1];
  ``[N, H, W, C]`` or ``[N, H, W]``), optional ``classes`` (str), optional ``client_train`` (a natural client id per
  training sample), optional ``domain_train`` / ``domain_test`` with ``domains`` (str).
- ``imagefolder``: ``DIR/train/<class>/*`` and ``DIR/test/<class>/*`` (torchvision's ``ImageFolder`` layout).
- ``domainfolder``: ``DIR/<domain>/<class>/*`` (PACS, Office-Caltech, DomainNet); each domain's images are split
  into train and test per class (``test_fraction``, seeded).
- ``leaf``: ``DIR/train/*.json`` and ``DIR/test/*.json`` in LEAF's format (``users``, ``num_samples``,
  ``user_data: {user: {x, y}}``, ``x`` a flattened square image in [0, 1]); a client per user.
- ``huggingface``: a Hugging Face data set on disk with train and test splits (``fedrcl.data.huggingface``).
"""
from __future__ import annotations

import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedrcl.data.datasets import ImageData
from fedrcl.data.huggingface import Columns, huggingface_shape, read_huggingface

__all__ = ["OWN_DATASETS", "read_own_data", "own_data_shape", "IMAGE_SUFFIXES"]

OWN_DATASETS = ("npz", "imagefolder", "domainfolder", "leaf", "huggingface")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")


def read_own_data(dataset: str, root: str | Path, image_size: Optional[int] = None, seed: int = 0,
                  test_fraction: float = 0.2, columns: Columns = Columns()) -> ImageData:
    """The data set of kind ``dataset`` (one of ``OWN_DATASETS``) at ``root``, images resized to
    ``image_size`` x ``image_size`` when given (antialiased bilinear, once at load); ``seed`` and
    ``test_fraction`` make a ``domainfolder``'s train/test split; ``columns`` name a Hugging Face data set's."""
    path = Path(root).expanduser()
    if not path.exists():
        raise ValueError(f"data.root {path}: no such {'file' if dataset == 'npz' else 'folder'} "
                         f"(data.dataset {dataset})")
    if dataset == "npz":
        data = _read_npz(path)
    elif dataset == "imagefolder":
        data = _read_image_folder(path, image_size)
    elif dataset == "domainfolder":
        data = _read_domain_folder(path, image_size, seed, test_fraction)
    elif dataset == "leaf":
        data = _read_leaf(path)
    elif dataset == "huggingface":
        data = read_huggingface(path, columns, image_size)
        _check_labels(data.y_train.numpy(), data.y_test.numpy(), data.classes, str(path))
    else:
        raise ValueError(f"data.dataset {dataset!r}: not one of {', '.join(OWN_DATASETS)}")
    return _resized(data, image_size, path)


# ----------------------------------------------------------------------------------------------- npz


def _read_npz(path: Path) -> ImageData:
    try:
        with np.load(path, allow_pickle=False) as z:
            a = {key: z[key] for key in z.files}
    except Exception as e:  # BadZipFile, OSError, object arrays (refused without pickle), ...
        raise ValueError(f"{path}: cannot read as .npz without pickle ({type(e).__name__}: {e})") from None
    for key in ("x_train", "y_train", "x_test", "y_test"):
        if key not in a:
            raise ValueError(f"{path}: missing array '{key}' (has {', '.join(sorted(a)) or 'none'}; expected "
                             f"x_train, y_train, x_test, y_test, optional classes)")
    x_train, x_test = (_as_uint8_images(a[k], f"{path}: array '{k}'") for k in ("x_train", "x_test"))
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"{path}: 'x_train' has images of shape {x_train.shape[1:]}, 'x_test' "
                         f"{x_test.shape[1:]} (H, W, C); they must match")
    y_train, y_test = (_as_labels(a[k], len(x), f"{path}: array '{k}'")
                       for k, x in (("y_train", x_train), ("y_test", x_test)))
    if "classes" in a:
        cl = a["classes"]
        if cl.ndim != 1 or cl.dtype.kind not in "US":
            raise ValueError(f"{path}: array 'classes' has dtype {cl.dtype} and shape {cl.shape}, expected a 1-D "
                             f"array of str")
        classes = [str(c) for c in cl.tolist()]
    else:
        classes = [str(i) for i in range(int(max(y_train.max(initial=0), y_test.max(initial=0))) + 1)]
    _check_labels(y_train, y_test, classes, str(path))
    data = ImageData(torch.from_numpy(x_train), torch.from_numpy(y_train), torch.from_numpy(x_test),
                     torch.from_numpy(y_test), classes)
    if "client_train" in a:
        data.client_train = torch.from_numpy(_as_labels(a["client_train"], len(x_train),
                                                        f"{path}: array 'client_train'"))
    if "domain_train" in a or "domain_test" in a or "domains" in a:
        if not {"domain_train", "domain_test", "domains"} <= set(a):
            raise ValueError(f"{path}: domains need all three arrays 'domain_train', 'domain_test', 'domains'")
        names = [str(d) for d in a["domains"].tolist()]
        for key, n in (("domain_train", len(x_train)), ("domain_test", len(x_test))):
            ids = _as_labels(a[key], n, f"{path}: array '{key}'")
            if len(ids) and ids.max() >= len(names):
                raise ValueError(f"{path}: array '{key}' has domain ids up to {ids.max()}, expected values in "
                                 f"[0, {len(names)}) (the length of 'domains')")
            setattr(data, key, torch.from_numpy(ids))
        data.domains = names
    return data


def _as_uint8_images(x: np.ndarray, where: str) -> np.ndarray:
    """uint8 ``[N, H, W, C]`` from uint8 or float in [0, 1] (rounded to 1/255), ``[N, H, W]`` as one channel."""
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4 or x.shape[-1] not in (1, 3):
        raise ValueError(f"{where} has shape {x.shape}, expected [N, H, W, C] with C 1 or 3 (or [N, H, W])")
    if len(x) == 0:
        raise ValueError(f"{where} holds no images")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    if x.dtype.kind != "f":
        raise ValueError(f"{where} has dtype {x.dtype}, expected uint8 or float in [0, 1]")
    if not np.isfinite(x).all() or x.min() < 0 or x.max() > 1:
        raise ValueError(f"{where} is float with values in [{np.nanmin(x):g}, {np.nanmax(x):g}] (or non-finite), "
                         f"expected [0, 1]")
    return np.round(x * 255.0).astype(np.uint8)


def _as_labels(y: np.ndarray, n: int, where: str) -> np.ndarray:
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise ValueError(f"{where} has dtype {y.dtype} and shape {y.shape}, expected 1-D integers")
    if len(y) != n:
        raise ValueError(f"{where} has length {len(y)}, expected {n} (one per image)")
    if len(y) and y.min() < 0:
        raise ValueError(f"{where} has a negative value {y.min()}")
    return y.astype(np.int64)


def _check_labels(y_train: np.ndarray, y_test: np.ndarray, classes: list[str], where: str) -> None:
    for name, y in (("y_train", y_train), ("y_test", y_test)):
        if len(y) and y.max() >= len(classes):
            raise ValueError(f"{where}: '{name}' has labels up to {y.max()}, expected values in [0, {len(classes)}) "
                             f"({len(classes)} classes)")
    counts = np.bincount(y_train, minlength=len(classes))
    if (counts == 0).any():
        empty = [classes[i] for i in np.flatnonzero(counts == 0)]
        raise ValueError(f"{where}: class {empty[0]!r} has no training sample ({len(empty)} empty class"
                         f"{'es' if len(empty) > 1 else ''}); every class needs one")


# ------------------------------------------------------------------------------------------ images


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _class_folders(folder: Path, where: str) -> list[Path]:
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder ({where})")
    classes = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError(f"{folder}: no class folders inside ({where})")
    for c in classes:
        if not _image_files(c):
            raise ValueError(f"{c}: an empty class (no image with a suffix among {', '.join(IMAGE_SUFFIXES)})")
    return classes


def _decode(path: Path, size: Optional[int]) -> np.ndarray:
    """One image as uint8 RGB ``[H, W, 3]``, resized to ``size`` x ``size`` if given; a file PIL cannot
    decode is named."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            rgb = im.convert("RGB")
            if size is not None and rgb.size != (size, size):
                rgb = rgb.resize((size, size), Image.Resampling.BILINEAR, reducing_gap=None)
            return np.asarray(rgb, dtype=np.uint8)
    except Exception as e:  # UnidentifiedImageError, truncated files, ...
        raise ValueError(f"{path}: not a readable image ({type(e).__name__}: {e})") from None


def _decode_all(files: list[Path], size: Optional[int]) -> np.ndarray:
    """The images of ``files`` as one uint8 array; without ``size`` they must all share the first's shape."""
    workers = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        images = list(pool.map(lambda f: _decode(f, size), files))
    first = images[0].shape
    for f, im in zip(files, images):
        if im.shape != first:
            raise ValueError(f"{f}: image of size {im.shape[1]}x{im.shape[0]}, but {files[0]} is "
                             f"{first[1]}x{first[0]}; set data.image_size to resize them all")
    return np.stack(images)


def _read_split_folder(folder: Path, classes: list[str], where: str) -> tuple[list[Path], np.ndarray]:
    found = [c.name for c in _class_folders(folder, where)]
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise ValueError(f"{folder / unknown[0]}: a class that the train folder lacks (train has "
                         f"{', '.join(classes)})")
    files, labels = [], []
    for name in found:
        these = _image_files(folder / name)
        files += these
        labels += [classes.index(name)] * len(these)
    return files, np.asarray(labels, dtype=np.int64)


def _read_image_folder(root: Path, size: Optional[int]) -> ImageData:
    classes = [c.name for c in _class_folders(root / "train", "data.dataset imagefolder: DIR/train/<class>/*")]
    train_files, y_train = _read_split_folder(root / "train", classes, "DIR/train/<class>/*")
    test_files, y_test = _read_split_folder(root / "test", classes, "DIR/test/<class>/*")
    x = _decode_all(train_files + test_files, size)
    return ImageData(torch.from_numpy(x[:len(train_files)]), torch.from_numpy(y_train),
                     torch.from_numpy(x[len(train_files):]), torch.from_numpy(y_test), classes)


def _read_domain_folder(root: Path, size: Optional[int], seed: int, test_fraction: float) -> ImageData:
    domains = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(domains) < 1:
        raise ValueError(f"{root}: no domain folders inside (data.dataset domainfolder: DIR/<domain>/<class>/*)")
    per_domain = {d: [c.name for c in _class_folders(root / d, "DIR/<domain>/<class>/*")] for d in domains}
    classes = sorted(set().union(*per_domain.values()))
    files: list[Path] = []
    labels, domain_ids = [], []
    for i, d in enumerate(domains):
        for name in per_domain[d]:
            these = _image_files(root / d / name)
            files += these
            labels += [classes.index(name)] * len(these)
            domain_ids += [i] * len(these)
    y, dom = np.asarray(labels, dtype=np.int64), np.asarray(domain_ids, dtype=np.int64)
    test = _stratified_test(y * len(domains) + dom, test_fraction, seed)
    x = _decode_all(files, size)
    train = ~test
    data = ImageData(torch.from_numpy(x[train]), torch.from_numpy(y[train]), torch.from_numpy(x[test]),
                     torch.from_numpy(y[test]), classes)
    data.domain_train, data.domain_test = torch.from_numpy(dom[train]), torch.from_numpy(dom[test])
    data.domains = domains
    return data


def _stratified_test(groups: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """A boolean test mask: in each group, ``round(fraction * n)`` samples chosen at random (seeded); a group of
    two or more keeps at least one training and one test sample."""
    rng = np.random.default_rng(seed)
    test = np.zeros(len(groups), dtype=bool)
    for g in np.unique(groups):
        members = np.flatnonzero(groups == g)
        k = int(round(fraction * len(members)))
        if len(members) >= 2:
            k = min(max(k, 1), len(members) - 1)
        test[rng.permutation(members)[:k]] = True
    return test


# -------------------------------------------------------------------------------------------- LEAF


def _read_leaf_part(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise ValueError(f"{folder}: no LEAF .json files (data.dataset leaf: DIR/train/*.json, DIR/test/*.json)")
    users: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for f in files:
        try:
            obj = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{f}: not readable as JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("users"), list) \
                or not isinstance(obj.get("user_data"), dict):
            raise ValueError(f"{f}: not LEAF's format (expected keys 'users', 'num_samples', 'user_data')")
        for user in obj["users"]:
            record = obj["user_data"].get(user)
            if not isinstance(record, dict) or "x" not in record or "y" not in record:
                raise ValueError(f"{f}: user {user!r} has no 'x' and 'y' in 'user_data'")
            try:
                x = np.asarray(record["x"], dtype=np.float32)
                y = np.asarray(record["y"], dtype=np.int64)
            except (TypeError, ValueError):
                raise ValueError(f"{f}: user {user!r}: 'x' must be lists of numbers (flattened images) and 'y' "
                                 f"integers; LEAF data sets that store file names (CelebA) are not read") from None
            if x.ndim != 2 or y.ndim != 1 or len(x) != len(y):
                raise ValueError(f"{f}: user {user!r}: 'x' has shape {x.shape} and 'y' {y.shape}, expected [n, "
                                 f"H*W] and [n]")
            users[str(user)] = (x, y)
    return users


def _read_leaf(root: Path) -> ImageData:
    train, test = _read_leaf_part(root / "train"), _read_leaf_part(root / "test")
    order = sorted(train)
    width = {x.shape[1] for x, _ in train.values() if len(x)} | {x.shape[1] for x, _ in test.values() if len(x)}
    if len(width) != 1:
        raise ValueError(f"{root}: users' images have different lengths {sorted(width)}")
    (pixels,) = width
    side = int(round(pixels ** 0.5))
    if side * side != pixels:
        raise ValueError(f"{root}: images of {pixels} values, not a square; expected flattened H*H images")

    def stack(part: dict[str, tuple[np.ndarray, np.ndarray]], users: list[str], where: str):
        xs = [part[u][0] for u in users if u in part]
        ys = [part[u][1] for u in users if u in part]
        ids = [np.full(len(part[u][1]), i, dtype=np.int64) for i, u in enumerate(users) if u in part]
        x = _as_uint8_images(np.concatenate(xs).reshape(-1, side, side), f"{root}/{where}: 'x'")
        return x, np.concatenate(ys), np.concatenate(ids)

    x_train, y_train, user_train = stack(train, order, "train")
    x_test, y_test, user_test = stack(test, order, "test")
    classes = [str(i) for i in range(int(max(y_train.max(), y_test.max())) + 1)]
    _check_labels(y_train, y_test, classes, str(root))
    data = ImageData(torch.from_numpy(x_train), torch.from_numpy(y_train), torch.from_numpy(x_test),
                     torch.from_numpy(y_test), classes)
    data.client_train, data.client_test = torch.from_numpy(user_train), torch.from_numpy(user_test)
    data.client_names = order
    return data


# ------------------------------------------------------------------------------------------ resize


def _resized(data: ImageData, size: Optional[int], where: Path) -> ImageData:
    """Images resized to ``size`` x ``size`` (antialiased bilinear, rounded back to uint8); without ``size``
    they must be square."""
    h, w = data.x_train.shape[1:3]
    if size is None:
        if h != w:
            raise ValueError(f"{where}: images are {w}x{h}, not square; set data.image_size to resize them")
        return data
    if size < 1:
        raise ValueError(f"data.image_size must be >= 1 or null, got {size}")
    if (h, w) == (size, size):
        return data

    def resize(x: torch.Tensor) -> torch.Tensor:
        out = []
        for start in range(0, len(x), 1024):  # bounded memory for large sets
            f = x[start:start + 1024].permute(0, 3, 1, 2).float()
            f = F.interpolate(f, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
            out.append(f.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous())
        return torch.cat(out)

    data.x_train, data.x_test = resize(data.x_train), resize(data.x_test)
    return data


# ------------------------------------------------------------------------------------------- shape


def own_data_shape(dataset: str, root: str | Path, image_size: Optional[int] = None,
                   columns: Columns = Columns()) -> tuple[int, int, int]:
    """``(num_classes, in_channels, image_size)`` of own data, read without decoding every image (the CLI links
    them into the model when it parses the config)."""
    path = Path(root).expanduser()
    stamp = path.stat().st_mtime_ns if path.exists() else 0
    return _shape(dataset, str(path.resolve()), stamp, image_size, columns)


@functools.lru_cache(maxsize=8)
def _shape(dataset: str, root: str, stamp: int, image_size: Optional[int],
           columns: Columns) -> tuple[int, int, int]:
    path = Path(root)
    if dataset == "huggingface" and path.is_dir():
        return huggingface_shape(path, columns, image_size)
    if dataset in ("npz", "leaf", "huggingface") or not path.is_dir():
        data = read_own_data(dataset, path, image_size)
        return len(data.classes), int(data.x_train.shape[-1]), int(data.x_train.shape[1])
    if dataset == "imagefolder":
        folders = _class_folders(path / "train", "data.dataset imagefolder: DIR/train/<class>/*")
        classes = {c.name for c in folders}
    else:
        domains = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not domains:
            raise ValueError(f"{path}: no domain folders inside (data.dataset domainfolder: DIR/<domain>/<class>/*)")
        folders = [c for d in domains for c in _class_folders(d, "DIR/<domain>/<class>/*")]
        classes = {c.name for c in folders}
    if image_size is not None:
        return len(classes), 3, image_size
    first = _image_files(folders[0])[0]
    from PIL import Image

    try:
        with Image.open(first) as im:
            w, h = im.size
    except Exception as e:
        raise ValueError(f"{first}: not a readable image ({type(e).__name__}: {e})") from None
    if w != h:
        raise ValueError(f"{first}: images are {w}x{h}, not square; set data.image_size to resize them")
    return len(classes), 3, w
