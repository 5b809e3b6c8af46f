"""The round loop, as a Lightning callback: one Lightning epoch is one federated round.

Per round: sample clients (``sampling``), plan their steps (``fedrcl.contract.plan``), begin the server's
half of the round (``fedrcl.federated.round.ServerRound``) from the global weights and configure it: every
client's facts and downlink are fixed at the round's start, as on every backend. Then, over the round's
single batch stream: at a client's first step start its ``ClientRun`` (broadcast weights loaded into the one
model object in place, ``on_client_start``); at each local epoch set the client lr; at its last step end it
and add its result to the server round. After the round's last client the server round's ``finish`` gives the new global
weights, written into the model before Lightning evaluates and checkpoints it. Between rounds the model *is*
the global model, so Lightning's checkpoint of the module holds the global weights. A client with a
non-finite summed loss or non-finite weights, or non-finite new global weights, stop the run before the
round's checkpoint (``divergence``).

With ``trainer.client_batching`` the round's clients train together instead (``fedrcl.federated.batched``), on
the stacked engine that seeds together use (``fedrcl.federated.stacked``): the stream has one stacked batch per
local step (as many as the longest client's steps: clients that finish sooner are masked,
``fedrcl.contract.step_mask``), ``StackedClients`` starts every client's run at the round's first step, takes each
stacked step in the algorithm's ``training_step`` and ends every client's run at the round's last step.

With several processes (``fedrcl.federated.strategy.FederatedStrategy``, which ``FederatedTrainer`` picks
for ``ddp`` or ``auto``) each process trains its share of the round's sampled clients
(``sampled[rank::world_size]``, so processes may run different step counts) and nothing is synchronised
per step; the clients' weighted sums meet in one all-reduce per tensor at the round's end, and every
process runs the same server step on the same mean. Lightning's plain DDP cannot run this loop: it would
average the gradients of different clients at every step, and hang when their step counts differ.

With ``remote`` (Flower's server, ``fedrcl.flower.server``) the round's clients train on other machines: the stream
has one item per round (``RoundPlan.remote``), in whose Lightning step the ``RemoteClients`` engine trains and
aggregates the round there; its new global weights, client steps and losses come back into this loop, whose round's
end (evaluation, logs, checkpoint, callbacks, ``trainer.max_time``, stop signals) is the same as for every backend.

At each client's end, before aggregation, every ``RoundCallback`` among the trainer's callbacks has its
``on_client_end(trainer, pl_module, client, local_state)`` called with the client's ``ClientContext`` and
its local weights (e.g. ``fedrcl.analysis.ClientEvaluation``). ``ledger``
(``fedrcl.federated.communication``) counts the bytes sent and splits each round's wall time; it is handed
to every ``RoundCallback`` (``callback.ledger``) for the seconds it spends evaluating.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Optional, Protocol

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from fedrcl.algorithms.fedavg import FedAvg as ClientAlgorithm
from fedrcl.contract.context import ClientContext
from fedrcl.contract.exchange import check_method
from fedrcl.contract.plan import RoundPlan
from fedrcl.contract.processes import process_sum
from fedrcl.contract.weights import load_state_, snapshot
from fedrcl.data.datamodule import datamodule_of
from fedrcl.federated.batched import ClientBatching
from fedrcl.federated.communication import RoundLedger
from fedrcl.federated.fingerprint import allowed, compare, refused_changes, run_fingerprint
from fedrcl.federated.round import ClientResult, ClientRun, ServerRound
from fedrcl.federated.sampling import sample_clients
from fedrcl.federated.stacked import StackedClients, stacked_step
from fedrcl.privacy import DPFedAvg
from fedrcl.server import FedAvg, ServerOptimizer
from fedrcl.server.base import StatefulServer


def client_algorithm(pl_module: L.LightningModule) -> ClientAlgorithm:
    """``pl_module`` as the client algorithm it is (``Federation.setup`` refuses any other model)."""
    assert isinstance(pl_module, ClientAlgorithm)
    return pl_module


class RemoteRound(NamedTuple):
    """A round trained elsewhere: the new global weights, the clients' summed step losses (``loss``,
    ``loss_<part>``) and steps, and the engine's own scalars (e.g. the bytes Flower carried)."""

    weights: dict[str, Tensor]
    loss_sums: dict[str, float]
    steps: int
    metrics: dict[str, float]


