import numpy as np
import pytest
import torch

from fedrcl.data.partition import (
    dirichlet_partition,
    iid_partition,
    label_counts,
    shard_partition,
)


def _labels(n_per_class=500, num_classes=10, seed=0):
    y = np.repeat(np.arange(num_classes), n_per_class)
    return np.random.default_rng(seed).permutation(y)


def _check_disjoint_valid(parts, n):
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "each part sorted ascending without repeats"
        if len(p):
            assert p.min() >= 0 and p.max() < n
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "clients share an index"
    return allidx


SPLITTERS = {
    "dirichlet_balanced": lambda y, seed: dirichlet_partition(y, 10, 0.3, seed=seed),
    "dirichlet_unbalanced": lambda y, seed: dirichlet_partition(y, 10, 0.3, seed=seed, balanced=False),
    "shard": lambda y, seed: shard_partition(y, 10, 2, seed=seed),
    "iid": lambda y, seed: iid_partition(y, 10, seed=seed),
}


@pytest.mark.parametrize("name", sorted(SPLITTERS))
def test_disjoint_valid_and_seeded(name):
    y = _labels(n_per_class=101)  # N = 1010, not divisible by 100
    split = SPLITTERS[name]
    a = split(y, 0)
    _check_disjoint_valid(a, len(y))
    assert len(a) == 10
    b = split(y, 0)
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    c = split(y, 1)
    assert not all(np.array_equal(p, q) for p, q in zip(a, c))


@pytest.mark.parametrize("name", ["dirichlet_balanced", "iid"])
def test_balanced_coverage(name):
    y = _labels(n_per_class=101)
    n, k = len(y), 10
    parts = SPLITTERS[name](y, 3)
    assert [len(p) for p in parts] == [n // k] * k
    assert len(np.unique(np.concatenate(parts))) == k * (n // k)


def test_balanced_coverage_uneven():
    y = _labels(n_per_class=37, num_classes=7)  # 259 samples, 11 clients -> 23 each, 6 left
    parts = dirichlet_partition(y, 11, 0.1, seed=5)
    assert [len(p) for p in parts] == [23] * 11
    assert len(np.unique(np.concatenate(parts))) == 253


@pytest.mark.parametrize("name", ["dirichlet_unbalanced", "shard"])
def test_full_coverage(name):
    y = _labels(n_per_class=101)
    parts = SPLITTERS[name](y, 2)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(y)))


def test_torch_labels_accepted():
    y = _labels(n_per_class=50)
    a = dirichlet_partition(torch.from_numpy(y), 5, 0.5, seed=0)
    b = dirichlet_partition(y, 5, 0.5, seed=0)
    assert all(np.array_equal(p, q) for p, q in zip(a, b))


def _mean_max_share(y, parts):
    counts = label_counts(y, parts, 10).astype(float)
    sizes = counts.sum(1)
    keep = sizes > 0
    return float((counts[keep].max(1) / sizes[keep]).mean())


@pytest.mark.parametrize("balanced", [True, False])
def test_skew_grows_as_alpha_shrinks(balanced):
    y = _labels(n_per_class=500)  # 5000 samples, 10 classes
    shares = [
        _mean_max_share(y, dirichlet_partition(y, 20, alpha, seed=0, balanced=balanced))
        for alpha in (0.05, 0.6, 100.0)
    ]
    assert shares[0] > shares[1] > shares[2]
    assert shares[0] > 0.6
    assert shares[2] < 0.2  # near-uniform: 1/10 plus noise


def test_label_counts():
    y = np.array([0, 1, 1, 2, 2, 2])
    counts = label_counts(y, [np.array([0, 1]), np.array([2, 3, 4, 5])], 4)
    assert counts.tolist() == [[1, 1, 0, 0], [0, 1, 3, 0]]
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        label_counts(y, [np.array([0])], 2)


def test_shards_align_with_classes():
    y = _labels(n_per_class=100)  # 10 classes x 100, 40 shards of 25 -> one class per shard
    parts = shard_partition(y, 20, 2, seed=0)
    counts = label_counts(y, parts, 10)
    assert ((counts > 0).sum(1) <= 2).all()
    assert [len(p) for p in parts] == [50] * 20
    assert ((counts % 25) == 0).all()


def test_dirichlet_fill_path():
    # Two classes of 6 samples, 4 clients of 3.  With a tiny alpha each client's
    # p puts (numerically) all mass on one class, so one class runs out and the
    # later clients whose class is exhausted must be filled from the other one.
    y = np.array([0] * 6 + [1] * 6)
    for seed in range(20):
        parts = dirichlet_partition(y, 4, 1e-6, seed=seed)
        assert [len(p) for p in parts] == [3] * 4
        allidx = _check_disjoint_valid(parts, len(y))
        assert len(allidx) == 12


def test_dirichlet_fill_path_structure():
    # Class 0 has 2 samples, class 1 has 10; 3 clients of 4.  With alpha tiny,
    # p is one-hot (exact zeros), so a client that draws class 0 has only 2
    # non-zero-weight samples and must be topped up with 2 of class 1; if no
    # client draws class 0, the last one finds only 2 of class 1 left and is
    # topped up with the 2 of class 0.  Either way: exactly one client holds
    # both class-0 samples plus 2 of class 1, the others 4 of class 1.
    y = np.array([0] * 2 + [1] * 10)
    for seed in range(30):
        parts = dirichlet_partition(y, 3, 1e-6, seed=seed)
        _check_disjoint_valid(parts, len(y))
        counts = sorted(label_counts(y, parts, 2).tolist())
        assert counts == [[0, 4], [0, 4], [2, 2]], (seed, counts)


def test_errors():
    y = _labels(n_per_class=2)  # 20 samples
    with pytest.raises(ValueError, match=r"alpha must be > 0, got 0"):
        dirichlet_partition(y, 2, 0.0)
    with pytest.raises(ValueError, match=r"alpha must be > 0, got -1"):
        dirichlet_partition(y, 2, -1, balanced=False)
    for fn in (
        lambda k: dirichlet_partition(y, k, 0.5),
        lambda k: dirichlet_partition(y, k, 0.5, balanced=False),
        lambda k: iid_partition(y, k),
        lambda k: shard_partition(y, k, 1),
    ):
        with pytest.raises(ValueError, match=r"num_clients must be >= 1, got 0"):
            fn(0)
        with pytest.raises(ValueError, match=r"num_clients must be <= the number of samples \(20\), got 21"):
            fn(21)
    with pytest.raises(ValueError, match=r"shards_per_client must be >= 1, got 0"):
        shard_partition(y, 2, 0)
    with pytest.raises(ValueError, match=r"number of samples \(20\).*got 5 \* 5 = 25"):
        shard_partition(y, 5, 5)
    with pytest.raises(ValueError, match="1-D"):
        iid_partition(np.zeros((4, 2)), 2)
