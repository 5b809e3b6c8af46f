"""FederatedTrainer: Lightning's Trainer with rounds, clients and a server optimizer."""
from __future__ import annotations

import os
import warnings
from typing import Any, Literal, Optional

import lightning as L
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info

from fedrcl.analysis.layout import ScalarLayout
from fedrcl.federated.checkpoint import RoundCheckpoint, find_resumable, resume_path, with_atomic_checkpoint_io
from fedrcl.federated.batched import ClientBatching
from fedrcl.federated.deadline import round_timer
from fedrcl.federated.federation import Federation
from fedrcl.federated.fingerprint import run_fingerprint
from fedrcl.federated.preemption import Preemption, PreemptionSignals, preempted
from fedrcl.federated.progress import WeightsSummary, quiet_lightning, round_progress
from fedrcl.federated.round_axis import log_against_rounds
from fedrcl.federated.run_folder import check_save_dirs, quiet_writer_threads, run_folder_error
from fedrcl.federated.strategy import check_federated_strategy, federated_ddp_names
from fedrcl.privacy import DPFedAvg
from fedrcl.server import ServerOptimizer

# Trainer arguments the round loop sets itself: Lightning's default (any other value is an error) and what
# to set instead (``fedrcl fit --help`` leaves them out; the parser's error names the key to use).
OWNED_BY_ROUNDS = {"max_epochs": (None, "use trainer.rounds"), "min_epochs": (None, "use trainer.rounds"),
                   "max_steps": (-1, "use trainer.rounds"),
                   "check_val_every_n_epoch": (1, "use trainer.eval_every"),
                   "reload_dataloaders_every_n_epochs": (0, "every round has its own batches"),
                   "num_sanity_val_steps": (None, "fedrcl runs no sanity check"),
                   "gradient_clip_val": (None, "use model.init_args.grad_clip_norm (per client step)"),
                   "gradient_clip_algorithm": (None, "model.init_args.grad_clip_norm clips each client step by "
                                                     "norm")}


# Lightning's trainer arguments a round allows at one value only (kept in the parser: saved configs name them),
# with why: a round is every local step of its sampled clients, each step one update of one client.
ONE_VALUE = {"limit_train_batches": ((None, 1, 1.0), "a round trains every local step of its clients (fewer "
                                     "steps: data.local_iters_per_epoch)"),
             "accumulate_grad_batches": ((1,), "each local step is one update of one client (a larger step: "
                                         "data.batch_size)")}


def check_accelerator(accelerator: Any) -> None:
    """Refuse a ``trainer.accelerator`` this machine does not have, in one line naming the key and what it has
    (Lightning refuses it later, in a traceback of 36 lines). ``gpu`` means CUDA or MPS, as in Lightning."""
    if not isinstance(accelerator, str) or accelerator == "auto":
        return
    names = AcceleratorRegistry.available_accelerators()
    if accelerator != "gpu" and accelerator not in names:
        return  # not a name Lightning registers: its own error names what it accepts
    usable = [name for name in sorted(names) if AcceleratorRegistry[name]["accelerator"].is_available()]
    if not ({"cuda", "mps"} if accelerator == "gpu" else {accelerator}) & set(usable):
        raise ValueError(f"trainer.accelerator {accelerator}: this machine has none; available here: "
                         f"{', '.join(['auto', *usable])}")


