"""fedrcl.analysis: the metrics against their definitions, the monitoring callback, runs, partition pictures.

Limits pinned here: effective rank is n for a multiple of the n x n identity, 1 for rank one, 0 for the zero
matrix, scale-invariant and within [1, rank]; VCI is 0 when every sample sits on its class mean, 1 when the
class means coincide, near 1 for labels independent of the features, in [0, 1] and invariant to invertible
affine maps; D(x) is invariant to scaling all features and inf when a single class is present.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, run_cli
from fedrcl.analysis import (
    RepresentationMonitor,
    class_covariances,
    deviation_bound,
    effective_rank,
    find_runs,
    load_scalars,
    partition_counts,
    plot_partition,
    variability_collapse_index,
)
from fedrcl.analysis.partitions import main as partitions_main
from fedrcl.data.datasets import load_dataset
from fedrcl.data.partition import dirichlet_partition, label_counts


def _random(n=60, d=5, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    features = rng.normal(size=(n, d)) + 2.0 * rng.normal(size=(classes, d))[labels]
    return features, labels


# -- direct float64 references, written from the definitions -------------------------------------------------
def ref_covariances(x, y):
    n, d = x.shape
    mu = x.mean(0)
    within, between = np.zeros((d, d)), np.zeros((d, d))
    for c in np.unique(y):
        xc = x[y == c]
        mc = xc.mean(0)
        for row in xc:
            within += np.outer(row - mc, row - mc) / n
        between += len(xc) / n * np.outer(mc - mu, mc - mu)
    return within, between


def ref_vci(x, y):
    _, between = ref_covariances(x, y)
    total = np.cov(x.T, bias=True).reshape(x.shape[1], x.shape[1])
    return 1 - np.trace(np.linalg.pinv(total) @ between) / np.linalg.matrix_rank(between)


def ref_deviation(phi, p, y, num_classes):
    cos = lambda a, b: a @ b / (np.linalg.norm(a) * np.linalg.norm(b))  # noqa: E731
    members = {c: np.flatnonzero(y == c) for c in range(num_classes) if (y == c).any()}
    P = {c: p[i].mean(0) for c, i in members.items()}  # P[y][z] = P_z^(y)
    Phi = {c: np.linalg.norm(phi[i], axis=1).mean() for c, i in members.items()}
    out = []
    for n in range(len(y)):
        r = y[n]
        S = {c: np.mean([cos(phi[n], phi[i]) for i in idx]) for c, idx in members.items()}
        num = (1 - P[r][r]) * Phi[r] * len(members[r]) * S[r]
        den = sum(P[j][r] * Phi[j] * len(members[j]) * S[j] for j in members if j != r)
        out.append(num / den)
    return np.array(out)


# -- effective rank ------------------------------------------------------------------------------------------
def test_effective_rank_hand_cases():
    assert effective_rank(torch.eye(5)) == pytest.approx(5.0, rel=1e-12)
    assert effective_rank(3.0 * torch.eye(4)) == pytest.approx(4.0, rel=1e-12)
    assert effective_rank(torch.outer(torch.arange(1.0, 5), torch.ones(3))) == pytest.approx(1.0, rel=1e-12)
    # p = (3/4, 1/4): exp(-(3/4 ln 3/4 + 1/4 ln 1/4))
    assert effective_rank(torch.diag(torch.tensor([3.0, 1.0]))) == pytest.approx(1.7547653506033232, 1e-12)
    assert effective_rank(torch.zeros(3, 3)) == 0.0
    with pytest.raises(ValueError, match="2-D"):
        effective_rank(torch.ones(3))


def test_effective_rank_matches_reference_and_bounds():
    rng = np.random.default_rng(1)
    for shape in ((6, 6), (7, 3), (3, 9)):
        a = rng.normal(size=shape)
        s = np.linalg.svd(a, compute_uv=False)
        p = s / s.sum()
        expected = math.exp(-(p * np.log(p)).sum())
        got = effective_rank(torch.from_numpy(a))
        assert got == pytest.approx(expected, rel=1e-12)
        assert 1.0 <= got <= min(shape)
        assert effective_rank(torch.from_numpy(123.0 * a)) == pytest.approx(got, rel=1e-12)
    low = rng.normal(size=(8, 2)) @ rng.normal(size=(2, 8))  # rank 2
    assert 1.0 <= effective_rank(torch.from_numpy(low)) <= 2.0 + 1e-9
    a32 = torch.from_numpy(rng.normal(size=(5, 5))).float()
    assert effective_rank(a32) == pytest.approx(effective_rank(a32.double()), rel=1e-12)  # float64 inside


# -- class covariances ---------------------------------------------------------------------------------------
def test_class_covariances_hand_case():
    x, y = torch.tensor([[0.0], [2.0], [4.0], [6.0]]), torch.tensor([0, 0, 1, 1])
    within, between, total = class_covariances(x, y)
    assert (within.item(), between.item(), total.item()) == pytest.approx((1.0, 4.0, 5.0))
    assert within.dtype == torch.float64


def test_class_covariances_match_reference():
    x, y = _random(n=50, d=4, classes=3)
    y[y == 2] = 7  # labels need not be contiguous
    within, between, total = class_covariances(torch.from_numpy(x).float(), torch.from_numpy(y))
    x = x.astype(np.float32).astype(np.float64)  # what the float32 input holds, in float64
    ref_w, ref_b = ref_covariances(x, y)
    np.testing.assert_allclose(within.numpy(), ref_w, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(between.numpy(), ref_b, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(total.numpy(), np.cov(x.T, bias=True), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="labels"):
        class_covariances(torch.zeros(4, 2), torch.zeros(3, dtype=torch.long))


# -- variability collapse index ------------------------------------------------------------------------------
def test_vci_hand_cases_and_limits():
    assert variability_collapse_index(torch.tensor([[0.0], [2.0], [4.0], [6.0]]),
                                      torch.tensor([0, 0, 1, 1])) == pytest.approx(0.2)
    # every sample on its class mean: no within-class variance
    means = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 1.0], [-1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])
    labels = torch.arange(4).repeat(5)
    assert variability_collapse_index(means[labels], labels) == pytest.approx(0.0, abs=1e-9)
    # class means coincide: rank(Sigma_B) = 0, VCI = 1 (the limit)
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    assert variability_collapse_index(x, torch.tensor([0, 0, 1, 1])) == 1.0
    # labels independent of the features
    rng = np.random.default_rng(0)
    noise = torch.from_numpy(rng.normal(size=(20000, 3)))
    assert variability_collapse_index(noise, torch.from_numpy(rng.integers(0, 4, 20000))) > 0.99


def test_vci_matches_reference_and_is_affine_invariant():
    for seed in range(3):
        x, y = _random(n=80, d=6, classes=5, seed=seed)
        got = variability_collapse_index(torch.from_numpy(x), torch.from_numpy(y))
        assert got == pytest.approx(ref_vci(x, y), rel=1e-9)
        assert 0.0 <= got <= 1.0
        a = np.random.default_rng(seed + 10).normal(size=(6, 6))
        moved = variability_collapse_index(torch.from_numpy(x @ a + 3.0), torch.from_numpy(y))
        assert moved == pytest.approx(got, rel=1e-8)
    x, y = _random(n=30, d=40, classes=3)  # more dimensions than samples: pinv of a singular Sigma_T
    got = variability_collapse_index(torch.from_numpy(x), torch.from_numpy(y))
    assert got == pytest.approx(ref_vci(x, y), abs=1e-9)


# -- deviation bound -----------------------------------------------------------------------------------------
def test_deviation_bound_hand_case():
    # class 0: (1,0), (2,0); class 1: (1,1). P^(0) = (0.7, 0.3), P^(1) = (0.3, 0.7); Phi = (1.5, sqrt 2).
    # x0: (0.3 * 1.5 * 2 * 1) / (0.3 * sqrt2 * 1 * 1/sqrt2) = 3
    # x2: (0.3 * sqrt2 * 1) / (0.3 * 1.5 * 2 / sqrt2) = 2/3
    phi = torch.tensor([[1.0, 0.0], [2.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4], [0.3, 0.7]], dtype=torch.float64)
    d = deviation_bound(phi, probs, torch.tensor([0, 0, 1]))
    assert d.dtype == torch.float64
    np.testing.assert_allclose(d.numpy(), [3.0, 3.0, 2.0 / 3.0], rtol=1e-12)
    scaled = deviation_bound(7.0 * phi, probs, torch.tensor([0, 0, 1]))
    np.testing.assert_allclose(scaled.numpy(), d.numpy(), rtol=1e-12)
    alone = deviation_bound(phi, probs, torch.tensor([1, 1, 1]))  # no other class: nothing can deviate
    assert torch.isinf(alone).all()
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        deviation_bound(phi, probs, torch.tensor([0, 0, 2]))


def test_deviation_bound_matches_reference():
    rng = np.random.default_rng(3)
    n, d, c = 40, 6, 5
    y = rng.integers(0, c - 1, n)  # class 4 absent: it adds nothing
    phi = np.abs(rng.normal(size=(n, d))) + np.abs(rng.normal(size=(c, d)))[y]
    logits = rng.normal(size=(n, c))
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    got = deviation_bound(torch.from_numpy(phi), torch.from_numpy(p), torch.from_numpy(y))
    np.testing.assert_allclose(got.numpy(), ref_deviation(phi, p, y, c), rtol=1e-10)


# -- the monitoring callback ---------------------------------------------------------------------------------
MONITOR = """trainer:
  callbacks:
    - class_path: fedrcl.analysis.RepresentationMonitor
      init_args: {{every_n_rounds: {every}, num_samples: 300, include_local: {local}, deviation: {deviation}}}
