"""Methods that change the step or keep server state across rounds' starts, for tests/test_client_direction.py
(importable by path, as ``--model step_methods.NAME`` with ``tests`` on ``PYTHONPATH``).

- ``SharpnessAware``: a SAM-style step through ``client_direction`` (the gradient at ``w + rho g / ||g||``);
- ``GradientThroughHook``: ``client_direction`` overridden with the default (the gradient of the loss), so that
  the hook's path can be compared with the plain loss path;
- ``DownloadMemory``: a FedCM-like method whose server copy changes state inside ``extra_download`` (it keeps the
  previous broadcast and sends the last global update), pulled towards it by a linear term;
- ``BeginMemory``: the same with the state changed in ``begin_server_round``;
- ``CountsLrPerStep``: a per-step Lightning hook (``on_before_optimizer_step``), which seeds together refuse;
- ``DownloadMemoryShared``, ``BeginMemoryShared``: those two whose loss reads what the downlink installed directly
  (not the client's ``client.tensors``), so that seeds together part from round 2;
- ``DirectionMemoryShared``: the same pull as a term of its step (``client_direction``), not of its loss: only the
  seeds' step directions tell them apart.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms import FedAvg
from fedrcl.contract import ClientContext
from fedrcl.models.output import ModelOutput


class SharpnessAware(FedAvg):
    """The gradient at the point ``w + rho g / ||g||`` (``g`` the gradient at ``w``), with the loss at ``w``."""

    def __init__(self, rho: float = 0.05, **kwargs: Any):
        super().__init__(**kwargs)
        self.rho = rho

    def client_direction(self, params, x, y):
        g, loss, parts = self.loss_gradient(params, x, y)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in g.values()]))
        perturbed = {k: p + self.rho * g[k] / (norm + 1e-12) for k, p in params.items()}
        g2, _, _ = self.loss_gradient(perturbed, x, y)
        return g2, loss, parts


class GradientThroughHook(FedAvg):
    """FedAvg whose step goes through ``client_direction`` (the default direction, written out)."""

    def client_direction(self, params, x, y):
        return self.loss_gradient(params, x, y)


def _flat(tensors: dict[str, Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors.values()])


class DownloadMemory(FedAvg):
    """CE + ``pull * <delta, theta>``, ``delta`` the last global update; the server copy computes it at the round's
    first download and keeps the broadcast for the next round (state changed in ``extra_download``)."""

    def __init__(self, pull: float = 0.5, **kwargs: Any):
        super().__init__(**kwargs)
        self.pull = pull
        self._previous: Optional[dict[str, Tensor]] = None
        self._advanced = False  # this round's update computed (not checkpointed: a round's end resets it)
        self._last = torch.zeros(0)
        self._received = torch.zeros(0)

    def _advance(self, global_state: Any) -> None:
        names = [n for n, _ in self.backbone.named_parameters()]
        now = {n: global_state[n].detach().clone() for n in names}
        self._last = _flat({n: now[n] - self._previous[n] for n in names}) if self._previous is not None \
            else torch.zeros_like(_flat(now))
        self._previous = now

    def extra_download(self, client: ClientContext) -> dict[str, Tensor]:
        if not self._advanced:
            self._advance(client.global_state)
            self._advanced = True
        return {"delta": self._last}

    def end_server_round(self, reduce: Any = None) -> None:
        self._advanced = False

    def load_download(self, client: ClientContext, extra: dict[str, Tensor]) -> None:
        self._received = extra["delta"]

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        client.tensors["delta"] = self._received.clone()

    def pulled(self) -> Tensor:
        return self.client.tensors["delta"]

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        pull = self.pull * (_flat(dict(self.backbone.named_parameters())) * self.pulled()).sum()
        return ce + pull, {"ce": ce}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["memory"] = {"previous": copy.deepcopy(self._previous), "last": self._last.clone()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        memory = checkpoint.get("memory")
        if memory is not None:
            self._previous = copy.deepcopy(memory["previous"])
            self._last = memory["last"].clone()


class BeginMemory(DownloadMemory):
    """``DownloadMemory`` whose server copy advances in ``begin_server_round`` (before any downlink)."""

    def begin_server_round(self, round_idx: int, global_state: Any) -> None:
        self._advance(global_state)

    def extra_download(self, client: ClientContext) -> dict[str, Tensor]:
        return {"delta": self._last}


class DownloadMemoryShared(DownloadMemory):
    """``DownloadMemory`` whose loss reads the installed ``delta`` itself: one algorithm object cannot give each
    seed its own, so seeds together part once the deltas differ (round 2)."""

    def pulled(self) -> Tensor:
        return self._received


class BeginMemoryShared(BeginMemory):
    """``BeginMemory`` whose loss reads the installed ``delta`` itself (seeds together part from round 2)."""

    def pulled(self) -> Tensor:
        return self._received


class CountsLrPerStep(FedAvg):
    """FedAvg that sums its lrs in ``on_before_optimizer_step`` (as SCAFFOLD once did): a per-step Lightning hook."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.lr_sum = getattr(self, "lr_sum", 0.0) + optimizer.param_groups[0]["lr"]


class DirectionMemoryShared(DownloadMemory):
    """``DownloadMemory`` whose pull is a term of its step, not of its loss: ``client_direction`` adds ``pull *
    delta``, reading the installed ``delta`` itself; its loss is plain cross-entropy, so only the seeds' step
    directions differ (from round 2), and seeds together part then."""

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        return ce, {"ce": ce}

    def client_direction(self, params, x, y):
        g, loss, parts = self.loss_gradient(params, x, y)
        pulls = torch.split(self.pull * self._received, [t.numel() for t in g.values()])
        return {k: t + p.view_as(t) for (k, t), p in zip(g.items(), pulls)}, loss, parts