def check_nodes(trainer: L.Trainer) -> None:
    """``trainer.num_nodes`` > 1 with Lightning's own launch (no torchrun, SLURM, ...): refuse it, in one line,
    unless ``MASTER_ADDR``, ``MASTER_PORT`` and ``NODE_RANK`` say where the nodes meet (without them no other
    node could ever join, and the run waited for ever without a word); with them, say what it waits for."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if trainer.num_nodes <= 1 or type(environment) is not LightningEnvironment:
        return
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if k not in os.environ
               and not (k == "NODE_RANK" and "GROUP_RANK" in os.environ)]
    if missing:
        raise ValueError(
            f"trainer.num_nodes={trainer.num_nodes} without a launcher (torchrun, SLURM's srun) needs "
            f"{', '.join(missing)} in the environment of each node's command: MASTER_ADDR and MASTER_PORT of "
            f"node 0, NODE_RANK 0 .. {trainer.num_nodes - 1}; without them no other node can join this one "
            "(docs/distributed.md)")
    rank_zero_info(f"trainer.num_nodes={trainer.num_nodes}: node {environment.node_rank()} waits for the "
                   f"other nodes' processes ({trainer.world_size} in all) at {environment.main_address}:"
                   f"{environment.main_port}")


class FederatedTrainer(L.Trainer):
    """Lightning's Trainer where one epoch is one federated round.

    Every other Trainer argument (logger, callbacks, precision, accelerator, devices, ...) works as in
    Lightning. The round loop itself lives in ``fedrcl.federated.federation.Federation``. With several
    devices or nodes, ``strategy`` ``ddp`` or ``auto`` runs ``fedrcl.federated.strategy.FederatedStrategy``
    (the round's clients split over processes, no gradient sync); other multi-process strategies are errors.

    Args:
        rounds: communication rounds (Lightning epochs).
        clients_per_round: clients sampled per round (paper: 5 of 100).
        participation: the fraction of clients sampled per round, instead of clients_per_round (set
            that to null).
        local_epochs: local epochs each sampled client trains per round (paper: 5).
        server: server optimizer (``fedrcl.server``); default FedAvg.
        eval_every: evaluate the global model on the test set every this many rounds.
        checkpoint_every: save a checkpoint every this many rounds (and after the last).
        seed: seed of client sampling, local batch order and augmentation (the client split has its own
            ``data.seed``; model initialisation follows ``seed_everything``).
        resume_allow_changes: keys of the resume check (e.g. ``model.init_args.lr``, ``trainer.server``) that
            ``--ckpt_path`` may find changed: the run continues with the new values as a new segment
            (logged, and kept in the checkpoint). Any other difference from the checkpoint is an error.
        client_batching: ``on``: train a round's clients together, as one model with a leading client axis
            (one step = one local step of every client; same result as one after another); ``off``: one after
            another; ``auto``: on on CUDA, off elsewhere. Rounds it cannot batch (unequal clients, MOON,
            BatchNorm) run one after another, with a notice.
        compile_clients: compile the batched clients' step with ``torch.compile`` (CUDA graphs on CUDA).
        privacy: user-level differential privacy (``fedrcl.privacy.DPFedAvg``: per-client clipping, Gaussian
            noise, epsilon per round, a budget); ``None``: none (docs/privacy.md).
    """

    def __init__(
        self,
        rounds: int = 1000,
        clients_per_round: Optional[int] = 5,
        participation: Optional[float] = None,
        local_epochs: int = 5,
        server: Optional[ServerOptimizer] = None,
        eval_every: int = 1,
        checkpoint_every: int = 50,
        seed: int = 0,
        resume_allow_changes: Optional[list[str]] = None,
        client_batching: Literal["auto", "on", "off"] = "auto",
        compile_clients: bool = False,
        privacy: Optional[DPFedAvg] = None,
        **kwargs: Any,
    ):
        quiet_lightning()
        check_accelerator(kwargs.get("accelerator"))
        for key, (default, instead) in OWNED_BY_ROUNDS.items():
            if kwargs.pop(key, default) != default:
                raise ValueError(f"trainer.{key} is set by fedrcl's round loop: {instead}")
        for key, (allowed, why) in ONE_VALUE.items():
            if kwargs.get(key, allowed[0]) not in allowed:
                raise ValueError(f"trainer.{key} must stay {allowed[-1]}, got {kwargs[key]}: {why}")
        if kwargs.get("barebones"):
            raise ValueError("trainer.barebones: Lightning's barebones mode turns off the loggers and callbacks a "
                             "federated run is made of (the round loop, checkpoints, evaluation's EMA); it must "
                             "stay false")
        for key, value in (("rounds", rounds), ("eval_every", eval_every), ("checkpoint_every", checkpoint_every)):
            if value < 1:
                raise ValueError(f"trainer.{key} must be >= 1, got {value}")
        self.federation = Federation(clients_per_round, participation, local_epochs, server, seed,
                                     allow_changes=resume_allow_changes or (),
                                     client_batching=ClientBatching(client_batching, compile_clients),
                                     privacy=privacy)
        callbacks = list(kwargs.pop("callbacks", None) or [])
        callbacks += round_timer(kwargs.pop("max_time", None), callbacks)  # checked after each round
        callbacks.append(Preemption())  # SIGTERM: stop after the round in progress, checkpointed
        callbacks.append(ScalarLayout())  # TensorBoard's Custom Scalars tab: val/acc and val/acc_ema first
        if kwargs.get("enable_checkpointing", True) is not False:  # a user's ModelCheckpoint adds files
            callbacks.append(RoundCheckpoint(checkpoint_every))
        kwargs["plugins"] = with_atomic_checkpoint_io(kwargs.get("plugins"))
        if not any(isinstance(c, ProgressBar) for c in callbacks):  # a line per round, also without a bar
            progress = round_progress(kwargs.get("enable_progress_bar"), kwargs.get("logger"))
            callbacks += [progress] if progress is not None else []
        if kwargs.get("enable_model_summary") is not False and not kwargs.get("barebones") \
                and not any(isinstance(c, ModelSummary) for c in callbacks):
            callbacks.append(WeightsSummary())  # in place of Lightning's (its FLOPs read 0 here)
            kwargs["enable_model_summary"] = False  # Lightning would add its own beside it, with a notice
        if kwargs.get("logger") in (None, True):
            kwargs["logger"] = TensorBoardLogger(save_dir=kwargs.get("default_root_dir") or "runs", name="fedrcl")
        with federated_ddp_names():  # several processes: clients split over them, no gradient sync
            super().__init__(
                max_epochs=rounds, check_val_every_n_epoch=eval_every, num_sanity_val_steps=0,
                reload_dataloaders_every_n_epochs=1, callbacks=[self.federation, *callbacks], **kwargs)
        check_federated_strategy(self.strategy)
        check_nodes(self)
        check_save_dirs(self)
        log_against_rounds(self)
        self._signal_connector = PreemptionSignals(self)

    @property
    def global_step(self) -> int:
        """The clients' local steps so far, every client of every process counted at each round's end, on every
        backend (the checkpoint's ``global_step``). Lightning's own count is of its optimizer's steps, which are not
        client steps on every backend: one batched step is a step of each of K clients; Flower's server takes one
        step a round."""
        return self.federation.client_steps

    @property
    def rounds(self) -> int:
        assert self.max_epochs is not None  # set from trainer.rounds in __init__
        return self.max_epochs

    def fit(self, model: L.LightningModule,  # type: ignore[override]  # str ckpt_path
            train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: Optional[L.LightningDataModule] = None, ckpt_path: Optional[str] = None,
            weights_only: Optional[bool] = None) -> None:
        """Train the federation round by round, evaluating and checkpointing the global model.

        Lightning's ``fit``: ``ckpt_path="last"`` resumes from the newest usable checkpoint of the run name
        (``fedrcl.federated.checkpoint.find_resumable``); a checkpoint of another configuration is refused
        before anything is loaded. A stop signal ends the run after its round (``Preempted``). A write into
        the run folder that fails without naming a file (the folder deleted, a full disk) is named
        (``fedrcl.federated.run_folder``)."""
        if ckpt_path is not None:
            ckpt_path = resume_path(self, model, datamodule, ckpt_path)
            # Lightning restores the weights before it converts the module to the run's precision: float64
            # weights (64-true) would pass through the float32 module and come back rounded (7e-9 in FedAvg's
            # weights after a resume). Converted first, they load as saved.
            self.precision_plugin.convert_module(model)
        with warnings.catch_warnings(), quiet_writer_threads():
            # A run stopped by its trainer.max_time and resumed without one: its Timer's state is not needed.
            warnings.filterwarnings("ignore", message=r".*add the following callbacks: \['Timer'\]")
            try:
                super().fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)
            except Exception as error:
                named = run_folder_error(self, error)
                if named is None:
                    raise
                raise named from error
        stop = preempted(self)
        if stop is not None:  # exit status 128 + signal, after the round's checkpoint
            raise stop

    def validate(self, model: Optional[L.LightningModule] = None,  # type: ignore[override]  # str ckpt_path
                 dataloaders: Any = None, ckpt_path: Optional[str] = None, verbose: bool = True,
                 datamodule: Optional[L.LightningDataModule] = None, weights_only: Optional[bool] = None) -> Any:
        """Evaluate a checkpoint's global model on the test set (``val/acc``, and the checkpoint's accuracy EMA).

        Lightning's ``validate``; ``ckpt_path="last"``: the run name's newest usable checkpoint."""
        ckpt_path = self._evaluated_checkpoint(model, datamodule, ckpt_path)
        return super().validate(model, dataloaders, ckpt_path, verbose, datamodule, weights_only)

    def test(self, model: Optional[L.LightningModule] = None,  # type: ignore[override]  # str ckpt_path
             dataloaders: Any = None, ckpt_path: Optional[str] = None, verbose: bool = True,
             datamodule: Optional[L.LightningDataModule] = None, weights_only: Optional[bool] = None) -> Any:
        """Evaluate a checkpoint's global model on the test set, logged as ``test/acc``.

        Lightning's ``test``; ``ckpt_path="last"`` as in ``validate``."""
        ckpt_path = self._evaluated_checkpoint(model, datamodule, ckpt_path)
        return super().test(model, dataloaders, ckpt_path, verbose, datamodule, weights_only)

    def _evaluated_checkpoint(self, model: Optional[L.LightningModule], datamodule: Any,
                              ckpt_path: Optional[str]) -> Optional[str]:
        """``"last"``: the newest usable checkpoint of the run name whose method, backbone and dataset are this
        config's (its training settings do not matter to an evaluation). The module is converted to the run's
        precision first, so a float64 checkpoint is read as saved (see ``fit``)."""
        if model is not None and ckpt_path is not None:
            self.precision_plugin.convert_module(model)
        if ckpt_path != "last" or model is None:
            return ckpt_path
        fingerprint = run_fingerprint(self, model, datamodule)
        shape = ("model", "model.backbone", "model.init_args.backbone", "data.dataset")
        training_only = tuple(k for k in fingerprint if not any(k == s or k.startswith(s + ".") for s in shape))
        return find_resumable(self, fingerprint, training_only, purpose="evaluating")
