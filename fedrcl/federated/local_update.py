"""One client's local update driven from outside Lightning's round loop (a Flower ClientApp, a worker).

``Federation`` runs a round's clients inside ``Trainer.fit``. A process that serves single clients on
request (``fedrcl.flower``) has no fit loop, so ``LocalUpdate`` attaches the client algorithm to a
``FederatedTrainer`` built once per process (never per client) and runs exactly what the round loop runs for
one client: the broadcast weights loaded in place, ``on_client_start``, per local epoch the client lr, per
step Lightning's own automatic-optimisation calls (``strategy.training_step`` -> the algorithm's
``training_step`` -> ``local_loss``, ``strategy.backward``, ``strategy.optimizer_step`` with its
``configure_gradient_clipping``), then ``on_client_end``. What a method exchanges besides the weights
(``fedrcl.federated.communication``) is installed before the client starts (``load_broadcast`` on the
process's copy of the server optimizer, ``load_download`` on the algorithm) and its ``extra_upload`` is
returned with the weights. Batches come from
``FederatedDataModule.client_batches`` with the (seed, round, client) stream, so the client's weights are
bitwise those of ``fedrcl fit`` on CPU (``tests/test_flower.py``).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import lightning as L
import torch
from torch import Tensor

from fedrcl.federated.context import ClientContext
from fedrcl.federated.divergence import client_failure
from fedrcl.federated.federation import load_state_, snapshot
from fedrcl.federated.plan import RoundPlan


@dataclass(frozen=True)
class ClientResult:
    """A finished client: its weights (a copy), its summed step losses by name, steps, any failure, and what
    it uploads besides its weights (``extra_upload``; empty for most methods)."""

    weights: dict[str, Tensor]
    loss_sums: dict[str, float]
    steps: int
    failure: Optional[str]
    upload: dict[str, Tensor]


def attach(trainer: L.Trainer, module: L.LightningModule, datamodule: L.LightningDataModule) -> None:
    """Connect ``module`` and ``datamodule`` to ``trainer`` as ``fit`` would (``module.trainer``,
    ``trainer.datamodule``, ``trainer.optimizers``), set both up for ``fit``, without running a loop."""
    trainer.strategy.connect(module)
    trainer._data_connector.attach_datamodule(module, datamodule=datamodule)  # trainer.datamodule
    module.trainer = trainer
    datamodule.trainer = trainer
    datamodule.setup("fit")
    module.setup("fit")
    trainer.strategy.setup_optimizers(trainer)


class LocalUpdate:
    """Runs single clients' local updates with one module, one data module and one optimizer per process.

    Args:
        trainer: a ``FederatedTrainer`` (its server optimizer supplies the client term, e.g. FedACG's); it is
            never fitted.
        module: the client algorithm.
        datamodule: the federated data (set up here if it is not yet).
    """

    def __init__(self, trainer: L.Trainer, module: L.LightningModule, datamodule: L.LightningDataModule):
        self.trainer, self.module, self.datamodule = trainer, module, datamodule
        attach(trainer, module, datamodule)
        self.federation = trainer.federation

    def run(self, round_idx: int, client_id: int, sent: Mapping[str, Tensor],
            broadcast: Mapping[str, Tensor] = {}, download: Mapping[str, Tensor] = {}) -> ClientResult:
        """Train client ``client_id`` in round ``round_idx`` from the broadcast weights ``sent``, with what
        the server sent besides them: ``broadcast`` (its ``extra_broadcast``) and ``download`` (the
        algorithm's ``extra_download``)."""
        trainer, module, dm = self.trainer, self.module, self.datamodule
        plan = RoundPlan(round_idx=round_idx, client_ids=(client_id,),
                         num_samples=(dm.client_num_samples(client_id),),
                         steps_per_epoch=(dm.client_steps_per_epoch(client_id),),
                         local_epochs=self.federation.local_epochs)
        sent = {k: v.to(module.device) for k, v in sent.items()}
        client = ClientContext(round_idx=round_idx, client_id=client_id, num_samples=plan.num_samples[0],
                               num_steps=plan.steps[0], seed=self.federation.seed, global_state=sent)
        module.train()
        module.on_train_epoch_start()  # the round's loss sums
        load_state_(module.backbone, sent)
        server = self.federation.server
        if hasattr(server, "load_broadcast"):
            server.load_broadcast(client, {k: v.to(module.device) for k, v in broadcast.items()})
        if hasattr(module, "load_download"):
            module.load_download(client, {k: v.to(module.device) for k, v in download.items()})
        module.on_client_start(client)
        optimizer = trainer.optimizers[0]
        loss_sum: Optional[Tensor] = None
        batches = dm.client_batches(client_id, round_idx, plan.local_epochs, self.federation.seed)
        with torch.enable_grad():
            for batch_idx, batch in enumerate(batches):
                slot = plan.locate(batch_idx)
                if slot.first_step_of_epoch:
                    for group in optimizer.param_groups:
                        group["lr"] = module.client_lr(round_idx, slot.local_epoch)
                losses: list[Tensor] = []

                def closure() -> Tensor:
                    loss = trainer.strategy.training_step(batch, batch_idx)
                    optimizer.zero_grad()
                    trainer.strategy.backward(loss, optimizer)
                    losses.append(loss.detach())
                    return loss

                trainer.strategy.optimizer_step(optimizer, closure)
                loss_sum = losses[-1] if loss_sum is None else loss_sum + losses[-1]
        module.on_client_end(client)
        weights = snapshot(module.backbone)
        upload = module.extra_upload(client) if hasattr(module, "extra_upload") else {}
        upload = {k: v.detach().clone() for k, v in upload.items()}
        sums = {k: float(v) for k, v in module._round_loss_sums.items()}
        return ClientResult(weights, sums, module._round_steps, client_failure(loss_sum, weights), upload)
