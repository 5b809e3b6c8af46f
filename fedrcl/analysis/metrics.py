"""Representation metrics of the FedRCL paper (Section 3, Figures 2-3), as pure functions.

Features are a matrix ``[N, D]`` (one row per sample), labels an int vector ``[N]``. Everything is
computed in float64 whatever the input dtype, on the input's device; inputs are never modified.

- ``effective_rank(A)`` (paper, Definition 2; Roy & Vetterli 2007): with singular values ``s_k`` of
  ``A`` and ``p_k = s_k / sum_i s_i``, ``exp(-sum_k p_k log p_k)``.
- ``class_covariances(F, y)``: population (divide by N) within-class, between-class and total covariance,
  ``Sigma_W = 1/N sum_c sum_{i in c} (f_i - mu_c)(f_i - mu_c)^T``,
  ``Sigma_B = sum_c (N_c / N) (mu_c - mu)(mu_c - mu)^T``, ``Sigma_T = Sigma_W + Sigma_B``.
- ``variability_collapse_index(F, y)`` (Xu et al. 2023): ``1 - Tr(pinv(Sigma_T) Sigma_B) / rank(Sigma_B)``.
- ``deviation_bound(F, probs, y)`` (paper, Definition 1): the sample-wise deviation bound ``D(x)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["effective_rank", "class_covariances", "variability_collapse_index", "deviation_bound"]


def _check_features(features: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    if features.ndim != 2:
        raise ValueError(f"features must be [N, D], got shape {tuple(features.shape)}")
    if labels.ndim != 1 or labels.shape[0] != features.shape[0]:
        raise ValueError(f"labels must be [N] with N = {features.shape[0]}, got shape {tuple(labels.shape)}")
    if features.shape[0] == 0:
        raise ValueError("features must hold at least one sample")
    return features.detach().to(torch.float64), labels.detach().long()


def effective_rank(matrix: Tensor) -> float:
    """Effective rank of a matrix (paper, Definition 2): exp of the entropy of its normalised singular values.

    It lies in ``[1, rank(A)]`` for a non-zero matrix: ``n`` for a multiple of the ``n x n`` identity,
    1 for a rank-one matrix; it does not change when ``A`` is scaled. The zero matrix gives 0.

    Args:
        matrix: any real ``[m, n]`` matrix (the monitor passes the feature covariance ``Sigma_T``).
    """
    if matrix.ndim != 2:
        raise ValueError(f"matrix must be 2-D, got shape {tuple(matrix.shape)}")
    s = torch.linalg.svdvals(matrix.detach().to(torch.float64))
    total = s.sum()
    if not total > 0:
        return 0.0
    p = s / total
    p = p[p > 0]  # 0 log 0 = 0
    return float(torch.exp(-(p * p.log()).sum()))


def class_covariances(features: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Population within-class, between-class and total covariance of ``features`` (float64 ``[D, D]``).

    ``between`` weights each class mean by the class's share of the samples, so ``total = within +
    between`` is the population covariance of all features (the law of total covariance). Only classes
    present in ``labels`` count.

    Args:
        features: ``[N, D]``.
        labels: ``[N]`` integer class of each row.

    Returns:
        ``(within, between, total)``.
    """
    x, y = _check_features(features, labels)
    n = x.shape[0]
    _, inverse, counts = torch.unique(y, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, inverse, x)
    counts = counts.to(x.dtype)
    means = sums / counts.unsqueeze(1)
    centered = x - means[inverse]
    within = centered.T @ centered / n
    offsets = means - x.mean(0)
    between = (offsets.T * (counts / n)) @ offsets
    return within, between, within + between


def _vci(between: Tensor, total: Tensor) -> float:
    rank = int(torch.linalg.matrix_rank(between, hermitian=True))
    if rank == 0:
        return 1.0  # class means coincide: the limit of VCI as the between-class variance vanishes
    return float(1.0 - torch.trace(torch.linalg.pinv(total, hermitian=True) @ between) / rank)