class RemoteClients(Protocol):
    """An engine whose clients train on other machines (Flower's nodes, ``fedrcl.flower.server.NodeRounds``)."""

    def begin(self, round_idx: int, global_weights: dict[str, Tensor]) -> None:
        """Round ``round_idx`` begins from ``global_weights``: sample and configure its clients."""

    def train(self) -> RemoteRound:
        """Train the round's clients there and aggregate them (a failure raises, naming the clients)."""


class RoundCallback(L.Callback):
    """A Lightning callback that also sees each client's local model: ``on_client_end`` runs at each client's
    end, before aggregation, and ``round_metrics`` once the round's new global model is in place; its scalars are
    logged with the round's. Both run wherever the clients' local models are in this process: ``fedrcl fit``
    (batched or not, several processes) and seeds together; not on Flower, whose clients' models stay on the
    nodes (the run names such callbacks before it starts). ``ledger`` is the run's ``RoundLedger``, handed in at
    setup (``ledger.add("evaluation", seconds)``)."""

    ledger: Optional[RoundLedger] = None

    def on_client_end(self, trainer: L.Trainer, pl_module: L.LightningModule, client: ClientContext,
                      local_state: Mapping[str, Tensor]) -> None:
        """Client ``client`` has finished; ``local_state`` is its weights (the model's own tensors: read
        them here, copy what you keep)."""

    def round_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """The round has ended (``pl_module`` holds the new global model, ``trainer.current_epoch`` is the
        round's index): the scalars to log with the round's."""
        return {}

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """In Lightning's fit loop: ``round_metrics`` logged with the round's scalars."""
        for key, value in self.round_metrics(trainer, pl_module).items():
            pl_module.log(key, value, on_step=False, on_epoch=True)


def client_callbacks(trainer: L.Trainer) -> list[RoundCallback]:
    """The config's ``RoundCallback`` objects (fedrcl's analysis callbacks, a user's own)."""
    return [c for c in trainer.callbacks if isinstance(c, RoundCallback)]  # type: ignore[attr-defined]


def client_ended(trainer: L.Trainer, pl_module: L.LightningModule, client: ClientContext,
                 local_state: Mapping[str, Tensor], ledger: RoundLedger) -> None:
    """Every ``RoundCallback``'s ``on_client_end`` for a finished client, its time counted as evaluation."""
    with ledger.timed("evaluation"):
        for callback in client_callbacks(trainer):
            callback.on_client_end(trainer, pl_module, client, local_state)


