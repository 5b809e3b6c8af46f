"""Relaxed contrastive loss of FedRCL.

Reference: S. Seo, J. Kim, G. Kim, B. Han, "Relaxed Contrastive Learning for
Federated Learning", CVPR 2024.

With cosine similarities ``s`` of L2-normalised features, temperature ``t``
and same-class partners ``P_i`` of anchor ``i``, the loss is

    L = mean_i [ SCL_i + beta * log(1 + sum_{j in P_i, s_ij >= threshold} exp((s_ij - s_ii) / t)) ],

where ``SCL_i`` is the supervised contrastive term. The divergence penalty
pushes apart same-class pairs that are already too similar, which counters
representation collapse on local client data.

The hard-mining form (``pos_topk``/``neg_topk``) and the rule that an anchor
with no same-class partner in the batch is its own positive are taken from
the authors' released training code rather than the paper's equation; the
all-pairs form of the paper is available with ``pos_topk=neg_topk=None``.

Everything is computed with masks and fixed shapes, so the functions run
under ``torch.func.vmap``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _masked(x: Tensor, keep: Tensor) -> Tensor:
    """``x`` where ``keep``, a huge negative finite value elsewhere."""
    return x.masked_fill(~keep, torch.finfo(x.dtype).min / 2)


def _lse_with_zero(x: Tensor) -> Tensor:
    """``log(1 + sum(exp(x), -1))``, computed stably."""
    return torch.logsumexp(torch.cat([torch.zeros_like(x[..., :1]), x], dim=-1), dim=-1)


def _validate(features: Tensor, labels: Tensor, temperature: float, pos_topk: int | None,
              neg_topk: int | None) -> None:
    if features.dim() != 2:
        raise ValueError(f"features must be 2-D [B, D], got shape {tuple(features.shape)}")
    if labels.dim() != 1 or labels.shape[0] != features.shape[0]:
        raise ValueError(
            f"labels must have shape [{features.shape[0]}], got {tuple(labels.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if (pos_topk is None) != (neg_topk is None):
        raise ValueError(
            "pos_topk and neg_topk must both be None (all-pairs form) or both be "
            f"integers (hard-mining form), got pos_topk={pos_topk}, neg_topk={neg_topk}"
        )
    for name, k in (("pos_topk", pos_topk), ("neg_topk", neg_topk)):
        if k is not None and k < 1:
            raise ValueError(f"{name} must be >= 1, got {k}")


def _hard_mining_terms(
    s: Tensor, same: Tensor, partners: Tensor, t: float, threshold: float, pos_topk: int, neg_topk: int
) -> tuple[Tensor, Tensor]:
    n = s.shape[0]
    big = torch.finfo(s.dtype).max / 2
    kp, kn = min(pos_topk, n), min(neg_topk, n)

    # Positives: the kp least similar same-class samples, the anchor included.
    pos_idx = s.masked_fill(~same, big).topk(kp, dim=1, largest=False).indices
    pos_valid = same.gather(1, pos_idx)
    pos_logit = s.gather(1, pos_idx) / t  # [B, kp]

    # Negatives: the kn most similar other-class samples.
    neg_idx = s.masked_fill(same, -big).topk(kn, dim=1).indices
    neg_logit = _masked(s.gather(1, neg_idx) / t, ~same.gather(1, neg_idx))  # [B, kn]

    # -log(e^p / (e^p + sum_n e^n)) = log(1 + sum_n e^(n - p)).
    per_pos = _lse_with_zero(neg_logit.unsqueeze(1) - pos_logit.unsqueeze(2))  # [B, kp]
    per_pos = torch.where(pos_valid, per_pos, torch.zeros_like(per_pos))
    scl = per_pos.sum(1) / pos_valid.sum(1)  # at least the anchor itself is valid

    # Penalty: the kp least similar partners (anchor excluded) above threshold.
    part_idx = s.masked_fill(~partners, big).topk(kp, dim=1, largest=False).indices
    part_sim = s.gather(1, part_idx)
    kept = partners.gather(1, part_idx) & (part_sim >= threshold)
    penalty = _lse_with_zero(_masked((part_sim - s.diagonal().unsqueeze(1)) / t, kept))
    return scl, penalty


def _all_pairs_terms(
    s: Tensor, partners: Tensor, eye: Tensor, t: float, threshold: float
) -> tuple[Tensor, Tensor]:
    logits = s / t
    log_denom = torch.logsumexp(_masked(logits, ~eye), dim=1, keepdim=True)
    per_pair = torch.where(partners, log_denom - logits, torch.zeros_like(logits))
    scl = per_pair.sum(1) / partners.sum(1).clamp_min(1)

    kept = partners & (s >= threshold)
    penalty = _lse_with_zero(_masked((s - s.diagonal().unsqueeze(1)) / t, kept))
    return scl, penalty


def relaxed_contrastive_terms(
    features: Tensor,
    labels: Tensor,
    *,
    temperature: float = 0.05,
    threshold: float = 0.7,
    pos_topk: int | None = 1,
    neg_topk: int | None = 2,
) -> tuple[Tensor, Tensor]:
    """(mean SCL term, mean divergence penalty) over the batch's anchors.

    ``features`` is ``[B, D]`` (rows are L2-normalised here, in at least
    float32), ``labels`` is ``[B]``. ``pos_topk=neg_topk=None`` selects the
    paper's all-pairs form; integers select the released code's hard mining.
    """
    _validate(features, labels, temperature, pos_topk, neg_topk)
    if features.dtype != torch.float64:
        features = features.float()
    with torch.autocast(device_type=features.device.type, enabled=False):
        z = F.normalize(features, dim=1)
        s = z @ z.T
        n = s.shape[0]
        same = labels.unsqueeze(0) == labels.unsqueeze(1)
        eye = torch.eye(n, dtype=torch.bool, device=s.device)
        partners = same & ~eye
        if pos_topk is None:
            scl, penalty = _all_pairs_terms(s, partners, eye, temperature, threshold)
        else:
            assert neg_topk is not None  # _validate: both or neither
            scl, penalty = _hard_mining_terms(
                s, same, partners, temperature, threshold, pos_topk, neg_topk
            )
        return scl.mean(), penalty.mean()


def relaxed_contrastive_loss(
    features: Tensor,
    labels: Tensor,
    *,
    temperature: float = 0.05,
    threshold: float = 0.7,
    beta: float = 1.0,
    pos_topk: int | None = 1,
    neg_topk: int | None = 2,
) -> Tensor:
    """scl + beta * penalty (scalar). beta=0 is plain supervised contrastive learning."""
    scl, penalty = relaxed_contrastive_terms(
        features,
        labels,
        temperature=temperature,
        threshold=threshold,
        pos_topk=pos_topk,
        neg_topk=neg_topk,
    )
    return scl + beta * penalty
