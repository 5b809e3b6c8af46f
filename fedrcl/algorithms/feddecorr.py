"""FedDecorr client (Shi et al., "Towards Understanding and Mitigating Dimensional Collapse in
Heterogeneous Federated Learning", ICLR 2023).

    loss = CE(f(x), y) + beta * ||K||_F^2 / d^2,  K = correlation matrix of the batch's representations

(``fedrcl.losses.decorrelation``). The representation is the backbone's last feature level: for
ResNet-18 the pooled output of the last stage, for SmallCNN the last hidden layer, in both cases taken
before its ReLU (the ``ModelOutput`` contract). The paper regularises the classifier's input, which is
the same tensor after the ReLU; the pre-ReLU form keeps negative directions that the ReLU would hide and
is the representation the rank/VCI analysis of this project measures. Default beta = 0.01 (FedRCL paper,
supplement).
"""
from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms.fedavg import FedAvg
from fedrcl.losses.decorrelation import decorrelation_loss
from fedrcl.models.output import ModelOutput


class FedDecorr(FedAvg):
    """Cross-entropy plus a penalty on the correlations between representation dimensions.

    Args:
        beta: weight of the decorrelation penalty; must be >= 0. Sweepable (``fedrcl sweep`` trains several values
            together).
    """

    SWEEPABLE = ("beta",)

    def __init__(self, beta: float = 0.01, **kwargs: Any):
        super().__init__(**kwargs)
        if beta < 0:
            raise ValueError(f"model.beta must be >= 0, got {beta}")
        self.beta = beta

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        decorr = decorrelation_loss(out.features[-1])
        return ce + self.beta * decorr, {"ce": ce, "decorr": decorr}
