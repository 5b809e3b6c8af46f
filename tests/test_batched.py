"""Batched clients (``trainer.client_batching``): the same training as clients one after another."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import run_cli

RESNET8 = ("--model.init_args.backbone", "fedrcl.models.ResNet18",
           "--model.init_args.backbone.init_args.width", "8")


def train_logs(log_dir: Path) -> dict[str, list[float]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"] if tag.startswith("train/")}


def fit(data_root, save_dir, mode, model, *extra):
    cli = run_cli(data_root, save_dir, "--trainer.client_batching", mode, "--trainer.precision", "64-true",
                  "--data.local_iters_per_epoch", "3", *extra, rounds=2, model=model)
    weights = {k: v.detach().clone() for k, v in cli.model.backbone.state_dict().items()}
    return weights, train_logs(Path(cli.trainer.logger.log_dir)), cli


def assert_equal_runs(a, b):
    (wa, la, _), (wb, lb, _) = a, b
    assert wa.keys() == wb.keys()
    for key, value in wa.items():
        torch.testing.assert_close(wb[key], value, rtol=1e-5, atol=1e-7, msg=key)
    assert la.keys() == lb.keys() and "train/loss" in la
    for tag, values in la.items():
        assert len(values) == 2, tag
        assert lb[tag] == pytest.approx(values, rel=1e-5, abs=1e-7), tag


@pytest.mark.parametrize("model", ["fedrcl.algorithms.FedAvg", "fedrcl.algorithms.FedRCL", "fedrcl.algorithms.FedNTD"])
@pytest.mark.parametrize("backbone", ["cnn", "resnet8"])
def test_batched_clients_equal_sequential(data_root, tmp_path, model, backbone):
    extra = RESNET8 if backbone == "resnet8" else ()
    seq = fit(data_root, tmp_path / "seq", "off", model, *extra)
    bat = fit(data_root, tmp_path / "bat", "on", model, *extra)
    assert bat[2].trainer.federation.plan(1).batched and not seq[2].trainer.federation.plan(1).batched
    assert_equal_runs(seq, bat)
