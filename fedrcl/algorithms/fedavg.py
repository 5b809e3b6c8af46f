"""FedAvg client (McMahan et al., AISTATS 2017): local SGD on cross-entropy.

    loss = CE(f(x), y)

It is the base class of every client algorithm: subclasses override ``client_loss`` and, if they keep
state across rounds or need the round's global model, ``on_client_start`` / ``on_client_end``; a method
that exchanges more than the weights overrides the hooks of ``fedrcl.contract.exchange.ClientExchange``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad
from torchmetrics.classification import MulticlassAccuracy

from fedrcl.contract.context import ClientContext
from fedrcl.data.domains import domain_accuracy_of
from fedrcl.data.validation import ACCURACIES
from fedrcl.contract.exchange import ClientExchange
from fedrcl.contract.plan import TrainedElsewhere
from fedrcl.contract.processes import sum_over_processes
from fedrcl.contract.protocols import ClientStack
from fedrcl.models.output import ModelOutput

Backbone = Callable[[int, int, int], nn.Module]
Tensors = dict[str, Tensor]


class LossAt(nn.Module):
    """``algorithm.local_loss`` as a module call, so that ``functional_call`` can evaluate it at other backbone
    weights (``FedAvg.loss_gradient``); the server's client term (``_params``) reads those weights too."""

    def __init__(self, algorithm: FedAvg):
        super().__init__()
        self.algorithm = algorithm

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensors]:
        algorithm = self.algorithm
        saved = algorithm._params
        algorithm._params = dict(algorithm.backbone.named_parameters())
        try:
            return algorithm.local_loss(x, y)
        finally:
            algorithm._params = saved


def changes_step(algorithm: Any) -> bool:
    """Whether ``algorithm`` overrides ``client_direction`` (its step is not the gradient of its loss)."""
    return getattr(type(algorithm), "client_direction", None) is not FedAvg.client_direction


