"""RepresentationMonitor: the paper's representation measurements (Figures 2-3), logged every N rounds.

Add it to a run like any Lightning callback::

    trainer:
      callbacks:
        - class_path: fedrcl.analysis.RepresentationMonitor
          init_args: {every_n_rounds: 5, num_samples: 1000}

or ``fedrcl fit ... --trainer.callbacks+=fedrcl.analysis.RepresentationMonitor``.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor, nn
from torch.func import functional_call

from fedrcl.analysis.metrics import _vci, class_covariances, deviation_bound, effective_rank
from fedrcl.data.datamodule import datamodule_of
from fedrcl.contract.context import ClientContext
from fedrcl.federated.federation import RoundCallback


class RepresentationMonitor(RoundCallback):
    """Effective rank, VCI and class variances of each feature level, and the share of ``D(x) < 1``.

    After every ``every_n_rounds``-th round (rounds counted from 1) it measures the new global model,
    and with ``include_local`` also the round's last local model: the weights of the round's last client
    after its last local step, before aggregation (the paper's Figure 2 measures local models). For each
    feature level ``l`` of the backbone (``ModelOutput.features``, 0-based as in ``train/loss_scl_level{l}``),
    on a fixed seeded subset of the test set:

    - ``repr/level{l}/effective_rank``: effective rank of the feature covariance ``Sigma_T``;
    - ``repr/level{l}/vci``: variability collapse index;
    - ``repr/level{l}/within_trace``, ``repr/level{l}/between_trace``: ``Tr(Sigma_W)``, ``Tr(Sigma_B)``.

    With ``deviation``, ``repr/deviation_below_1`` is the share of the round's last client's training
    samples (un-augmented, at most ``num_samples``) whose deviation bound ``D(x)`` (paper, Definition 1) is
    below 1, with ``phi(x)`` the input of the backbone's final linear layer ``fc`` (the ReLU of the last
    level when the backbone has none). The local model's values are logged under ``repr/local/...``.
    ``time/repr_seconds`` is the time the measurement took. All are logged with the round as the step.

    Cost: per model, a forward pass of the ``num_samples`` test images and of up to ``num_samples`` of the
    last client's samples, then a ``D x D`` SVD and pseudo-inverse per level in float64 (the forward passes
    are nearly all of it). Measured for the small CNN on CIFAR-10 (levels of 32/64/384/192 dims),
    ``num_samples=1000``, a 500-sample client, one CPU thread on a shared 2-core machine: 0.7 s per model,
    1.3 s per call with ``include_local``, which is 0.17x one CPU-scale round of 250 local CE steps of batch
    50 timed in the same process; with ``every_n_rounds=5`` about 3% of the training time.

    The measurement reads no random state and changes no weights, so a run's training is the same with
    and without the monitor. Needs a ``FederatedTrainer`` and a ``FederatedDataModule``. With several
    processes each measures its own last client; the logger writes rank 0's values. On Flower's server, where the
    local models stay on the nodes, it measures the global model (``D(x)`` on the round's last client's samples).

    Args:
        every_n_rounds: measure after every this many rounds.
        num_samples: test images measured (a fixed subset drawn with ``seed``; the whole test set if it is
            smaller), and the most client samples used for ``D(x)``.
        include_local: also measure the round's last local model (``repr/local/...``).
        deviation: also log the share of the last client's samples with ``D(x) < 1``.
        seed: seed of the test subset and of the client subset.
    """

    def __init__(self, every_n_rounds: int = 5, num_samples: int = 1000, include_local: bool = True,
                 deviation: bool = True, seed: int = 0):
        if every_n_rounds < 1:
            raise ValueError(f"RepresentationMonitor.every_n_rounds must be >= 1, got {every_n_rounds}")
        if num_samples < 2:
            raise ValueError(f"RepresentationMonitor.num_samples must be >= 2, got {num_samples}")
        self.every_n_rounds, self.num_samples = every_n_rounds, num_samples
        self.include_local, self.deviation, self.seed = include_local, deviation, seed
        self._test: Optional[tuple[Tensor, Tensor]] = None
        self._local: Optional[dict[str, Tensor]] = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not hasattr(trainer, "federation"):
            raise TypeError("RepresentationMonitor needs a FederatedTrainer (trainer.class_path)")

    def _due(self, trainer: L.Trainer) -> bool:
        return (trainer.current_epoch + 1) % self.every_n_rounds == 0

    # -- the last local model: the round's last client's weights at its end, before aggregation ------------
    def on_client_end(self, trainer: L.Trainer, pl_module: L.LightningModule, client: ClientContext,
                      local_state: Mapping[str, Tensor]) -> None:
        if not self._due(trainer):
            return
        if self.include_local:  # into one buffer, reused: the last client's weights remain
            if self._local is None:
                self._local = {k: v.detach().clone() for k, v in local_state.items()}
            else:
                for key, value in local_state.items():
                    self._local[key].copy_(value)

    # -- measuring ----------------------------------------------------------------------------------------
    def round_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        if not self._due(trainer):
            return {}
        started = time.perf_counter()
        client_id = trainer.federation.plan(trainer.current_epoch).client_ids[-1]  # type: ignore[attr-defined]
        backbone, dm = pl_module.backbone, datamodule_of(trainer)
        assert isinstance(backbone, nn.Module)  # a fedrcl client algorithm's
        metrics = self.measure(backbone, dm, client_id)
        if self._local is not None:
            local = self.measure(backbone, dm, client_id, state=self._local)
            metrics.update({k.replace("repr/", "repr/local/", 1): v for k, v in local.items()})
            self._local = None
        metrics["time/repr_seconds"] = time.perf_counter() - started
        return metrics

    def test_subset(self, datamodule: Any) -> tuple[Tensor, Tensor]:
        """The fixed test subset: normalised images and labels, on the data's device (built once)."""
        if self._test is None:
            idx = self._subset(len(datamodule.y_test), datamodule.y_test.device)
            images = datamodule.model_input(datamodule.x_test[idx])
            self._test = images, datamodule.y_test[idx]
        return self._test

    def _subset(self, n: int, device: torch.device) -> Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randperm(n, generator=gen)[:self.num_samples].sort().values.to(device)

    @torch.no_grad()
    def measure(self, backbone: nn.Module, datamodule: Any, client_id: int,
                state: Optional[dict[str, Tensor]] = None) -> dict[str, float]:
        """The metrics of ``backbone`` (with the weights ``state`` if given) under their ``repr/`` names."""
        was_training = backbone.training
        backbone.eval()
        try:
            images, labels = self.test_subset(datamodule)
            _, features, _ = _forward(backbone, state, images, datamodule.eval_batch_size)
            metrics: dict[str, float] = {}
            for level, feats in enumerate(features):
                within, between, total = class_covariances(feats, labels)
                metrics[f"repr/level{level}/effective_rank"] = effective_rank(total)
                metrics[f"repr/level{level}/vci"] = _vci(between, total)
                metrics[f"repr/level{level}/within_trace"] = float(torch.trace(within))
                metrics[f"repr/level{level}/between_trace"] = float(torch.trace(between))
            if self.deviation:
                indices = datamodule.client_indices[client_id]
                indices = indices[self._subset(len(indices), indices.device)]
                client_images = datamodule.model_input(datamodule.x_train[indices])
                logits, _, phi = _forward(backbone, state, client_images, datamodule.eval_batch_size)
                bound = deviation_bound(phi, logits.softmax(dim=1), datamodule.y_train[indices])
                metrics["repr/deviation_below_1"] = float((bound < 1).double().mean())
            return metrics
        finally:
            backbone.train(was_training)


def _forward(backbone: nn.Module, state: Optional[dict[str, Tensor]], images: Tensor,
             batch_size: int) -> tuple[Tensor, list[Tensor], Tensor]:
    """Logits, per-level features and classifier input of ``images`` (in the weights' dtype: float64 under
    ``--trainer.precision 64-true``), in chunks of ``batch_size``."""
    images = images.to(next(backbone.parameters()).dtype)
    inputs: list[Tensor] = []
    head = getattr(backbone, "fc", None)
    handle = head.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) \
        if isinstance(head, nn.Linear) else None
    try:
        outputs = [backbone(chunk) if state is None else functional_call(backbone, state, (chunk,))
                   for chunk in images.split(batch_size)]
    finally:
        if handle is not None:
            handle.remove()
    logits = torch.cat([o.logits for o in outputs])
    features = [torch.cat(level) for level in zip(*(o.features for o in outputs))]
    phi = torch.cat(inputs) if inputs else torch.relu(features[-1])
    return logits, features, phi
