"""FederatedStrategy: a round's clients over processes, GPUs and nodes, on Lightning's DDP launch.

Federated clients are independent until aggregation, so a multi-process round needs Lightning's process
launch (subprocess, spawn, fork, torchrun, SLURM), device placement and collectives, and *no* gradient
synchronisation. ``FederatedStrategy`` is Lightning's ``DDPStrategy`` without the
``DistributedDataParallel`` wrapper: each process trains its share of the round's clients
(``Federation.plan``: ``sampled[rank::world_size]``, so processes may run different step counts), and the
processes meet only at the round's end, in the aggregation's all-reduce (``WeightedSum.mean``), the
train-loss reduction (``fedrcl.contract.processes``), evaluation (torchmetrics) and checkpointing.

Lightning's plain DDP would average the gradients of *different clients* at every step (and hang when
they run different step counts), so a ``FederatedTrainer`` never runs it: inside its constructor
Lightning's DDP names (``ddp``, ``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``, and what ``auto`` picks
for several devices or nodes) build this strategy (``federated_ddp_names``), and any other
multi-process strategy is an error (``check_federated_strategy``).
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy, Strategy, StrategyRegistry

# Lightning's DDP names (start method of each) and this strategy's own names for the same launches.
_LIGHTNING_DDP = {"ddp": "popen", "ddp_spawn": "spawn", "ddp_fork": "fork", "ddp_notebook": "fork"}
_FEDERATED = {"federated": "popen", "federated_spawn": "spawn", "federated_fork": "fork"}


class FederatedStrategy(DDPStrategy):
    """Lightning's DDP launch and collectives (gloo on CPU, NCCL on GPU) without gradient synchronisation.

    Select it with ``--trainer.strategy ddp`` (or ``federated``; ``ddp_spawn`` / ``federated_spawn`` start
    processes with ``spawn``), or leave ``auto`` with several devices or ``--trainer.num_nodes`` > 1.
    The processes start from rank 0's initial model; from then on they hold the same global model after
    every round because every one of them runs the same server step on the same all-reduced client mean.

    Args:
        process_group_backend: ``gloo``, ``nccl``, ...; null: gloo on CPU, NCCL on CUDA.
        start_method: ``popen`` (re-run the command per process; also torchrun and SLURM, which start the
            processes themselves), ``spawn`` or ``fork``.
    """

    strategy_name = "federated"

    def __init__(self, accelerator: Any = None, parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision_plugin: Any = None,
                 process_group_backend: Optional[str] = None,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen"):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         start_method=start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        # The federation's round-level logs are equal on every process (the values that differ are reduced
        # by the federation itself), so Lightning's advice to sync every epoch-level log does not apply.
        warnings.filterwarnings("ignore", message=r".*when logging on epoch level in distributed setting")

    def setup(self, trainer: L.Trainer) -> None:
        if self._layer_sync is not None:
            raise ValueError("trainer.sync_batchnorm synchronises the batch statistics of different clients "
                             "at every step; federated clients are independent: set it to false")
        # Lightning (2.6 here; PR #20825) broadcasts rank 0's SIGTERM flag at every training step. Processes
        # here run different step counts, so that broadcast would pair with another process's round-end
        # all-reduce and hang (and it is a host sync per step). A stop signal is handled once per round instead
        # (``fedrcl.federated.preemption``: every process stops after the same round, checkpointed).
        loop = trainer.fit_loop.epoch_loop
        if hasattr(loop, "_broadcast_sigterm_tensor"):
            loop._broadcast_sigterm_tensor = _no_per_step_collective  # type: ignore[method-assign]
        super().setup(trainer)

    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel``: the processes only start from rank 0's weights."""
        assert self.model is not None  # connected before configure_ddp
        with torch.no_grad():
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=0)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in _FEDERATED.items():
            strategy_registry.register(name, cls, override=True, start_method=start_method,
                                       description=f"federated rounds, start method {start_method}")


FederatedStrategy.register_strategies(StrategyRegistry)


def _no_per_step_collective() -> None:
    """Stands in for Lightning's per-step SIGTERM broadcast (see ``FederatedStrategy.setup``)."""


@contextmanager
def federated_ddp_names() -> Iterator[None]:
    """Within the block, Lightning's DDP names (including ``auto``'s pick) build a ``FederatedStrategy``."""
    saved = {name: StrategyRegistry[name] for name in _LIGHTNING_DDP}
    try:
        for name, start_method in _LIGHTNING_DDP.items():
            StrategyRegistry.register(name, FederatedStrategy, override=True, start_method=start_method,
                                      description=f"federated rounds, start method {start_method}")
        yield
    finally:
        StrategyRegistry.update(saved)


def check_federated_strategy(strategy: Strategy) -> None:
    """Stop with a clear error if ``strategy`` runs several processes but is no ``FederatedStrategy``."""
    if isinstance(strategy, ParallelStrategy) and not isinstance(strategy, FederatedStrategy):
        raise ValueError(
            f"trainer.strategy {type(strategy).__name__} would synchronise the gradients of different "
            "clients at every step; use trainer.strategy ddp (or federated, ddp_spawn, federated_spawn), "
            "which fedrcl runs as fedrcl.federated.strategy.FederatedStrategy")