class FedAvg(ClientExchange, L.LightningModule):
    """A client algorithm: the local objective and the client optimizer (paper settings by default).

    The round (``fedrcl.federated.round.ClientRun``) loads the broadcast weights into ``backbone`` at each
    client's start and calls ``on_client_start``; between rounds ``backbone`` holds the global model, which
    ``validation_step`` / ``test_step`` evaluate (top-1 accuracy and its EMA, the paper's table metric).

    Args:
        backbone: the network, given ``(num_classes, in_channels, image_size)``; returns ``ModelOutput``.
        num_classes: classes of the dataset (linked from ``data.dataset`` by the CLI).
        in_channels: image channels (linked from ``data.dataset``).
        image_size: image side in pixels (linked from ``data.dataset``).
        lr: client learning rate at round 0.
        lr_decay: the client lr is multiplied by this every round (paper: 0.998).
        local_lr_decay: also multiplied by this every local epoch inside a round (the released FedRCL code:
            0.998; 1 disables).
        momentum: SGD momentum (paper: 0).
        weight_decay: SGD weight decay on all parameters (paper: 1e-3).
        grad_clip_norm: clip the local gradient to this total 2-norm (paper: 10); null disables.
        ema_decay: smoothing of the test-accuracy curve reported as ``val/acc_ema`` (paper: 0.9).
    """

    def __init__(
        self,
        backbone: Backbone,
        num_classes: int = 10,
        in_channels: int = 3,
        image_size: int = 32,
        lr: float = 0.1,
        lr_decay: float = 0.998,
        local_lr_decay: float = 1.0,
        momentum: float = 0.0,
        weight_decay: float = 1e-3,
        grad_clip_norm: Optional[float] = 10.0,
        ema_decay: float = 0.9,
    ):
        super().__init__()
        if lr <= 0:
            raise ValueError(f"model.lr must be > 0, got {lr}")
        if not 0 <= ema_decay < 1:
            raise ValueError(f"model.ema_decay must be in [0, 1), got {ema_decay}")
        self.backbone = backbone(num_classes, in_channels, image_size)
        self.lr, self.lr_decay, self.local_lr_decay = lr, lr_decay, local_lr_decay
        self.momentum, self.weight_decay, self.grad_clip_norm = momentum, weight_decay, grad_clip_norm
        self.ema_decay = ema_decay
        self.acc_ema: Optional[float] = None  # of val/acc
        self.test_acc_ema: Optional[float] = None  # of test/acc, with a validation split (data.val_fraction)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")
        self.client: Optional[ClientContext] = None
        self.stack: Optional[ClientStack] = None  # the round's clients while they train stacked (``StackedClients``)

    def __setattr__(self, name: str, value: Any) -> None:
        """An attribute already set to a plain value (not a tensor or module) is set directly: Lightning writes
        ``_current_fx_name`` twice per hook call, about 44 times per step, and ``nn.Module.__setattr__``, which
        would end there too, first checks for parameters, buffers and submodules (2.4 us a call)."""
        if name in self.__dict__ and not isinstance(value, (Tensor, nn.Module)):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    backbone: nn.Module
    # Batched clients (``trainer.client_batching``): a reason string if the method cannot train batched (its
    # clients then train one after another). What is per client goes in ``client.tensors`` (``ClientContext``).
    unbatchable_reason: Optional[str] = None
    # Loss weights (constructor arguments kept as attributes of the same name, read only in arithmetic) that a
    # sweep may vary across runs trained together: the stacked step sets each run's value per slice.
    SWEEPABLE: tuple[str, ...] = ()

    # -- the client's objective (override in subclasses) --------------------------------------------------
    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        """The local loss of a batch and its named parts (logged as ``train/loss_<name>`` per round)."""
        ce = F.cross_entropy(out.logits, y)
        return ce, {"ce": ce}

    def client_forward(self, x: Tensor) -> ModelOutput:
        """The local model's forward pass in training (FedMLB overrides it to keep the unpooled maps)."""
        out: ModelOutput = self.backbone(x)
        return out

    def on_client_start(self, client: ClientContext) -> None:
        """A client begins local training from ``client.global_state`` (already loaded): fresh optimizer."""
        self.client = client
        self._params = dict(self.backbone.named_parameters())  # for the server's client term, once per client
        for optimizer in self.trainer.optimizers:
            optimizer.state.clear()

    def on_client_end(self, client: ClientContext) -> None:
        """A client has finished its local steps (its weights are about to be aggregated)."""

    def client_lr(self, round_idx: int, local_epoch: int) -> float:
        """Learning rate of local epoch ``local_epoch`` in round ``round_idx``."""
        return self.lr * self.lr_decay ** round_idx * self.local_lr_decay ** local_epoch

    # -- Lightning hooks ----------------------------------------------------------------------------------
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay)

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Optional[str] = None) -> None:
        if self.grad_clip_norm is None or self.stack is not None:  # stacked clients: clipped per client by the engine
            return
        self.clip_gradients(optimizer, gradient_clip_val=self.grad_clip_norm, gradient_clip_algorithm="norm")

    def local_loss(self, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """One client's loss of one batch and its parts, the server's client term included.

        Written for one client; batched clients map it over the client axis (``fedrcl.federated.batched``).
        """
        client = self.client
        assert client is not None, "local_loss runs in a client's run (on_client_start sets self.client)"
        loss, parts = self.client_loss(x, y, self.client_forward(x))
        server = client.server
        server_term = None if server is None else server.client_regularizer(self._params, client.global_state)
        if server_term is not None:  # a term the server optimizer adds to every client's loss (FedACG)
            loss, parts["server"] = loss + server_term, server_term
        return loss, parts

    def client_direction(self, params: Tensors, x: Tensor, y: Tensor) -> tuple[Tensors, Tensor, Tensors]:
        """One client's local step direction at weights ``params`` (the backbone's parameters by name) on the batch
        ``(x, y)``, with the batch's loss and its parts. The engine clips the direction per client
        (``grad_clip_norm``), adds weight decay and momentum and steps by the client lr, as it does a gradient.

        Default: the gradient of ``local_loss`` (``loss_gradient``). Override it to change the step itself (SAM:
        the gradient at a perturbed point). Written for one client, with tensor operations only: every engine
        (clients one after another, batched, seeds together) maps it. It reads the client's own inputs from
        ``self.client.tensors``, as ``client_loss`` does, and may replace one there for the next step.
        """
        return self.loss_gradient(params, x, y)

    def loss_gradient(self, params: Tensors, x: Tensor, y: Tensor) -> tuple[Tensors, Tensor, Tensors]:
        """The gradient of ``local_loss`` at ``params`` (``torch.func.grad``, so mappable), the loss and its parts.
        The backbone's buffers go in as inputs, so that a BatchNorm backbone (clients one after another) updates its
        running statistics in place, as an ordinary forward does (``torch.func`` refuses a captured one's update)."""
        at = LossAt(self)
        buffers = {f"algorithm.backbone.{k}": b for k, b in self.backbone.named_buffers()}

        def loss_of(p: Tensors, b: Tensors) -> tuple[Tensor, tuple[Tensor, Tensors]]:
            loss, parts = functional_call(at, {**{f"algorithm.backbone.{k}": v for k, v in p.items()}, **b}, (x, y))
            return loss, (loss, parts)

        grads, (loss, parts) = grad(loss_of, has_aux=True)(dict(params), buffers)
        return grads, loss.detach(), {k: v.detach() for k, v in parts.items()}

    def on_train_epoch_start(self) -> None:
        self._round_loss_sums: dict[str, Tensor] = {}
        self._round_parts: Optional[tuple[str, ...]] = None  # the part names the sums hold, in order
        self._round_steps = 0

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        if isinstance(batch, TrainedElsewhere):  # the round's clients train on Flower's nodes: no step here
            return None
        x, y = batch
        if self.stack is not None:  # every client's step at once, taken by the stacked engine
            losses, per_client = self.stack.step(x, y)
            self._add_round_losses(losses.sum(), {k: v.sum() for k, v in per_client.items()})
            self._round_steps += len(losses)
            return self.stack.lightning_loss()
        if changes_step(self):
            return self._direction_step(x, y)
        loss, parts = self.local_loss(x, y)
        self._add_round_losses(loss, parts)
        self._round_steps += 1
        return loss

    def _direction_step(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """A step of ``client_direction`` (clients one after another): the direction is computed outside autograd,
        and Lightning's backward, clipping and optimizer step run on ``sum <w, d>``, whose gradient is exactly
        ``d``; ``local_loss`` is the step's real loss (the divergence check's)."""
        params: Tensors = dict(self.backbone.named_parameters())
        with torch.no_grad():
            direction, loss, parts = self.client_direction(params, x, y)
        surrogate = torch.stack([(p * direction[name].to(p.dtype)).sum() for name, p in params.items()]).sum()
        self._add_round_losses(loss, parts)
        self._round_steps += 1
        return {"loss": surrogate, "local_loss": loss.detach()}

    def _add_round_losses(self, loss: Tensor, parts: dict[str, Tensor]) -> None:
        """Add a step's loss and its parts to the round's sums (``loss``, ``loss_<part>``), on the device: they
        are logged once per round, as per-step ``self.log`` calls cost more than a CNN step. A step with the
        parts the sums hold, in their order (every step after a round's first), is one fused in-place add."""
        sums = self._round_loss_sums
        with torch.no_grad():
            if tuple(parts) == self._round_parts:
                torch._foreach_add_(list(sums.values()), [loss, *parts.values()])
                return
            for key, value in (("loss", loss), *((f"loss_{k}", v) for k, v in parts.items())):
                sums[key] = sums[key] + value if key in sums else value + 0.0
        self._round_parts = tuple(key.removeprefix("loss_") for key in sums)[1:]  # "loss" is the first key

    def add_remote_losses(self, sums: dict[str, float], steps: int) -> None:
        """Add the summed step losses (``loss``, ``loss_<part>``) and step count of clients that trained elsewhere
        (Flower's nodes report them with each client) to the round's."""
        with torch.no_grad():
            for key, value in sums.items():
                self._round_loss_sums[key] = self._round_loss_sums.get(key, 0.0) + torch.tensor(value,
                                                                                              dtype=torch.float64)
        self._round_steps += steps

    def round_losses(self) -> tuple[dict[str, Tensor], int]:
        """This process's summed step losses of the round so far by name (``loss``, ``loss_<part>``), and its
        client steps (a Flower node reports them with each client)."""
        return dict(self._round_loss_sums), self._round_steps

    def on_train_epoch_end(self) -> None:
        # With several processes: the sums and step counts of all of them (a mean over all the round's steps).
        sums, steps = sum_over_processes(self.trainer, self._round_loss_sums, self._round_steps)
        self.log_dict({f"train/{k}": v / steps for k, v in sums.items()})

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        """One batch of an evaluation set: the first (``val/``: the validation set, or the test set without a
        validation split) or, with ``data.val_fraction``, the second (``test/``)."""
        x, y = batch
        logits = self.backbone(x).logits
        (self.val_acc if dataloader_idx == 0 else self.test_acc).update(logits, y)
        domains = domain_accuracy_of(self.trainer)  # data with domains (no validation split): per domain too
        if domains is not None:
            domains.update(logits, y, batch_idx)

    def on_validation_epoch_end(self) -> None:
        evaluated = {"val": self.val_acc, "test": self.test_acc}
        accuracies = {f"{prefix}/acc": metric.compute().item() for prefix, metric in evaluated.items()
                      if metric.update_count}
        for metric in evaluated.values():
            metric.reset()
        fitting = self.trainer.state.fn == "fit"  # `fedrcl validate` reports the checkpoint's EMA (or none)
        metrics = {**accuracies, **self.accuracy_emas(accuracies, update=fitting)}
        metrics = {k: metrics[k] for k in ACCURACIES if k in metrics}  # the round line's order
        domains = domain_accuracy_of(self.trainer)
        per_domain = {} if domains is None else domains.compute(self.trainer.strategy)  # val/acc/<domain>
        self.log_dict(metrics, prog_bar=True)
        if per_domain:
            self.log_dict(per_domain)

    def accuracy_emas(self, accuracies: dict[str, float], update: bool = True) -> dict[str, float]:
        """``val/acc_ema`` (and ``test/acc_ema``) after folding in this round's ``val/acc`` (``test/acc``), each
        ``ema <- decay * ema + (1 - decay) * acc`` (the first accuracy starts it); ``update=False``: the EMAs as
        they stand. Called by every backend's evaluation (fit, seeds together, Flower)."""
        emas = {}
        for prefix, attribute in (("val", "acc_ema"), ("test", "test_acc_ema")):
            acc, ema = accuracies.get(f"{prefix}/acc"), getattr(self, attribute)
            if update and acc is not None:
                ema = acc if ema is None else self.ema_decay * ema + (1 - self.ema_decay) * acc
                setattr(self, attribute, ema)
            if ema is not None:
                emas[f"{prefix}/acc_ema"] = ema
        return emas

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        self.log("test/acc", self.val_acc.compute().item())
        self.val_acc.reset()
        domains = domain_accuracy_of(self.trainer)
        if domains is not None:
            self.log_dict(domains.compute(self.trainer.strategy, prefix="test/acc/"))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["acc_ema"] = self.acc_ema
        if self.test_acc_ema is not None:
            checkpoint["test_acc_ema"] = self.test_acc_ema

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.acc_ema = checkpoint.get("acc_ema")
        self.test_acc_ema = checkpoint.get("test_acc_ema")
