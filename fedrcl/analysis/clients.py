"""What each client holds: per-client class counts of a data set's split, as training computes it."""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
from torch import Tensor

from fedrcl.data.datamodule import FederatedDataModule, Partition
from fedrcl.data.datasets import load_dataset
from fedrcl.data.partition import label_counts

__all__ = ["partition_counts"]


def partition_counts(dataset: str, root: str = "data", num_clients: int = 100, partition: Partition = "dirichlet",
                     alpha: float = 0.3, shards_per_client: int = 2, seed: int = 0, download: bool = False,
                     **data: Any) -> np.ndarray:
    """Samples of each class at each client, ``[num_clients, num_classes]``, for the given ``data`` settings.

    The arguments are ``FederatedDataModule``'s (its other keys, e.g. ``batch_size``, are accepted and
    do not matter); the split is computed exactly as in training.
    """
    dm = FederatedDataModule(dataset=dataset, root=root, download=download, num_clients=num_clients,
                             partition=partition, alpha=alpha, shards_per_client=shards_per_client, seed=seed,
                             **data)
    labels = _train_labels(dataset, str(root), download)
    return label_counts(labels, dm.split(labels), dm.num_classes)


@lru_cache(maxsize=4)
def _train_labels(dataset: str, root: str, download: bool) -> Tensor:
    """The train labels, read once per data set (a notebook draws several splits of the same one)."""
    return load_dataset(dataset, root, download=download).y_train