"""


def _monitor_config(tmp_path: Path, every=1, local=True, deviation=True) -> str:
    path = tmp_path / "monitor.yaml"
    path.write_text(MONITOR.format(every=every, local=str(local).lower(), deviation=str(deviation).lower()))
    return str(path)


@pytest.mark.slow
def test_monitor_logs_each_level_and_leaves_training_unchanged(data_root, tmp_path):
    one_client = ("--trainer.clients_per_round", "1")  # the last local model is then the new global model
    plain = run_cli(data_root, tmp_path / "plain", *one_client, model="fedrcl.algorithms.FedAvg")
    cli = run_cli(data_root, tmp_path / "monitored", "--config", _monitor_config(tmp_path), *one_client,
                  model="fedrcl.algorithms.FedAvg")
    # the monitor draws no random numbers and changes no weights
    for key, value in plain.model.state_dict().items():
        assert torch.equal(value, cli.model.state_dict()[key]), key

    curves = load_scalars(cli.trainer.logger.log_dir)
    dims = cli.model.backbone.feature_dims
    for prefix in ("repr", "repr/local"):
        for level, dim in enumerate(dims):
            tag = f"{prefix}/level{level}"
            assert curves[f"{tag}/effective_rank"][0].tolist() == [1, 2]  # x-axis is the round
            assert all(1.0 <= v <= dim for v in curves[f"{tag}/effective_rank"][1])
            assert all(0.0 <= v <= 1.0 for v in curves[f"{tag}/vci"][1])
            assert all(v >= 0 for v in curves[f"{tag}/within_trace"][1])
            assert all(v >= 0 for v in curves[f"{tag}/between_trace"][1])
        assert all(0.0 <= v <= 1.0 for v in curves[f"{prefix}/deviation_below_1"][1])
    assert len(curves["time/repr_seconds"][1]) == 2

    for tag, (_, values) in curves.items():  # one client: local model == aggregated global model
        if tag.startswith("repr/local/"):
            global_values = curves[tag.replace("repr/local/", "repr/", 1)][1]
            np.testing.assert_allclose(values, global_values, rtol=1e-4, atol=1e-6)

    # the logged global values are those of the final global model on the fixed test subset
    monitor = next(c for c in cli.trainer.callbacks if isinstance(c, RepresentationMonitor))
    last_client = cli.trainer.federation.plan(1).client_ids[-1]
    again = monitor.measure(cli.model.backbone, cli.datamodule, last_client)
    for tag, value in again.items():
        assert curves[tag][1][-1] == pytest.approx(value, rel=1e-5, abs=1e-6), tag
    images, labels = monitor.test_subset(cli.datamodule)
    assert len(labels) == 300
    features = cli.model.backbone(images).features[-1]
    assert again["repr/level3/vci"] == pytest.approx(variability_collapse_index(features, labels), rel=1e-5)


@pytest.mark.slow
def test_monitor_every_n_rounds_and_switches(data_root, tmp_path):
    config = _monitor_config(tmp_path, every=2, local=False, deviation=False)
    cli = run_cli(data_root, tmp_path, "--config", config, rounds=3, model="fedrcl.algorithms.FedAvg")
    curves = load_scalars(cli.trainer.logger.log_dir)
    assert curves["repr/level0/vci"][0].tolist() == [2]
    assert curves["val/acc"][0].tolist() == [1, 2, 3]
    assert not any(t.startswith("repr/local/") or "deviation" in t for t in curves)
    with pytest.raises(ValueError, match="every_n_rounds"):
        RepresentationMonitor(every_n_rounds=0)


# -- runs ----------------------------------------------------------------------------------------------------
def test_load_scalars_merges_versions(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    for version, points in ((0, {1: 0.1, 2: 0.2}), (2, {3: 0.35}), (1, {2: 0.25, 3: 0.3})):
        with SummaryWriter(tmp_path / "runA" / f"version_{version}") as writer:
            for step, value in points.items():
                writer.add_scalar("val/acc", value, step)
    (tmp_path / "empty").mkdir()
    assert list(find_runs(tmp_path)) == ["runA"]
    steps, values = load_scalars(find_runs(tmp_path, ["runA"])["runA"])["val/acc"]
    assert steps.tolist() == [1, 2, 3]
    np.testing.assert_allclose(values, [0.1, 0.25, 0.35], rtol=1e-6)  # later versions win
    with pytest.raises(ValueError, match="no run named runB"):
        find_runs(tmp_path, ["runB"])


# -- partition pictures --------------------------------------------------------------------------------------
def test_partition_counts_follow_the_training_split(data_root):
    counts = partition_counts("digits", str(data_root), num_clients=10, partition="dirichlet", alpha=0.1,
                              seed=3)
    labels = load_dataset("digits", data_root).y_train.numpy()
    expected = label_counts(labels, dirichlet_partition(labels, 10, 0.1, seed=3), 10)
    np.testing.assert_array_equal(counts, expected)


def test_plot_partition_bars():
    counts = np.array([[1, 1, 0], [5, 0, 3], [0, 2, 0]])
    for scale, heights in (("dataset", [8 / 12, 2 / 12, 2 / 12]), ("client", [1.0, 1.0, 1.0])):
        ax = plot_partition(counts, scale=scale).axes[0]
        totals = np.zeros(3)
        for bar in ax.patches:
            totals[round(bar.get_x() + bar.get_width() / 2)] += bar.get_height()
        np.testing.assert_allclose(totals, heights)  # clients sorted by size, largest first
    with pytest.raises(ValueError, match="scale"):
        plot_partition(counts, scale="global")


def test_partitions_entry_point_writes_png(data_root, tmp_path):
    out = partitions_main(["--config", str(REPO / "configs" / "quickstart.yaml"), "--root", str(data_root),
                           "--alpha", "0.05", "--out", str(tmp_path / "p.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        partitions_main(["--out", str(tmp_path / "q.png")])  # no data set named
