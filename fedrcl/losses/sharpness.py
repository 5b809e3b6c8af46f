"""The perturbation of sharpness-aware minimisation (SAM: Foret et al., ICLR 2021; ASAM: Kwon et al., ICML 2021),
as FedSAM and FedASAM take it into the clients' local steps (Qu et al., ICML 2022; Caldarola et al., ECCV 2022).

SAM's local step descends the gradient at the worst point of a ball of radius ``rho`` around ``w``, to first order

    eps = rho * g / ||g||                         (g = grad L(w); the step direction is grad L(w + eps))

ASAM makes the ball scale-invariant with the elementwise operator ``T_w = |w| + eta`` (weights; 1 for biases, as
the ASAM authors' code):

    eps = rho * T_w^2 g / ||T_w g||
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

import torch
from torch import Tensor


def global_norm(tensors: Sequence[Tensor]) -> Tensor:
    """The 2-norm of all ``tensors`` together (one vector)."""
    norm: Tensor = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))
    return norm


def asam_scale(params: Mapping[str, Tensor], eta: float) -> dict[str, Tensor]:
    """ASAM's ``T_w``: ``|w| + eta`` per element of every weight, 1 for a bias (a name ending in ``bias``)."""
    return {k: torch.ones_like(p) if k.endswith("bias") else p.abs() + eta for k, p in params.items()}


def sam_perturbation(grads: Mapping[str, Tensor], rho: float, scale: Optional[Mapping[str, Tensor]] = None
                     ) -> dict[str, Tensor]:
    """SAM's ``rho g / ||g||``, or with ``scale`` (``T_w``, ``asam_scale``) ASAM's ``rho T^2 g / ||T g||``, per
    tensor; tensor operations only (no host sync), so it maps over clients. A zero gradient gives ``eps = 0``."""
    scaled = dict(grads) if scale is None else {k: scale[k] * g for k, g in grads.items()}
    factor = rho / (global_norm(list(scaled.values())) + 1e-12)
    return {k: factor * (t if scale is None else scale[k] * t) for k, t in scaled.items()}
