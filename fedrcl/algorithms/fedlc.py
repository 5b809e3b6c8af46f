"""FedLC client (Zhang et al., "Federated Learning with Label Distribution Skew via Logits Calibration",
ICML 2022).

    loss = CE(f(x) - tau * n^(-1/4), y),  n_c = the client's number of training labels of class c

(``fedrcl.losses.logit_calibration``). Classes the client does not hold (n_c = 0) get an infinite offset:
they drop out of its softmax, so local training leaves their logits alone (see that module). The counts
are computed once per client, on the device, from its own labels (``client.data``). Default tau = 1 (FedRCL
paper, supplement).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms.fedavg import FedAvg
from fedrcl.contract.context import ClientContext
from fedrcl.losses.logit_calibration import calibrated_cross_entropy
from fedrcl.models.output import ModelOutput


class FedLC(FedAvg):
    """Cross-entropy on logits calibrated by the client's label counts.

    Args:
        tau: calibration strength (0 gives plain cross-entropy); must be >= 0. Sweepable (``fedrcl sweep`` trains
            several values together).
    """

    SWEEPABLE = ("tau",)

    def __init__(self, tau: float = 1.0, **kwargs: Any):
        super().__init__(**kwargs)
        if tau < 0:
            raise ValueError(f"model.tau must be >= 0, got {tau}")
        self.tau = tau

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        assert client.data is not None, "the round hands a training client its data"
        client.tensors["class_counts"] = torch.bincount(client.data.labels, minlength=client.data.num_classes)

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        assert self.client is not None, "a client's run"
        loss = calibrated_cross_entropy(out.logits, y, self.client.tensors["class_counts"], self.tau)
        return loss, {"ce_calibrated": loss, "ce": F.cross_entropy(out.logits.detach(), y)}
