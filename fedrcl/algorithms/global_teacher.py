"""Base of the client methods that consult the round's global model (FedNTD, FitNet, MOON, FedMLB)."""
from __future__ import annotations

from typing import Any

from fedrcl.algorithms.fedavg import FedAvg
from fedrcl.algorithms.teacher import FrozenGlobalModel
from fedrcl.contract.context import ClientContext


class GlobalTeacherClient(FedAvg):
    """FedAvg plus ``self.teacher``: a frozen copy of the weights the server broadcast this round.

    The copy is built once per run and overwritten in place at each client's start; it is a plain object,
    so it stays out of the module's ``state_dict``, its parameters and the optimizer.
    """

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.teacher = FrozenGlobalModel()

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        self.teacher.load_(self.backbone, client.global_state)
