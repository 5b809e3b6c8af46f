"""One client's local update driven from outside Lightning's round loop (a Flower ClientApp, a worker).

``Federation`` runs a round's clients inside ``Trainer.fit``. A process that serves single clients on
request (``fedrcl.flower``) has no fit loop, so ``LocalUpdate`` attaches the client algorithm to a
``FederatedTrainer`` built once per process (never per client) and drives the same ``ClientRun``
(``fedrcl.federated.round``: the broadcast weights and extras installed, ``on_client_start``, the client
lr per local epoch, ``on_client_end``, the upload), with per step Lightning's own automatic-optimisation
calls (``strategy.training_step`` -> the algorithm's ``training_step`` -> ``local_loss``,
``strategy.backward``, ``strategy.optimizer_step`` with its ``configure_gradient_clipping``). The client's
copy of the server is the process's own (``trainer.federation.server``). Batches come from
``FederatedDataModule.client_batches`` with the (seed, round, client) stream, so the client's weights are
bitwise those of ``fedrcl fit`` on CPU (``tests/test_flower.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import lightning as L
import torch
from torch import Tensor

from fedrcl.contract.exchange import check_method
from fedrcl.contract.plan import RoundPlan
from fedrcl.contract.weights import snapshot
from fedrcl.federated.round import ClientResult, ClientRun, Downlink, client_context

if TYPE_CHECKING:
    import fedrcl.algorithms.fedavg
    from fedrcl.data.datamodule import FederatedDataModule
    from fedrcl.federated.trainer import FederatedTrainer


@dataclass(frozen=True)
class ClientReport(ClientResult):
    """A finished client as a node reports it: its result (weights and upload copied) and its summed step
    losses by name and its step count, for the server's per-round ``train/loss*``."""

    loss_sums: dict[str, float]
    steps: int


def attach(trainer: L.Trainer, module: L.LightningModule, datamodule: L.LightningDataModule) -> None:
    """Connect ``module`` and ``datamodule`` to ``trainer`` as ``fit`` would (``module.trainer``,
    ``trainer.datamodule``, ``trainer.optimizers``), set both up for ``fit`` and convert the module to the
    run's precision (``trainer.precision``: ``64-true`` trains in float64 here as in ``fit``), without running a
    loop."""
    trainer.strategy.connect(module)
    trainer.datamodule = datamodule  # type: ignore[attr-defined]  # as fit sets it (undeclared); no loop reads it here
    module.trainer = trainer
    datamodule.trainer = trainer
    datamodule.setup("fit")
    module.setup("fit")
    trainer.precision_plugin.convert_module(module)
    trainer.strategy.setup_optimizers(trainer)


class LocalUpdate:
    """Runs single clients' local updates with one module, one data module and one optimizer per process.

    Args:
        trainer: a ``FederatedTrainer`` (its server optimizer supplies the client term, e.g. FedACG's); it is
            never fitted.
        module: the client algorithm.
        datamodule: the federated data (set up here if it is not yet).
    """

    def __init__(self, trainer: FederatedTrainer, module: fedrcl.algorithms.fedavg.FedAvg,
                 datamodule: FederatedDataModule):
        self.trainer, self.module, self.datamodule = trainer, module, datamodule
        attach(trainer, module, datamodule)
        self.federation = trainer.federation
        check_method(module, self.federation.server)

    def run(self, round_idx: int, client_id: int, downlink: Downlink) -> ClientReport:
        """Train client ``client_id`` in round ``round_idx`` from what it received (``downlink``)."""
        trainer, module, dm = self.trainer, self.module, self.datamodule
        plan = RoundPlan.of_clients(round_idx, (client_id,), dm.client_num_samples, dm.client_steps_per_epoch,
                                    self.federation.local_epochs, self.federation.seed)
        to_device = lambda tensors: {k: v.to(module.device) for k, v in tensors.items()}  # noqa: E731
        downlink = Downlink(to_device(downlink.sent), {k: to_device(v) for k, v in downlink.extras.items()})
        client = client_context(plan, 0, downlink.sent, self.federation.server, dm.client_data(client_id))
        run = ClientRun(module, client, downlink)
        module.train()
        module.on_train_epoch_start()  # the round's loss sums
        run.start()
        optimizer = trainer.optimizers[0]
        with torch.enable_grad():
            for batch_idx, batch in enumerate(dm.client_batches(client_id, round_idx, plan.local_epochs, plan.seed)):
                batch = trainer.precision_plugin.convert_input(batch)  # as fit's training loop does
                slot = plan.locate(batch_idx)
                if slot.first_step_of_epoch:
                    run.set_lr([optimizer], slot.local_epoch)

                def closure() -> Tensor:
                    out = trainer.strategy.training_step(batch, batch_idx)
                    # the loss, or (a client_direction step) the surrogate to backpropagate and the real loss
                    loss, real = (out["loss"], out["local_loss"]) if isinstance(out, dict) else (out, out)
                    assert isinstance(loss, Tensor) and isinstance(real, Tensor)  # FedAvg.training_step's
                    optimizer.zero_grad()
                    trainer.strategy.backward(loss, optimizer)
                    run.add_loss(real)
                    return loss

                trainer.strategy.optimizer_step(optimizer, closure)
        result = run.end()
        sums, steps = module.round_losses()
        return ClientReport(snapshot(module.backbone), {k: v.detach().clone() for k, v in result.upload.items()},
                            result.failure, {k: float(v) for k, v in sums.items()}, steps)
