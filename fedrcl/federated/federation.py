"""The round loop, as a Lightning callback: one Lightning epoch is one federated round.

Per round: sample clients (``sampling``), plan their steps (``plan``), snapshot the global weights,
let the server optimizer choose what to broadcast. Then, over the round's single batch stream:
at a client's first step load the broadcast weights into the one model object in place and call the
algorithm's ``on_client_start`` (which resets its optimizer); at each local epoch set the client lr; at a
client's last step call ``on_client_end`` and fold its weights into the running weighted sum
(``aggregation``). After the round's last client the server step writes the new global weights into the
model, before Lightning evaluates it and checkpoints it. Between rounds the model *is* the global model,
so Lightning's checkpoint of the module holds the global weights.

With ``trainer.client_batching`` the round's clients train together instead (``fedrcl.federated.batched``):
the stream has one stacked batch per local step, and ``StackedClients`` takes the place of the per-client
swaps above.

Clients of a round are split across processes by rank (``client_ids[rank::world_size]``) and their sums
meet in one all-reduce per tensor, so a multi-process strategy needs no other change to this loop.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor

from fedrcl.federated.aggregation import WeightedSum
from fedrcl.federated.batched import ClientBatching, StackedClients
from fedrcl.federated.context import ClientContext
from fedrcl.federated.plan import RoundPlan
from fedrcl.federated.sampling import sample_clients
from fedrcl.server import FedAvg, ServerOptimizer


def load_state_(module: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ``state`` into ``module``'s parameters and buffers in place (no new tensors, no new module)."""
    with torch.no_grad():
        for key, tensor in module.state_dict().items():
            tensor.copy_(state[key])