class Federation(L.Callback):
    """Turns Lightning epochs into federated rounds (see the module docstring).

    Args:
        clients_per_round: clients sampled per round.
        participation: alternative to ``clients_per_round``: the fraction of clients per round.
        local_epochs: local epochs each client trains per round.
        server: the server optimizer.
        seed: seed of client sampling, batch order and augmentation.
        allow_changes: fingerprint keys (or their parents) a resumed run may change (``fedrcl.federated.
            fingerprint``); any other difference from the checkpoint stops the run.
        client_batching: train a round's clients together (``fedrcl.federated.batched``); default: off.
        privacy: differential privacy of the round's mean (``fedrcl.privacy.DPFedAvg``); ``None``: none.
    """

    def __init__(self, clients_per_round: Optional[int], participation: Optional[float], local_epochs: int,
                 server: Optional[ServerOptimizer], seed: int, allow_changes: Sequence[str] = (),
                 client_batching: Optional[ClientBatching] = None, privacy: Optional[DPFedAvg] = None):
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
        self.allow_changes = tuple(allow_changes)
        self._fingerprint: dict[str, Any] = {}
        self._fitting = False
        self.segments: list[dict[str, Any]] = []  # deliberate changes at resumes: round and changed keys
        self._changes: dict[str, list[Any]] = {}
        self.batching = client_batching or ClientBatching("off")
        self.ledger = RoundLedger()
        self.round: Optional[ServerRound] = None  # the round in progress
        self.privacy = privacy
        self.lockstep: Optional[Any] = None  # with seeds together: this run's ``fedrcl.federated.lockstep.Seat``
        self.remote: Optional[RemoteClients] = None  # clients on other machines (Flower's server)
        self.client_steps = 0  # every client's local steps so far, on every backend (``FederatedTrainer.global_step``)
        self._remote_round: Optional[RemoteRound] = None
        # a stop signal recorded by the process that runs this fit in another thread (a Flower simulation's
        # ``fedrcl.federated.preemption.StopSignal``): read after each round, as a signal to this fit
        self.stop_signal: Optional[Any] = None

    # -- planning -----------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm = datamodule_of(trainer)
        if not hasattr(dm, "client_batches"):
            raise TypeError("FederatedTrainer needs a FederatedDataModule (data.class_path)")
        if not isinstance(pl_module, ClientAlgorithm):
            raise TypeError("FederatedTrainer needs a client algorithm from fedrcl.algorithms (model.class_path)")
        check_method(pl_module, self.server, training=stage == "fit")
        misplaced = [type(c).__name__ for c in trainer.callbacks  # type: ignore[attr-defined]
                     if not isinstance(c, RoundCallback) and hasattr(c, "on_client_end")]
        if misplaced:
            raise TypeError(f"trainer.callbacks {', '.join(misplaced)} define on_client_end but are not "
                            "fedrcl.federated.federation.RoundCallback subclasses: it would never be called")
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, RoundCallback):
                callback.ledger = self.ledger
        self.datamodule = dm
        dm.plan_source = lambda: self.plan(trainer.current_epoch)
        if stage == "fit" and self.clients_per_round > dm.num_clients:
            raise ValueError(f"trainer.clients_per_round={self.clients_per_round} exceeds "
                             f"data.num_clients={dm.num_clients}")
        if stage == "fit" and self.clients_per_round < trainer.world_size:
            raise ValueError(f"trainer.clients_per_round={self.clients_per_round} is smaller than the "
                             f"{trainer.world_size} processes (devices x num_nodes): every process trains at "
                             "least one client per round; lower trainer.devices or sample more clients")
        self._fitting = stage == "fit"  # evaluating a checkpoint needs no resume check
        if self.privacy is not None and stage == "fit":
            self.privacy.bind(dm.num_clients, self.clients_per_round, pl_module)
        self._fingerprint = run_fingerprint(trainer, pl_module, dm)
        unknown = [a for a in self.allow_changes if not any(allowed(k, [a]) for k in self._fingerprint)]
        if unknown:
            raise ValueError(f"trainer.resume_allow_changes: {', '.join(unknown)} is not a key of the resume "
                             f"check; its keys are: {', '.join(sorted(self._fingerprint))}")

    @property
    def clients_per_round(self) -> int:
        if self._clients_per_round is not None:
            return self._clients_per_round
        assert self.participation is not None  # __init__: one of the two is set
        return max(1, round(self.participation * self.datamodule.num_clients))

    def plan(self, round_idx: int) -> RoundPlan:
        """This process's clients for ``round_idx`` (cached for the current round)."""
        if self._plan is None or self._plan.round_idx != round_idx:
            dm, trainer = self.datamodule, self.datamodule.trainer
            assert trainer is not None  # setup attached the data module
            sampled = sample_clients(dm.num_clients, self.clients_per_round, self.seed, round_idx)
            mine = tuple(sampled[trainer.global_rank::trainer.world_size])
            self._plan = RoundPlan.of_clients(round_idx, mine, dm.client_num_samples, dm.client_steps_per_epoch,
                                              self.local_epochs, self.seed)
            if self.remote is not None:
                self._plan = dataclasses.replace(self._plan, remote=True)
                return self._plan
            device = trainer.strategy.root_device
            batched = self.batching.applies(trainer.lightning_module, device, str(trainer.precision))
            self._plan = dataclasses.replace(self._plan, batched=batched)
        return self._plan

    # -- the round ----------------------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The round begins and is configured: every client's downlink fixed before any trains."""
        self._log_ledger(trainer)
        self._started = time.perf_counter()
        algorithm = client_algorithm(pl_module)
        if self.remote is not None:  # configured by the engine, from the global weights
            self.remote.begin(trainer.current_epoch, snapshot(algorithm.backbone))
            return
        self.round = ServerRound(self.server, algorithm, trainer.current_epoch, snapshot(algorithm.backbone),
                                 self.ledger, reduce=process_sum(trainer),
                                 vote=lambda failed: trainer.strategy.reduce_boolean_decision(failed, all=False),
                                 privacy=self.privacy)
        plan = self.plan(trainer.current_epoch)
        configured = self.round.configure(plan, self.datamodule.client_data)
        self._clients = [ClientRun(algorithm, client, down) for client, down in configured]
        self._runs: list[ClientRun] = []  # the clients training now (several when batched)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        plan = self.plan(trainer.current_epoch)
        slot = plan.locate(batch_idx)
        if plan.remote:  # the round's one step: its clients train elsewhere and are aggregated there
            assert self.remote is not None
            self._remote_round = self.remote.train()
            return
        if plan.batched:
            if slot.step == 0:  # every client's lr at every step is the stacked engine's
                self._runs = self._clients
                step = stacked_step(self.batching.steps, pl_module, 1, len(self._runs), trainer)
                stack = StackedClients(trainer, pl_module, self._runs, step, check=not self.batching.checked)
                self.batching.checked = True
                if self.lockstep is not None:  # seeds together: trained with the other runs' rounds
                    self.lockstep.join(stack)
            return
        if slot.step == 0:
            self._runs = [self._clients[slot.position]]
            self._runs[0].start()
        if slot.first_step_of_epoch:
            self._runs[0].set_lr(trainer.optimizers, slot.local_epoch)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        plan = self.plan(trainer.current_epoch)
        slot = plan.locate(batch_idx)
        if plan.remote:
            done, self._remote_round = self._remote_round, None
            assert done is not None
            client_algorithm(pl_module).add_remote_losses(done.loss_sums, done.steps)
            for key, value in done.metrics.items():
                pl_module.log(key, value, on_step=False, on_epoch=True, batch_size=1)
            self._end_round(trainer, pl_module, done.weights)
            return
        if plan.batched:
            stack = self._stack(pl_module)
        else:  # a step of ``client_direction`` returns the step's real loss beside the surrogate Lightning steps on
            loss = outputs.get("local_loss", outputs.get("loss")) if isinstance(outputs, Mapping) else outputs
            if isinstance(loss, torch.Tensor):  # summed on the device; checked once per client, at its end
                self._runs[0].add_loss(loss)
        if not slot.last_step_of_client:
            return
        if plan.batched:  # every client of the stack ends at the longest one's last step
            stack.finish_round(lambda run, result: self._fold(trainer, pl_module, run, result))
        else:
            self._fold(trainer, pl_module, self._runs[0], self._runs[0].end())
        self._runs = []
        if batch_idx == plan.total_steps - 1:
            self._finish_round(trainer, pl_module)

    @staticmethod
    def _stack(pl_module: L.LightningModule) -> StackedClients:
        stack = client_algorithm(pl_module).stack
        assert isinstance(stack, StackedClients)  # set by StackedClients at the round's first step
        return stack

    def _fold(self, trainer: L.Trainer, pl_module: L.LightningModule, run: ClientRun, result: ClientResult) -> None:
        """A client has finished (its weights are in the backbone): the round callbacks' ``on_client_end``,
        then the server round takes it (divergence check, bytes, upload, weighted sum)."""
        client_ended(trainer, pl_module, run.client, result.weights, self.ledger)
        assert self.round is not None
        self.round.add(run.client.client_id, result)

    def _finish_round(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.round is not None
        new_global = self.round.finish()
        self.round, self._clients = None, []
        self._end_round(trainer, pl_module, new_global)

    def _end_round(self, trainer: L.Trainer, pl_module: L.LightningModule, new_global: dict[str, Tensor]) -> None:
        """The round's new global weights into the model (evaluated and checkpointed next); its seconds, client lr
        and privacy logged."""
        algorithm = client_algorithm(pl_module)
        load_state_(algorithm.backbone, new_global)
        plan, dm = self.plan(trainer.current_epoch), self.datamodule
        if trainer.world_size > 1:  # every process's clients, as in one process
            sampled = sample_clients(dm.num_clients, self.clients_per_round, self.seed, plan.round_idx)
            plan = RoundPlan.of_clients(plan.round_idx, sampled, dm.client_num_samples, dm.client_steps_per_epoch,
                                        self.local_epochs, self.seed)
        self.client_steps += sum(plan.steps)
        pl_module.log("time/round_seconds", time.perf_counter() - self._started, on_step=False, on_epoch=True,
                      batch_size=1)
        pl_module.log("train/lr", algorithm.client_lr(trainer.current_epoch, 0), on_step=False, on_epoch=True,
                      batch_size=1)
        if self.privacy is not None:
            self._privacy_round(trainer, pl_module)

    def _privacy_round(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The round's epsilon and clip norm logged (epsilon in the round line); with ``max_epsilon``, the run
        stops after this round, checkpointed, when the next one would pass the budget."""
        privacy = self.privacy
        assert privacy is not None
        for name, value in privacy.metrics().items():
            pl_module.log(name, value, on_step=False, on_epoch=True, prog_bar=name == "privacy/epsilon",
                          batch_size=1)
        if trainer.current_epoch + 1 < (trainer.max_epochs or 0) and privacy.budget_spent():
            trainer.should_stop = True
            rank_zero_info(privacy.budget_line(trainer.current_epoch + 1))

    # -- the ledger: evaluation time, and each round's bytes and seconds logged once its wall time is known --
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._validation_started = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.ledger.add("evaluation", time.perf_counter() - self._validation_started)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._log_ledger(trainer)

    def _log_ledger(self, trainer: L.Trainer) -> None:
        round_idx, metrics = self.ledger.metrics()
        if round_idx is not None:  # at the round's own step: the loggers' round axis would take the next one
            for logger in trainer.loggers:
                getattr(logger.log_metrics, "__wrapped__", logger.log_metrics)(metrics, step=round_idx + 1)

    # -- checkpoint ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {"server": self.server.state_dict(), "fingerprint": self._fingerprint,
                 "segments": self.segments,
                 "ledger": self.ledger.state_dict()}
        return state if self.privacy is None else {**state, "privacy": self.privacy.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: refuse a checkpoint whose fingerprint differs (except in ``allow_changes``); say which
        keys an older checkpoint could not be checked on; record deliberate changes as a new segment."""
        if not self._fitting:
            return
        saved = state_dict.get("fingerprint", {})
        error = refused_changes(saved, self._fingerprint, self.allow_changes)
        if error:
            raise ValueError(error)
        differences, unchecked = compare(saved, self._fingerprint)
        if unchecked:
            rank_zero_info("Resume: the checkpoint predates these resume checks, not checked: "
                           + ", ".join(unchecked))
        if state_dict["server"] and not isinstance(self.server, StatefulServer):
            raise ValueError(f"checkpoint holds server memory ({', '.join(state_dict['server'])}) that "
                             f"trainer.server {type(self.server).__name__} does not keep: it was written "
                             "with another server optimizer")
        self.server.load_state_dict(state_dict["server"])
        self.segments = list(state_dict.get("segments", []))
        self._changes = {k: [a, b] for k, a, b in differences}
        if "ledger" in state_dict:
            self.ledger.load_state_dict(state_dict["ledger"])
        if (self.privacy is None) != ("privacy" not in state_dict):
            raise ValueError("trainer.privacy: the checkpoint was written " + (
                "without differential privacy; a private run cannot continue it (its epsilon would not count the "
                "rounds before)" if self.privacy is not None else "with trainer.privacy, which this config leaves out"))
        if self.privacy is not None:
            self.privacy.load_state_dict(state_dict["privacy"])

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """The clients' local steps so far: the checkpoint's ``global_step`` (``FederatedTrainer.global_step``)."""
        self.client_steps = int(checkpoint.get("global_step", 0))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After a resume with deliberate changes: a new segment, in the checkpoint and the logged hparams."""
        if self.privacy is not None and trainer.current_epoch < (trainer.max_epochs or 0) \
                and self.privacy.budget_spent():  # a resumed run whose budget is spent
            raise ValueError(self.privacy.budget_line(trainer.current_epoch))
        changes, self._changes = self._changes, {}
        if not changes:
            return
        self.segments.append({"round": trainer.current_epoch, "changed": changes})
        rank_zero_info(f"Resume: a new segment starts at round {trainer.current_epoch + 1} "
                       "(trainer.resume_allow_changes): " + "; ".join(f"{k} {a!r} -> {b!r}"
                                                                     for k, (a, b) in changes.items()))
        for logger in trainer.loggers:
            logger.log_hyperparams({"resume_segments": repr(self.segments)})
