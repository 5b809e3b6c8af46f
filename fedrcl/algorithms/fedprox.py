"""FedProx client (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

    loss = CE(f(x), y) + mu/2 * sum_i ||w_i - w_global,i||^2

over the backbone's parameters (not buffers), with ``w_global`` the weights the server broadcast this
round (``fedrcl.losses.proximal.squared_distance``). Default mu = 0.001 (FedRCL paper, supplement). ``mu`` is
sweepable (``SWEEPABLE``): ``fedrcl sweep`` trains several values together.
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
        mu: weight of the proximal term (mu/2 * squared distance); must be >= 0. Sweepable.
    """

    SWEEPABLE = ("mu",)

    def __init__(self, mu: float = 0.001, **kwargs: Any):
        super().__init__(**kwargs)
        if mu < 0:
            raise ValueError(f"model.mu must be >= 0, got {mu}")
        self.mu = mu
        self._names: list[str] = []

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        self._names = [name for name, _ in self.backbone.named_parameters()]  # once per client, not per step

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        assert self.client is not None, "on_client_start sets the client"
        ce = F.cross_entropy(out.logits, y)
        # The anchor read from the client's context at each step, not kept from its start: runs trained together
        # (seeds, a sweep's settings) see their own broadcast there (``client.global_state`` per slice).
        anchors = [self.client.global_state[name] for name in self._names]
        prox = squared_distance(self.backbone.parameters(), anchors)
        return ce + self.mu / 2 * prox, {"ce": ce, "prox": prox}
