"""FedCM client (Xu et al., "FedCM: Federated Learning with Client-level Momentum", 2021, Algorithm 1): every
local step mixes the client's gradient with the last global update, which the server sends with the weights.

    Delta_t = (x_{t-1} - x_t) / sum_k eta_k          (round t-1's global update over its K local steps' lrs)
    v = alpha * grad F_i(w) + (1 - alpha) * Delta_t,   w <- w - lr * v

(``fedrcl.losses.client_momentum``; ``Delta_0 = 0``.) With FedAvg's server and a constant lr ``Delta_t`` is the
paper's ``-(1 / (eta_l K)) mean_i (y_i - x_{t-1})``; with another server optimizer it is its own last update (the
paper's global step ``eta_g`` is FedAvg's 1). ``F_i`` is the method's local loss (the server's client term
included); the engine clips ``v``, adds weight decay and momentum and steps, as for a gradient.

The server's copy computes ``Delta_t`` when round t begins (``begin_server_round``, from the round's global
weights and the previous round's, kept in the checkpoint) and sends it to every client (``extra_download``):
twice FedAvg's download, counted in ``comm/``. Every client takes the same ``K`` steps, as in the paper
(``data.local_iters_per_epoch`` set; null is refused). Execution: each client's ``Delta`` is in its
``client.tensors``, so batched clients and seeds together stack it (each seed's clients get their seed's).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor

from fedrcl.algorithms.fedavg import FedAvg, Tensors
from fedrcl.contract.context import ClientContext
from fedrcl.data.datamodule import datamodule_of
from fedrcl.losses.client_momentum import global_update_direction, momentum_direction


def unflatten(flat: Tensor, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``flat`` cut into tensors shaped as ``like``'s, in its order (a view each: mappable)."""
    pieces = torch.split(flat, [t.numel() for t in like.values()])
    return {k: piece.view(t.shape) for (k, t), piece in zip(like.items(), pieces)}


class FedCM(FedAvg):
    """FedAvg's loss, each step along ``alpha g + (1 - alpha) Delta`` (see the module docstring).

    Args:
        alpha: the gradient's share of the local direction, in (0, 1] (1 is FedAvg). Xu et al.: 0.1.
    """

    def __init__(self, alpha: float = 0.1, **kwargs: Any):
        super().__init__(**kwargs)
        if not 0 < alpha <= 1:
            raise ValueError(f"model.init_args.alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._previous: Optional[dict[str, Tensor]] = None  # the server copy's x_{t-1} ...
        self._previous_round = -1  # ... and its round
        self._global_delta = torch.zeros(0)  # what this round sends
        self._received = torch.zeros(0)  # what the client's copy installed

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit" and datamodule_of(self.trainer).local_iters_per_epoch is None:
            raise ValueError(f"model {type(self).__name__} needs data.local_iters_per_epoch set: its Delta is the "
                             "global update over the round's K local steps, the same K for every client (got null)")

    def round_lr_sum(self, round_idx: int) -> float:
        """``sum_k eta_k`` over round ``round_idx``'s local steps (every client's: the same K)."""
        trainer: Any = self.trainer  # a FederatedTrainer (its federation's local epochs)
        per_epoch = datamodule_of(trainer).local_iters_per_epoch
        assert per_epoch is not None  # refused in setup
        return sum(per_epoch * float(self.client_lr(round_idx, e)) for e in range(trainer.federation.local_epochs))

    def begin_server_round(self, round_idx: int, global_state: Mapping[str, Tensor]) -> None:
        """The server's copy: ``Delta_t`` from the round's global weights and the last round's."""
        current = {n: global_state[n].detach().clone() for n, _ in self.backbone.named_parameters()}
        previous = self._previous
        if previous is None:
            self._global_delta = torch.zeros_like(torch.cat([t.reshape(-1) for t in current.values()]))
        else:
            lr_sum = self.round_lr_sum(self._previous_round)
            self._global_delta = torch.cat([global_update_direction(previous[n], t, lr_sum).reshape(-1)
                                            for n, t in current.items()])
        self._previous, self._previous_round = current, round_idx

    def extra_download(self, client: ClientContext) -> dict[str, Tensor]:
        """``Delta_t``, sent with the weights."""
        return {"delta": self._global_delta}

    def load_download(self, client: ClientContext, extra: Mapping[str, Tensor]) -> None:
        """The client's copy takes ``Delta_t``."""
        self._received = extra["delta"]

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        client.tensors["momentum"] = self._received  # the training client's Delta

    def client_direction(self, params: Tensors, x: Tensor, y: Tensor) -> tuple[Tensors, Tensor, Tensors]:
        g, loss, parts = self.local_gradient(params, x, y)
        assert self.client is not None, "a client's run"
        return momentum_direction(g, unflatten(self.client.tensors["momentum"], params), self.alpha), loss, parts

    def local_gradient(self, params: Tensors, x: Tensor, y: Tensor) -> tuple[Tensors, Tensor, Tensors]:
        """The gradient that FedCM mixes with ``Delta`` (MoFedSAM: SAM's), with the loss and its parts."""
        return self.loss_gradient(params, x, y)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["fedcm_previous"] = {"round": self._previous_round, "weights": self._previous}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("fedcm_previous")
        if saved is not None:
            self._previous_round, self._previous = saved["round"], saved["weights"]
