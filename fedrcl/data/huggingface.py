"""Hugging Face data sets on disk, and Flower Datasets' partitioners as the client split (the ``data`` extra:
``pip install -e ".[data]"``).

``--data.dataset huggingface --data.root DIR`` reads, with no network, a ``DatasetDict`` saved by
``save_to_disk`` (``load_from_disk``), else the parquet files or the image folder under ``DIR``
(``load_dataset("parquet" | "imagefolder", data_dir=DIR)``); it needs ``train`` and ``test`` splits. The image
and label columns are named by ``data.image_column`` / ``data.label_column``; ``data.client_column`` gives a
natural client per value (``data.partition natural``), ``data.domain_column`` a domain per value (domain skew).
Images are decoded once (PIL, or arrays) into uint8 ``[N, H, W, C]``.

``--data.partitioner flwr_datasets.partitioner.DirichletPartitioner --data.partitioner.init_args.partition_by
label --data.partitioner.init_args.alpha 0.3`` splits the train set with Flower Datasets instead of fedrcl's own
partitions: the partitioner is built with ``num_partitions = data.num_clients`` and handed a table of the train
set's ``label`` (and, where the data has them, ``client`` and ``domain``) columns; client ``k`` holds partition
``k``'s rows. The split is written to ``split.json`` as any other.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

import numpy as np
import torch

from fedrcl.data.datasets import ImageData

__all__ = ["Columns", "Partitioner", "read_huggingface", "huggingface_shape", "flower_partition"]

EXTRA = 'pip install -e ".[data]"'


@runtime_checkable
class Partitioner(Protocol):
    """What fedrcl asks of a partitioner (Flower Datasets' ``Partitioner``): a ``dataset`` to set and
    ``load_partition``."""

    def load_partition(self, partition_id: int) -> Any: ...


@dataclass(frozen=True)
class Columns:
    """The columns a Hugging Face data set is read from."""

    image: str = "image"
    label: str = "label"
    client: Optional[str] = None
    domain: Optional[str] = None


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data.dataset huggingface needs the Hugging Face datasets library: {EXTRA}") from None
    return datasets


def _load(root: Path) -> Any:
    datasets = _datasets()
    try:
        if (root / "dataset_dict.json").is_file() or (root / "dataset_info.json").is_file():
            loaded = datasets.load_from_disk(str(root))
        elif any(root.rglob("*.parquet")):
            loaded = datasets.load_dataset("parquet", data_dir=str(root))
        else:
            loaded = datasets.load_dataset("imagefolder", data_dir=str(root))
    except Exception as e:
        raise ValueError(f"{root}: cannot read as a Hugging Face data set ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(loaded, datasets.DatasetDict) or not {"train", "test"} <= set(loaded):
        found = list(loaded) if isinstance(loaded, datasets.DatasetDict) else "one split"
        raise ValueError(f"{root}: a Hugging Face data set with 'train' and 'test' splits is needed, found {found}")
    return loaded


def _column(split: Any, name: str, key: str, root: Path, part: str) -> Any:
    if name not in split.column_names:
        raise ValueError(f"{root}: the {part} split has no column {name!r} (data.{key}; columns: "
                         f"{', '.join(split.column_names)})")
    return split[name]


def _images(split: Any, columns: Columns, root: Path, part: str, size: Optional[int]) -> np.ndarray:
    from PIL import Image

    images: list[np.ndarray] = []
    for i, item in enumerate(_column(split, columns.image, "image_column", root, part)):
        if isinstance(item, Image.Image):
            rgb = item.convert("RGB")
            if size is not None and rgb.size != (size, size):
                rgb = rgb.resize((size, size), Image.Resampling.BILINEAR, reducing_gap=None)
            arr = np.asarray(rgb, dtype=np.uint8)
        else:
            arr = np.asarray(item)
            arr = arr[..., None] if arr.ndim == 2 else arr
            if arr.dtype.kind == "f":
                arr = np.round(np.clip(arr, 0, 1) * 255)
            arr = arr.astype(np.uint8)
        if images and arr.shape != images[0].shape:
            raise ValueError(f"{root}: {part} row {i}'s image is {arr.shape}, row 0's {images[0].shape}; set "
                             f"data.image_size to resize them all")
        images.append(arr)
    if not images:
        raise ValueError(f"{root}: the {part} split is empty")
    return np.stack(images)


def _ids(values: list[Any], names: list[str]) -> np.ndarray:
    """Values as ids into ``names`` (extended in order of first appearance)."""
    index = {n: i for i, n in enumerate(names)}
    for v in values:
        index.setdefault(str(v), len(index))
    names[:] = list(index)
    return np.asarray([index[str(v)] for v in values], dtype=np.int64)


def read_huggingface(root: Path, columns: Columns, image_size: Optional[int]) -> ImageData:
    """The train and test splits at ``root`` as ``ImageData`` (``fedrcl.data.sources`` resizes and checks
    the labels)."""
    loaded = _load(root)
    train, test = loaded["train"], loaded["test"]
    feature = train.features.get(columns.label)
    y_train = np.asarray(_column(train, columns.label, "label_column", root, "train"))
    y_test = np.asarray(_column(test, columns.label, "label_column", root, "test"))
    for part, y in (("train", y_train), ("test", y_test)):
        if y.ndim != 1 or y.dtype.kind not in "iu" or (len(y) and y.min() < 0):
            raise ValueError(f"{root}: the {part} split's column {columns.label!r} holds {y.dtype} {y.shape}, "
                             f"expected non-negative integer labels (data.label_column)")
    names = getattr(feature, "names", None)
    classes = list(names) if names else [str(i) for i in range(int(max(y_train.max(), y_test.max())) + 1)]
    data = ImageData(torch.from_numpy(_images(train, columns, root, "train", image_size)),
                     torch.from_numpy(y_train.astype(np.int64)),
                     torch.from_numpy(_images(test, columns, root, "test", image_size)),
                     torch.from_numpy(y_test.astype(np.int64)), classes)
    if columns.client is not None:
        clients: list[str] = []
        data.client_train = torch.from_numpy(_ids(_column(train, columns.client, "client_column", root, "train"),
                                                  clients))
        if columns.client in test.column_names:
            data.client_test = torch.from_numpy(_ids(test[columns.client], clients))
        data.client_names = clients
    if columns.domain is not None:
        domains: list[str] = []
        domain_train = _ids(_column(train, columns.domain, "domain_column", root, "train"), domains)
        domain_test = _ids(_column(test, columns.domain, "domain_column", root, "test"), domains)
        order = sorted(range(len(domains)), key=lambda i: domains[i])  # domains named in sorted order
        rank = np.argsort(order)
        data.domain_train, data.domain_test = torch.from_numpy(rank[domain_train]), torch.from_numpy(rank[domain_test])
        data.domains = [domains[i] for i in order]
    return data


def huggingface_shape(root: Path, columns: Columns, image_size: Optional[int]) -> tuple[int, int, int]:
    """``(num_classes, in_channels, image_size)`` from the train split's label feature and first image."""
    train = _load(root)["train"]
    names = getattr(train.features.get(columns.label), "names", None)
    if names:
        num_classes = len(names)
    else:
        labels = np.asarray(_column(train, columns.label, "label_column", root, "train"))
        num_classes = int(labels.max()) + 1
    first = _images(train.select([0]), columns, root, "train", image_size)
    return num_classes, int(first.shape[-1]), int(first.shape[1])


def flower_partition(partitioner: Partitioner, labels: np.ndarray, clients: Optional[np.ndarray] = None,
                     domains: Optional[np.ndarray] = None) -> list[np.ndarray]:
    """Client ``k``'s train indices: the rows of ``partitioner``'s partition ``k`` of a table of ``label`` (and
    ``client``, ``domain``) columns, one row per training sample."""
    datasets = _datasets()
    table: dict[str, Any] = {"label": labels.tolist(), "fedrcl_index": list(range(len(labels)))}
    if clients is not None:
        table["client"] = clients.tolist()
    if domains is not None:
        table["domain"] = domains.tolist()
    partitioner.dataset = datasets.Dataset.from_dict(table)  # type: ignore[attr-defined]
    count = partitioner.num_partitions  # type: ignore[attr-defined]
    return [np.sort(np.asarray(partitioner.load_partition(k)["fedrcl_index"], dtype=np.int64)) for k in range(count)]
