"""FedNTD client (Lee et al., "Preservation of the Global Knowledge by Not-True Distillation in Federated
Learning", NeurIPS 2022).

    loss = CE(f(x), y) + beta * KL(softmax(g(x)_{c != y} / T) || softmax(f(x)_{c != y} / T))

with ``g`` the round's global model as a frozen teacher (``fedrcl.losses.not_true_distillation``).
The teacher is one frozen copy kept outside the module's state (``FrozenGlobalModel``), overwritten with
the broadcast weights at each client's start. Defaults beta = 0.3 (FedRCL paper, supplement), T = 1.
"""
from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms.global_teacher import GlobalTeacherClient
from fedrcl.losses.not_true_distillation import not_true_distillation
from fedrcl.models.output import ModelOutput


class FedNTD(GlobalTeacherClient):
    """Cross-entropy plus distillation of the global model's not-true-class predictions.

    Args:
        beta: weight of the not-true distillation term; must be >= 0.
        temperature: softmax temperature T of both not-true distributions; must be > 0.
    """

    def __init__(self, beta: float = 0.3, temperature: float = 1.0, **kwargs: Any):
        super().__init__(**kwargs)
        if beta < 0:
            raise ValueError(f"model.beta must be >= 0, got {beta}")
        if temperature <= 0:
            raise ValueError(f"model.temperature must be > 0, got {temperature}")
        self.beta, self.temperature = beta, temperature


    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        ntd = not_true_distillation(out.logits, self.teacher(x).logits, y, self.temperature)
        return ce + self.beta * ntd, {"ce": ce, "ntd": ntd}
