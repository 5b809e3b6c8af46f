"""Methods the shipped ones do not resemble, written only from the tutorial and the declared hooks, for
tests/test_semantics.py, tests/test_flower.py and tests/test_check.py (importable by path).

Each touches one thing whose timing or meaning was once a driver's choice:

- ``RunningPrior``: its server copy changes what it sends, in place, inside ``receive_upload`` (a running
  average of the clients' classifier biases, sent to every client, which pulls its mean logits towards it);
- ``StepsWeightedPrior``: the same average weighted by ``1 / client.num_steps`` in ``receive_upload``;
- ``ClientFactsLoss``: a loss that reads its own ``self.client`` (id and sample count);
- ``PerClientScale``, ``KeepsLoss``, ``BranchesOnClient``, ``DataInLoss``: what batched clients cannot run the
  same way, refused.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms import FedAvg
from fedrcl.contract import ClientContext
from fedrcl.models.output import ModelOutput


class RunningPrior(FedAvg):
    """CE plus ``pull * ||mean logits - prior||^2``; the server's ``prior`` is a running average of the
    uploaded classifier biases, updated in place as each upload arrives."""

    def __init__(self, pull: float = 0.1, **kwargs: Any):
        super().__init__(**kwargs)
        self.pull = pull
        self.prior = torch.zeros_like(list(self.backbone.parameters())[-1].detach())  # the classifier's bias
        self.received = self.prior

    def extra_download(self, client: ClientContext) -> dict[str, Tensor]:
        return {"prior": self.prior}

    def load_download(self, client: ClientContext, extra: dict[str, Tensor]) -> None:
        self.received = extra["prior"]

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        pull = (out.logits.mean(0) - self.received.to(out.logits)).pow(2).sum()
        return ce + self.pull * pull, {"ce": ce, "pull": pull}

    def extra_upload(self, client: ClientContext) -> dict[str, Tensor]:
        return {"bias": list(self.backbone.parameters())[-1].detach().clone()}

    def receive_upload(self, client: ClientContext, upload: dict[str, Tensor]) -> None:
        self.prior.mul_(0.5).add_(self.weight(client) * upload["bias"].to(self.prior))

    def weight(self, client: ClientContext) -> float:
        return 0.5


class StepsWeightedPrior(RunningPrior):
    """``RunningPrior`` whose upload weighs ``1 / num_steps`` (a FedNova-style normalisation)."""

    def weight(self, client: ClientContext) -> float:
        return 1.0 / client.num_steps


class ClientFactsLoss(FedAvg):
    """CE scaled by ``1 + client_id / 100 + num_samples / 1000``: each client's own facts."""

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        client = self.client
        assert client is not None
        ce = F.cross_entropy(out.logits, y)
        return ce * (1 + client.client_id / 100 + client.num_samples / 1000), {"ce": ce}


class PerClientScale(FedAvg):
    """Sets a per-client number in ``on_client_start`` that its loss reads: batched clients would share one."""

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        self.scale = 1.0 + client.client_id / 100

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        return self.scale * ce, {"ce": ce}


class KeepsLoss(FedAvg):
    """Stores its last loss on the algorithm from inside ``client_loss``."""

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        self.last_loss = ce
        return ce, {"ce": ce}


class BranchesOnClient(FedAvg):
    """Branches on its client's id inside ``client_loss``."""

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        client = self.client
        assert client is not None
        ce = F.cross_entropy(out.logits, y)
        return (2 * ce if client.client_id % 2 else ce), {"ce": ce}


class DataInLoss(FedAvg):
    """Reads its client's labels inside ``client_loss`` (its own data: batched, one call serves every client)."""

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        client = self.client
        assert client is not None and client.data is not None
        ce = F.cross_entropy(out.logits, y)
        return ce * (1 + client.data.labels.float().mean() / 100), {"ce": ce}
