"""Seeded ways of splitting a labelled data set among federated clients.

Every function takes the label vector of the whole training set and returns
``list[np.ndarray]``: one int64 array of sample indices per client, sorted
ascending.  Clients never share an index.  The functions are pure: the same
arguments (including ``seed``) always give the same split, and no global random
state is read or written.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "dirichlet_partition",
    "shard_partition",
    "iid_partition",
    "label_counts",
]


def _as_labels(labels: Any) -> np.ndarray:
    """Labels (numpy array, torch tensor or sequence) as a 1-D int64 array."""
    if hasattr(labels, "detach"):  # torch tensor, possibly on an accelerator
        labels = labels.detach().cpu().numpy()
    arr = np.asarray(labels, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {tuple(arr.shape)}")
    return arr


def _check_num_clients(num_clients: int, num_samples: int) -> None:
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > num_samples:
        raise ValueError(
            f"num_clients must be <= the number of samples ({num_samples}), got {num_clients}"
        )


def _finish(parts: list[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def dirichlet_partition(
    labels: Any,
    num_clients: int,
    alpha: float,
    seed: int = 0,
    balanced: bool = True,
) -> list[np.ndarray]:
    """Label-skewed split in which each client's class mix follows Dir(alpha).

    Smaller ``alpha`` gives more skew; large ``alpha`` approaches an IID split.

    ``balanced=True`` (the FedRCL authors' algorithm: every client holds the same
    number of examples): with ``n_per = N // num_clients``, clients are filled one
    after the other.  For each, a class distribution ``p ~ Dir(alpha * 1_C)`` is
    drawn, every still-unassigned sample is weighted by ``p[its class]`` and
    ``n_per`` of them are drawn without replacement with probability
    proportional to their weights (done with exponential keys,
    Efraimidis-Spirakis, which has the same law as drawing them one at a time).
    If fewer than ``n_per`` unassigned samples have a non-zero weight, all of
    them are taken and the rest is filled uniformly at random from the other
    unassigned samples.  The ``N % num_clients`` leftover samples are not
    assigned to anyone.

    ``balanced=False`` is the classic per-class Dirichlet split (Hsu et al. 2019):
    for every class a share vector ``q ~ Dir(alpha * 1_K)`` over the clients is
    drawn and the class's shuffled samples are cut into consecutive chunks of
    sizes proportional to ``q``.  Every sample is assigned; client sizes are
    unequal and a client may end up empty.
    """
    y = _as_labels(labels)
    n = len(y)
    if not alpha > 0:  # also rejects NaN
        raise ValueError(f"alpha must be > 0, got {alpha}")
    _check_num_clients(num_clients, n)
    rng = np.random.default_rng(seed)
    # Dense class ids 0..C-1 over the classes actually present.
    classes, cls = np.unique(y, return_inverse=True)
    num_classes = len(classes)

    if not balanced:
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in range(num_classes):
            idx = np.flatnonzero(cls == c)
            rng.shuffle(idx)
            q = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = (np.cumsum(q)[:-1] * len(idx)).astype(np.int64)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
        return _finish([np.concatenate(p) for p in parts])

    n_per = n // num_clients
    unassigned = np.ones(n, dtype=bool)
    out: list[np.ndarray] = []
    for _ in range(num_clients):
        p = rng.dirichlet(np.full(num_classes, float(alpha)))
        free = np.flatnonzero(unassigned)
        w = p[cls[free]]
        positive = np.isfinite(w) & (w > 0)
        cand = free[positive]
        if len(cand) <= n_per:
            rest = free[~positive]
            fill = rng.choice(rest, size=n_per - len(cand), replace=False)
            chosen = np.concatenate([cand, fill])
        else:
            # Weighted sampling without replacement: the n_per smallest
            # Exp(1) / w keys.
            keys = rng.exponential(size=len(cand)) / w[positive]
            chosen = cand[np.argpartition(keys, n_per - 1)[:n_per]]
        unassigned[chosen] = False
        out.append(chosen)
    return _finish(out)


def shard_partition(
    labels: Any,
    num_clients: int,
    shards_per_client: int,
    seed: int = 0,
) -> list[np.ndarray]:
    """Quantity-based label skew: each client gets a few label-sorted shards.

    The indices are sorted by label (stable), cut into
    ``num_clients * shards_per_client`` near-equal shards (``np.array_split``),
    the shard order is shuffled with ``seed`` and client ``k`` takes shards
    ``k * shards_per_client`` ... ``(k + 1) * shards_per_client - 1`` of that
    order.  Every sample is assigned.  When shards line up with class
    boundaries each client sees at most ``shards_per_client`` classes.
    """
    y = _as_labels(labels)
    n = len(y)
    _check_num_clients(num_clients, n)
    if shards_per_client < 1:
        raise ValueError(f"shards_per_client must be >= 1, got {shards_per_client}")
    num_shards = num_clients * shards_per_client
    if num_shards > n:
        raise ValueError(
            f"num_clients * shards_per_client must be <= the number of samples ({n}), "
            f"got {num_clients} * {shards_per_client} = {num_shards}"
        )
    rng = np.random.default_rng(seed)
    order = np.argsort(y, kind="stable")
    shards = np.array_split(order, num_shards)
    perm = rng.permutation(num_shards)
    s = shards_per_client
    return _finish(
        [np.concatenate([shards[j] for j in perm[k * s:(k + 1) * s]]) for k in range(num_clients)]
    )


def iid_partition(labels: Any, num_clients: int, seed: int = 0) -> list[np.ndarray]:
    """Uniformly random split into ``num_clients`` parts of ``N // num_clients``.

    The ``N % num_clients`` leftover samples are not assigned.
    """
    y = _as_labels(labels)
    n = len(y)
    _check_num_clients(num_clients, n)
    rng = np.random.default_rng(seed)
    n_per = n // num_clients
    perm = rng.permutation(n)[: num_clients * n_per]
    return _finish(list(perm.reshape(num_clients, n_per)))


def label_counts(labels: Any, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Per-client class histogram: int64 array ``[num_clients, num_classes]``."""
    y = _as_labels(labels)
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(
            f"labels must lie in [0, {num_classes}), got range [{y.min()}, {y.max()}]"
        )
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for k, idx in enumerate(parts):
        counts[k] = np.bincount(y[np.asarray(idx, dtype=np.int64)], minlength=num_classes)
    return counts