def variability_collapse_index(features: Tensor, labels: Tensor) -> float:
    """Variability collapse index (Xu et al. 2023): ``1 - Tr(pinv(Sigma_T) Sigma_B) / rank(Sigma_B)``.

    It lies in ``[0, 1]``; lower means more transferable features. 0 when the within-class variance
    vanishes (every sample sits on its class mean); close to 1 when the class means barely differ compared
    with the spread of the features; exactly 1 when they coincide (``rank(Sigma_B) = 0``, the limit of the
    formula). Unchanged by any invertible affine map of the features. Ranks and the pseudo-inverse use
    torch's default float64 tolerances.

    Args:
        features: ``[N, D]``.
        labels: ``[N]`` integer class of each row.
    """
    _, between, total = class_covariances(features, labels)
    return _vci(between, total)


def deviation_bound(features: Tensor, probs: Tensor, labels: Tensor) -> Tensor:
    """The sample-wise deviation bound ``D(x)`` of every sample (paper, Definition 1), float64 ``[N]``.

    For ``x`` of class ``r`` among the given samples (a client's data set ``O``, ``O_y`` its class ``y``)::

        D(x) = (1 - P_r^(r)) Phi_r |O_r| S_r(x) / sum_{j != r} P_r^(j) Phi_j |O_j| S_j(x)

    with ``P_z^(y)`` the mean predicted probability of class ``z`` over ``O_y``, ``Phi_y`` the mean feature
    2-norm over ``O_y`` and ``S_y(x)`` the mean cosine similarity of ``x``'s feature to the features of
    ``O_y`` (``x`` itself included when ``y = r``; the paper's derivation factors the norms out of the inner
    product, leaving the cosine). Classes absent from ``labels`` add nothing. ``D(x) < 1`` marks a sample
    whose classifier update is prone to deviate (Proposition 1). When no other class is present the
    denominator is 0 and ``D(x)`` is ``inf`` (``nan`` if the numerator is 0 too). The paper's features are
    the classifier's input (non-negative after ReLU), which keeps ``S`` and ``D`` non-negative.

    Args:
        features: ``[N, D]`` the classifier's input ``phi(x)`` of each sample.
        probs: ``[N, C]`` predicted class probabilities (softmax of the logits).
        labels: ``[N]`` integer class of each sample, in ``[0, C)``.
    """
    x, y = _check_features(features, labels)
    if probs.ndim != 2 or probs.shape[0] != x.shape[0]:
        raise ValueError(f"probs must be [N, C] with N = {x.shape[0]}, got shape {tuple(probs.shape)}")
    p = probs.detach().to(torch.float64)
    num_classes = p.shape[1]
    if y.min() < 0 or y.max() >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{int(y.min())}, {int(y.max())}]")
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=x.device)  # noqa: E731
    counts = torch.bincount(y, minlength=num_classes).to(torch.float64)  # |O_y|
    per_class = counts.clamp(min=1)
    # mean_probs[y, z] = P_z^(y); similarity_sums[n, y] = |O_y| S_y(x_n)
    mean_probs = zeros(num_classes, num_classes).index_add_(0, y, p) / per_class.unsqueeze(1)
    mean_norms = zeros(num_classes).index_add_(0, y, x.norm(dim=1)) / per_class  # Phi_y
    unit = F.normalize(x, dim=1)
    similarity_sums = unit @ zeros(num_classes, x.shape[1]).index_add_(0, y, unit).T
    # terms[n, j] = P_r^(j) Phi_j |O_j| S_j(x_n), with r = y[n]
    terms = mean_probs[:, y].T * mean_norms * similarity_sums
    others = terms.scatter(1, y.unsqueeze(1), 0.0).sum(1)
    numerator = (1 - mean_probs[y, y]) * mean_norms[y] * similarity_sums.gather(1, y.unsqueeze(1)).squeeze(1)
    return numerator / others
