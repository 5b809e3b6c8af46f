"""Methods the shipped ones do not resemble, written only from the tutorial and the declared hooks, for
tests/test_semantics.py, tests/test_flower.py and tests/test_check.py (importable by path).

Each touches one thing whose timing or meaning was once a driver's choice:

- ``RunningPrior``: its server copy changes what it sends, in place, inside ``receive_upload`` (a running
  average of the clients' classifier biases, sent to every client, which pulls its mean logits towards it);
- ``StepsWeightedPrior``: the same average weighted by ``1 / client.num_steps`` in ``receive_upload``;
- ``ClientFactsLoss``: a loss that reads its own ``self.client`` (id and sample count);
- ``PerClientTensor``: ``PerClientScale`` written as the contract asks (its number in ``client.tensors``);
- ``CountsOwnSteps``: a step that changes a dict of its client's tensors in place (a step count that scales the
  step), which its end reads;
- ``PerClientScale``, ``KeepsLoss``, ``BranchesOnClient``, ``DataInLoss``, ``UnevenTensors``,
  ``LossReplacesTensor``: what batched clients cannot run the same way, refused.
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


class PerClientTensor(FedAvg):
    """``PerClientScale`` with its number put in the client's tensors, where batched clients each get their own."""

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        client.tensors["scale"] = torch.tensor(1.0 + client.client_id / 100)

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        assert self.client is not None
        ce = F.cross_entropy(out.logits, y)
        return self.client.tensors["scale"] * ce, {"ce": ce}


class CountsOwnSteps(FedAvg):
    """The gradient scaled by ``1 + steps / 10``, ``steps`` the client's steps so far, counted in a dict of its
    tensors changed in place at every step; its end checks the count against its planned steps."""

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        client.tensors["count"] = {"steps": torch.zeros((), dtype=torch.float64)}

    def client_direction(self, params, x, y):
        assert self.client is not None
        count = self.client.tensors["count"]
        g, loss, parts = self.loss_gradient(params, x, y)
        scale = 1 + count["steps"] / 10
        count["steps"] = count["steps"] + 1
        return {k: t * scale.to(t.dtype) for k, t in g.items()}, loss, parts

    def on_client_end(self, client: ClientContext) -> None:
        steps = int(client.tensors["count"]["steps"])
        if steps != client.num_steps:
            raise AssertionError(f"client {client.client_id} counted {steps} steps, planned {client.num_steps}")


class UnevenTensors(FedAvg):
    """Puts a tensor of another shape in every other client's tensors: no stacked axis holds them."""

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        client.tensors["extra"] = torch.zeros(1 + client.client_id % 2)


class LossReplacesTensor(PerClientTensor):
    """Replaces one of its client's tensors inside ``client_loss`` (a loss keeps no state)."""

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        assert self.client is not None
        loss, parts = super().client_loss(x, y, out)
        self.client.tensors["scale"] = self.client.tensors["scale"] * 1.01
        return loss, parts


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
