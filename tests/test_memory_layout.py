"""data.channels_last: the same image batches in another memory layout, and a run that differs only by rounding."""
from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
import torch

from conftest import REPO
from fedrcl.algorithms import FedAvg
from fedrcl.data.datamodule import FederatedDataModule, channels_last_breaks
from fedrcl.federated.trainer import FederatedTrainer
from fedrcl.models import ResNet18, SmallCNN


@pytest.fixture(scope="module")
def rgb_root(tmp_path_factory):
    """A CIFAR-shaped npz (3 channels, 32 px) small enough for a run of a few seconds."""
    root = tmp_path_factory.mktemp("rgb")
    rng = np.random.default_rng(0)
    np.savez(root / "cifar10.npz", x_train=rng.integers(0, 256, (200, 32, 32, 3), dtype=np.uint8),
             y_train=rng.integers(0, 10, 200).astype(np.int64),
             x_test=rng.integers(0, 256, (60, 32, 32, 3), dtype=np.uint8),
             y_test=rng.integers(0, 10, 60).astype(np.int64), classes=np.array([str(c) for c in range(10)]))
    return root


def datamodule(root, layout):
    dm = FederatedDataModule(dataset="cifar10", root=str(root), num_clients=4, partition="iid", batch_size=10,
                             local_iters_per_epoch=2, eval_batch_size=25, channels_last=layout)
    dm.setup("validate")
    return dm


def test_channels_last_batches_hold_the_same_values(rgb_root):
    dms = {layout: datamodule(rgb_root, layout) for layout in ("on", "off", "auto")}
    train = {k: list(dm.client_batches(1, 3, 2, 0)) for k, dm in dms.items()}
    evals = {k: list(dm.val_dataloader()) for k, dm in dms.items()}
    for batches in (train, evals):
        for (x_on, y_on), (x_off, y_off), (x_auto, _) in zip(batches["on"], batches["off"], batches["auto"]):
            assert torch.equal(x_on, x_off) and torch.equal(y_on, y_off)
            assert x_on.is_contiguous(memory_format=torch.channels_last) and not x_on.is_contiguous()
            assert x_off.is_contiguous()
            assert x_auto.is_contiguous(memory_format=torch.channels_last)  # auto on the CPU: on


def test_bad_layout_names_the_key(rgb_root):
    with pytest.raises(ValueError, match=r"data.channels_last must be one of auto, on, off, got 'yes'"):
        FederatedDataModule(dataset="cifar10", root=str(rgb_root), channels_last="yes")


def final_weights(root, layout, backbone=SmallCNN):
    """Two rounds of FedAvg. Not FedRCL: its top-k choice of positives and negatives can flip when two
    similarities differ by a rounding error, so on some CPUs its runs part by 1e-4 after a few steps."""
    torch.manual_seed(0)
    model = FedAvg(backbone=backbone, num_classes=10)
    trainer = FederatedTrainer(rounds=2, clients_per_round=2, local_epochs=1, accelerator="cpu", devices=1,
                               logger=False, enable_checkpointing=False, enable_progress_bar=False,
                               enable_model_summary=False)
    dm = FederatedDataModule(dataset="cifar10", root=str(root), num_clients=4, partition="iid", batch_size=10,
                             local_iters_per_epoch=2, eval_batch_size=25, channels_last=layout)
    trainer.fit(model, datamodule=dm)
    return model.backbone.state_dict(), trainer.callback_metrics["val/acc"].item()


def test_a_channels_last_run_differs_only_by_rounding(rgb_root):
    (on, acc_on), (off, acc_off) = final_weights(rgb_root, "on"), final_weights(rgb_root, "off")
    assert acc_on == acc_off
    for key, value in on.items():
        assert value.is_contiguous()  # the weights keep their layout: aggregation and checkpoints as before
        torch.testing.assert_close(value, off[key], rtol=1e-4, atol=1e-5, msg=key)
    assert any(not torch.equal(value, off[key]) for key, value in on.items())  # another kernel really ran


def test_the_layers_whose_cpu_backward_breaks_in_channels_last_are_the_narrow_strided_1x1_convolutions():
    # width 2: the shortcuts into layers 2 and 3 have 2 and 4 input channels
    assert channels_last_breaks(ResNet18(10, width=2)) == ["layer2.0.downsample.0", "layer3.0.downsample.0"]
    assert channels_last_breaks(ResNet18(10, width=4)) == ["layer2.0.downsample.0"]
    assert channels_last_breaks(ResNet18(10, width=8)) == []   # the paper's widths, and the CPU runs'
    assert channels_last_breaks(SmallCNN(num_classes=10)) == []


NARROW_RUN = """
import sys
from functools import partial
from test_memory_layout import final_weights
from fedrcl.models import ResNet18
final_weights(sys.argv[1], "auto", partial(ResNet18, width=4))
print("finished")
"""


def test_auto_trains_a_narrow_resnet_in_the_default_layout_and_on_is_refused(rgb_root):
    """Width 4 has a shortcut with 4 input channels: in channels-last, PyTorch 2.14.1's CPU backward crashed the
    process there (``double free or corruption``). ``auto`` trains it in the default layout (in a child process,
    so that a crash fails this test, not the worker); ``on`` is refused, naming the key and the layer."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    done = subprocess.run([sys.executable, "-c", NARROW_RUN, str(rgb_root)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "finished" in done.stdout, done.stderr[-2000:]
    assert "data.channels_last auto: off, for backbone.layer2.0.downsample.0" in done.stdout + done.stderr
    with pytest.raises(ValueError, match=r"data.channels_last=on: .* backbone.layer2.0.downsample.0 .* set "
                                         r"data.channels_last to auto or off"):
        final_weights(rgb_root, "on", partial(ResNet18, width=4))
