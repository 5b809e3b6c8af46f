"""Per-client evaluation: the global model on every client's label mix, and the round's local models.

Turned on from the command line or in a config::

    fedrcl fit ... --trainer.callbacks+=fedrcl.analysis.ClientEvaluation
    trainer:
      callbacks:
        - class_path: fedrcl.analysis.ClientEvaluation
          init_args: {every_n_rounds: 5}

A client's "local test" accuracy (the usual one of personalised FL) is the accuracy on the test set
reweighted to the client's class mix: with ``a_c`` the per-class test accuracy of a model and ``p_kc`` the
share of class ``c`` in client ``k``'s training data, ``acc_k = sum_c p_kc a_c`` (``label_mix_accuracy``).
It needs one pass over the test set per model, whatever the number of clients.
"""
from __future__ import annotations

import csv
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor, nn
from torch.func import functional_call

from fedrcl.data.datamodule import datamodule_of
from fedrcl.contract.context import ClientContext
from fedrcl.federated.federation import RoundCallback

__all__ = ["ClientEvaluation", "class_accuracy_counts", "label_mix_accuracy", "spread_summary"]

CSV_NAME, PNG_NAME = "client_evaluation.csv", "client_evaluation.png"
COLUMNS = ("round", "client_id", "num_samples", "global_mix_acc", "local_test_acc", "local_own_mix_acc")