def snapshot(module: torch.nn.Module) -> dict[str, Tensor]:
    """A detached copy of ``module``'s state on its device."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Federation(L.Callback):
    """Turns Lightning epochs into federated rounds (see the module docstring).

    Args:
        clients_per_round: clients sampled per round.
        participation: alternative to ``clients_per_round``: the fraction of clients per round.
        local_epochs: local epochs each client trains per round.
        server: the server optimizer.
        seed: seed of client sampling, batch order and augmentation.
        client_batching: train a round's clients together (``fedrcl.federated.batched``); default: off.
    """

    def __init__(self, clients_per_round: Optional[int], participation: Optional[float], local_epochs: int,
                 server: Optional[ServerOptimizer], seed: int,
                 client_batching: Optional[ClientBatching] = None):
        if (clients_per_round is None) == (participation is None):
            raise ValueError("set exactly one of trainer.clients_per_round and trainer.participation")
        if participation is not None and not 0 < participation <= 1:
            raise ValueError(f"trainer.participation must be in (0, 1], got {participation}")
        if clients_per_round is not None and clients_per_round < 1:
            raise ValueError(f"trainer.clients_per_round must be >= 1, got {clients_per_round}")
        if local_epochs < 1:
            raise ValueError(f"trainer.local_epochs must be >= 1, got {local_epochs}")
        self._clients_per_round, self.participation = clients_per_round, participation
        self.local_epochs, self.seed = local_epochs, seed
        self.server = server if server is not None else FedAvg()
        self._plan: Optional[RoundPlan] = None
        self._fingerprint: dict[str, Any] = {}
        self.batching = client_batching or ClientBatching("off")
        self.stacked: Optional[StackedClients] = None  # the round's clients, while they train batched

    # -- planning -----------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm = trainer.datamodule
        if not hasattr(dm, "client_batches"):
            raise TypeError("FederatedTrainer needs a FederatedDataModule (data.class_path)")
        if not hasattr(pl_module, "on_client_start"):
            raise TypeError("FederatedTrainer needs a client algorithm from fedrcl.algorithms (model.class_path)")
        self.datamodule = dm
        if stage == "fit" and self.clients_per_round > dm.num_clients:
            raise ValueError(f"trainer.clients_per_round={self.clients_per_round} exceeds "
                             f"data.num_clients={dm.num_clients}")
        self._fingerprint = {
            "data.dataset": dm.dataset, "data.num_clients": dm.num_clients, "data.partition": dm.partition,
            "data.alpha": dm.alpha, "data.seed": dm.seed, "data.partition_file": dm.partition_file,
            "model": type(pl_module).__name__,
            "model.backbone": type(pl_module.backbone).__name__, "trainer.seed": self.seed,
        }

    @property
    def clients_per_round(self) -> int:
        if self._clients_per_round is not None:
            return self._clients_per_round
        return max(1, round(self.participation * self.datamodule.num_clients))

    def plan(self, round_idx: int) -> RoundPlan:
        """This process's clients for ``round_idx`` (cached for the current round)."""
        if self._plan is None or self._plan.round_idx != round_idx:
            dm, trainer = self.datamodule, self.datamodule.trainer
            sampled = sample_clients(dm.num_clients, self.clients_per_round, self.seed, round_idx)
            mine = tuple(sampled[trainer.global_rank::trainer.world_size])
            self._plan = RoundPlan(
                round_idx=round_idx, client_ids=mine,
                num_samples=tuple(dm.client_num_samples(k) for k in mine),
                steps_per_epoch=tuple(dm.client_steps_per_epoch(k) for k in mine),
                local_epochs=self.local_epochs)
            device = trainer.strategy.root_device
            batched = self.batching.applies(trainer.lightning_module, self._plan, dm, device)
            self._plan = dataclasses.replace(self._plan, batched=batched)
        return self._plan

    # -- the round ----------------------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = time.perf_counter()
        self._global = snapshot(pl_module.backbone)
        self._sent = self.server.broadcast(self._global)
        self._sum = WeightedSum(self._global)
        self._client: Optional[ClientContext] = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        plan = self.plan(trainer.current_epoch)
        slot = plan.locate(batch_idx)
        if slot.step == 0 and plan.batched:
            load_state_(pl_module.backbone, self._sent)
            self.stacked = StackedClients(trainer, pl_module, plan, self._sent, self.seed, self.batching)
        elif slot.step == 0:
            load_state_(pl_module.backbone, self._sent)
            self._client = ClientContext(
                round_idx=plan.round_idx, client_id=slot.client_id,
                num_samples=plan.num_samples[slot.position], num_steps=plan.steps[slot.position],
                seed=self.seed, global_state=self._sent)
            pl_module.on_client_start(self._client)
        if slot.first_step_of_epoch:
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = pl_module.client_lr(plan.round_idx, slot.local_epoch)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        plan = self.plan(trainer.current_epoch)
        slot = plan.locate(batch_idx)
        if not slot.last_step_of_client:
            return
        if plan.batched:
            self.stacked.finish(self._sum)
            self.stacked = None
        else:
            pl_module.on_client_end(self._client)
            self._sum.add(pl_module.backbone.state_dict(), weight=float(self._client.num_samples))
        if batch_idx == plan.total_steps - 1:
            self._finish_round(trainer, pl_module)

    def _finish_round(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        reduce = None
        if trainer.world_size > 1:
            reduce = lambda t: trainer.strategy.reduce(t, reduce_op="sum")  # noqa: E731
        client_mean = self._sum.mean(reduce)
        new_global = self.server.step(self._global, self._sent, client_mean)
        load_state_(pl_module.backbone, new_global)
        self._global = self._sent = self._sum = None
        pl_module.log("time/round_seconds", time.perf_counter() - self._started, on_step=False, on_epoch=True)
        pl_module.log("train/lr", pl_module.client_lr(trainer.current_epoch, 0), on_step=False, on_epoch=True)
        pl_module.log("step", float(trainer.current_epoch + 1), on_step=False, on_epoch=True)

    # -- checkpoint ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"server": self.server.state_dict(), "fingerprint": self._fingerprint}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("fingerprint", {})
        for key, value in self._fingerprint.items():
            if key in saved and saved[key] != value:
                raise ValueError(f"checkpoint comes from another configuration: {key} was {saved[key]!r} "
                                 f"there and is {value!r} here")
        self.server.load_state_dict(state_dict["server"])
