"""FedProx client (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

    loss = CE(f(x), y) + mu/2 * sum_i ||w_i - w_global,i||^2

over the backbone's parameters (not buffers), with ``w_global`` the weights the server broadcast this
round (``fedrcl.losses.proximal.squared_distance``). Default mu = 0.001 (FedRCL paper, supplement).
"""
from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms.fedavg import FedAvg
from fedrcl.contract.context import ClientContext
from fedrcl.losses.proximal import squared_distance
from fedrcl.models.output import ModelOutput


class FedProx(FedAvg):
    """Cross-entropy plus a proximal term towards the round's global weights.

    Args:
        mu: weight of the proximal term (mu/2 * squared distance); must be >= 0.
    """

    def __init__(self, mu: float = 0.001, **kwargs: Any):
        super().__init__(**kwargs)
        if mu < 0:
            raise ValueError(f"model.mu must be >= 0, got {mu}")
        self.mu = mu
        self._anchors: list[Tensor] = []

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        # The broadcast tensors, in parameter order, looked up once per client rather than per step.
        self._anchors = [client.global_state[name] for name, _ in self.backbone.named_parameters()]

    def on_client_end(self, client: ClientContext) -> None:
        self._anchors = []  # do not keep the round's broadcast alive after it

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        prox = squared_distance(self.backbone.parameters(), self._anchors)
        return ce + self.mu / 2 * prox, {"ce": ce, "prox": prox}