def class_accuracy_counts(predictions: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """``(correct, total)`` per class (``[C]`` each, int64): correct predictions and samples of each class."""
    total = torch.bincount(labels, minlength=num_classes)
    correct = torch.bincount(labels[predictions == labels], minlength=num_classes)
    return correct, total


def label_mix_accuracy(correct: Tensor, total: Tensor, class_counts: Tensor) -> Tensor:
    """Accuracy on each client's label mix: ``acc_k = sum_c p_kc correct_c / total_c`` (float64).

    Args:
        correct: ``[C]`` correct test predictions per class.
        total: ``[C]`` test samples per class; classes without test samples are left out and the client's
            mix is renormalised over the others.
        class_counts: ``[K, C]`` (or ``[C]`` for one client) training samples of each class per client.

    Returns:
        ``[K]`` (or a scalar), NaN for a client none of whose classes has test samples.
    """
    present = total > 0
    per_class = correct.double() / total.clamp(min=1).double()
    weights = class_counts.double() * present.double()
    return (weights * per_class).sum(-1) / weights.sum(-1)


def spread_summary(accuracies: Tensor, worst_fraction: float = 0.1) -> dict[str, float]:
    """Mean, mean of the worst ``worst_fraction`` (at least one client) and std (over all clients, ddof 0)."""
    values = accuracies.double()
    worst = max(1, math.ceil(worst_fraction * len(values)))
    return {"mean": float(values.mean()), "worst10": float(values.sort().values[:worst].mean()),
            "std": float(values.std(unbiased=False))}


class ClientEvaluation(RoundCallback):
    """Every ``every_n_rounds`` rounds (counted from 1), per client and over clients:

    - the new global model's accuracy on each client's label mix (all clients): logged as
      ``clients/global_mix_acc_mean``, ``..._worst10`` (mean of the worst 10% of clients) and ``..._std``;
    - each of the round's local models (its weights after local training, before aggregation): accuracy on
      the whole test set and on its own label mix, logged as ``clients/local_test_acc_{mean,min}`` and
      ``clients/local_own_mix_acc_{mean,min}`` over the round's clients;
    - ``client_evaluation.csv`` beside the run's config.yaml (one row per client and measured round,
      rewritten atomically) and ``client_evaluation.png`` (the latest histograms);
    - ``time/client_eval_seconds``, also counted as evaluation time in ``time/evaluation_seconds``.

    Cost: in a measured round, one forward pass of the test subset for the global model and one per local
    model. Measured (``bench/client_evaluation_cost.py``: small CNN, CIFAR-shaped data, one CPU thread on a
    heavily shared 2-core machine): one pass over 10000 test images costs 0.38 of a CPU-scale training round
    (5 clients x 50 steps of batch 50), so with the whole test set a measured round with 5 clients costs 2.3
    training rounds (+46% at ``every_n_rounds=5``); with the default 2000 images, 0.53 rounds (+11%); 1000
    images at ``every_n_rounds=10`` would be about +3%. Evaluation changes no weights and draws no random
    numbers, so the training curve is the same with and without it. The local models come from the round's
    client-end point (``RoundCallback.on_client_end``), sequential or batched.

    Args:
        every_n_rounds: measure after every this many rounds.
        max_test_samples: evaluate every model on the same fixed seeded subset of this many test images
            (null: the whole test set).
        histogram: write the histogram PNG (matplotlib) at each measured round.
        seed: seed of the test subset.
    """

    def __init__(self, every_n_rounds: int = 5, max_test_samples: Optional[int] = 2000,
                 histogram: bool = True, seed: int = 0):
        if every_n_rounds < 1:
            raise ValueError(f"ClientEvaluation.every_n_rounds must be >= 1, got {every_n_rounds}")
        if max_test_samples is not None and max_test_samples < 1:
            raise ValueError(f"ClientEvaluation.max_test_samples must be >= 1 or null, got "
                             f"{max_test_samples}")
        self.every_n_rounds, self.max_test_samples = every_n_rounds, max_test_samples
        self.histogram, self.seed = histogram, seed
        self._test: Optional[tuple[Tensor, Tensor]] = None
        self._class_counts: Optional[Tensor] = None
        self._local: dict[int, tuple[float, float]] = {}
        self._seconds = 0.0
        self._rows: list[dict[str, Any]] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not hasattr(trainer, "federation"):
            raise TypeError("ClientEvaluation needs a FederatedTrainer (trainer.class_path)")

    def _due(self, trainer: L.Trainer) -> bool:
        return (trainer.current_epoch + 1) % self.every_n_rounds == 0

    def class_counts(self, datamodule: Any) -> Tensor:
        """``[K, C]`` training samples of each class per client (built once)."""
        if self._class_counts is None:
            self._class_counts = torch.stack([
                torch.bincount(datamodule.y_train[idx], minlength=datamodule.num_classes)
                for idx in datamodule.client_indices]).cpu()
        return self._class_counts

    def test_set(self, datamodule: Any) -> tuple[Tensor, Tensor]:
        """The (possibly subsampled) test images, normalised, and their labels, on the data's device."""
        if self._test is None:
            n = len(datamodule.y_test)
            idx = torch.arange(n)
            if self.max_test_samples is not None and self.max_test_samples < n:
                gen = torch.Generator().manual_seed(self.seed)
                idx = torch.randperm(n, generator=gen)[:self.max_test_samples].sort().values
            idx = idx.to(datamodule.y_test.device)
            images = datamodule.model_input(datamodule.x_test[idx])
            self._test = images, datamodule.y_test[idx]
        return self._test

    @torch.no_grad()
    def class_counts_correct(self, backbone: nn.Module, datamodule: Any,
                             state: Optional[Mapping[str, Tensor]] = None) -> tuple[Tensor, Tensor]:
        """Per-class ``(correct, total)`` on the test set of ``backbone`` (with the weights ``state``; the images in
        the weights' dtype: float64 under ``--trainer.precision 64-true``)."""
        images, labels = self.test_set(datamodule)
        images = images.to(next(backbone.parameters()).dtype)
        was_training = backbone.training
        backbone.eval()
        try:
            outputs = [backbone(chunk) if state is None else functional_call(backbone, dict(state), (chunk,))
                       for chunk in images.split(datamodule.eval_batch_size)]
            predictions = torch.cat([out.logits.argmax(1) for out in outputs])
        finally:
            backbone.train(was_training)
        correct, total = class_accuracy_counts(predictions, labels, datamodule.num_classes)
        return correct.cpu(), total.cpu()

    # -- the round's local models, at each client's end (called by the federation) -------------------------
    def on_client_end(self, trainer: L.Trainer, pl_module: L.LightningModule, client: ClientContext,
                      local_state: Mapping[str, Tensor]) -> None:
        if not self._due(trainer):
            return
        started = time.perf_counter()
        backbone, dm = pl_module.backbone, datamodule_of(trainer)
        assert isinstance(backbone, nn.Module)  # a fedrcl client algorithm's
        correct, total = self.class_counts_correct(backbone, dm, local_state)
        own = label_mix_accuracy(correct, total, self.class_counts(dm)[client.client_id])
        self._local[client.client_id] = float(correct.sum() / total.sum()), float(own)
        self._seconds += time.perf_counter() - started

    # -- the global model, after the round ------------------------------------------------------------------
    def round_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        if not self._due(trainer):
            return {}
        started = time.perf_counter()
        backbone, dm = pl_module.backbone, datamodule_of(trainer)
        assert isinstance(backbone, nn.Module)  # a fedrcl client algorithm's
        correct, total = self.class_counts_correct(backbone, dm)
        counts = self.class_counts(dm)
        global_mix = label_mix_accuracy(correct, total, counts)
        metrics = {f"clients/global_mix_acc_{k}": v for k, v in spread_summary(global_mix).items()}
        if self._local:
            local = torch.tensor(list(self._local.values()), dtype=torch.float64)
            for column, name in enumerate(("local_test_acc", "local_own_mix_acc")):
                metrics[f"clients/{name}_mean"] = float(local[:, column].mean())
                metrics[f"clients/{name}_min"] = float(local[:, column].min())
        round_number = trainer.current_epoch + 1
        for client_id, acc in enumerate(global_mix.tolist()):
            test_acc, own_acc = self._local.get(client_id, (None, None))
            self._rows.append({"round": round_number, "client_id": client_id,
                               "num_samples": int(counts[client_id].sum()), "global_mix_acc": acc,
                               "local_test_acc": test_acc, "local_own_mix_acc": own_acc})
        log_dir = trainer.log_dir  # collective on several processes: every rank asks
        if trainer.is_global_zero and log_dir is not None:
            self._write(Path(log_dir), round_number, global_mix, list(self._local.values()))
        self._local = {}
        global_seconds = time.perf_counter() - started
        if self.ledger is not None:  # the local models' time is counted at their on_client_end
            self.ledger.add("evaluation", global_seconds)
        metrics["time/client_eval_seconds"] = self._seconds + global_seconds
        self._seconds = 0.0
        return metrics

    def _write(self, log_dir: Path, round_number: int, global_mix: Tensor,
               local: list[tuple[float, float]]) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / CSV_NAME
        tmp = path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(self._rows)
        os.replace(tmp, path)
        if self.histogram:
            _histogram(log_dir / PNG_NAME, round_number, global_mix, local)


def _histogram(path: Path, round_number: int, global_mix: Tensor, local: list[tuple[float, float]]) -> None:
    """Histograms of the global model's per-client accuracy and of the local models' (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    bins = [i / 20 for i in range(21)]
    axes[0].hist(global_mix.numpy(), bins=bins, color="tab:blue")
    axes[0].set_title(f"global model on each client's label mix ({len(global_mix)} clients)", fontsize=9)
    if local:
        axes[1].hist([[a for a, _ in local], [b for _, b in local]], bins=bins,
                     label=["on the test set", "on its own label mix"])
        axes[1].legend(fontsize=8)
    axes[1].set_title(f"the round's {len(local)} local models", fontsize=9)
    for ax in axes:
        ax.set_xlabel("accuracy")
        ax.set_ylabel("clients")
    fig.suptitle(f"round {round_number}", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
