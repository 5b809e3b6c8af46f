"""A user's backbone with BatchNorm (buffers: running statistics) under the methods that keep server memory
per entry (SCAFFOLD) or step by ``client_direction`` (the SAM family): clients train one after another."""
from __future__ import annotations

import torch
from torch import nn

from conftest import REPO, run_cli
from fedrcl.models.output import ModelOutput

CONFIGS = REPO / "configs" / "methods"
BACKBONE = ("--model.init_args.backbone", "test_batchnorm_backbone.BatchNormNet")


class BatchNormNet(nn.Module):
    """One convolution, BatchNorm, a linear head: the smallest backbone with running statistics."""

    def __init__(self, num_classes: int, in_channels: int, image_size: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, num_classes)
        self.feature_dims = [4]

    def forward(self, x: torch.Tensor) -> ModelOutput:
        h = self.bn(self.conv(x)).mean((2, 3))
        return ModelOutput(self.fc(torch.relu(h)), [h])


def fit(data_root, save_dir, method, *extra):
    cli = run_cli(data_root, save_dir, *extra, *BACKBONE, "--trainer.precision", "64-true",
                  model=f"fedrcl.algorithms.{method}")
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli


def test_scaffold_keeps_its_control_variate_beside_batchnorm_statistics(data_root, tmp_path):
    """The server's ``c`` is created over every floating-point entry; a client reads its parameters' share (this
    was a KeyError on the running statistics). ``c`` moved on the parameters; the statistics were averaged."""
    cli = fit(data_root, tmp_path, "SCAFFOLD", "--config", str(CONFIGS / "scaffold.yaml"))
    control = cli.trainer.federation.server.memory["control"]
    assert all(control[n].abs().sum() > 0 for n, _ in cli.model.backbone.named_parameters())
    assert not torch.equal(cli.model.backbone.bn.running_var, torch.ones(4, dtype=torch.float64))


def test_a_sam_step_with_rho_zero_is_fedavg_with_batchnorm(data_root, tmp_path):
    """``client_direction``'s gradient (``torch.func``) takes the buffers as inputs (a captured running statistic's
    update was refused): with ``rho = 0`` FedSAM's step is the plain gradient (BatchNorm normalises by the batch's
    statistics in training), so its weights equal FedAvg's. Its two passes per step update the running statistics
    twice, so those are not compared; they moved."""
    sam = fit(data_root, tmp_path / "sam", "FedSAM", "--config", str(CONFIGS / "fedsam.yaml"),
              "--model.init_args.rho", "0.0")
    avg = fit(data_root, tmp_path / "avg", "FedAvg")
    got, want = sam.model.backbone.state_dict(), avg.model.backbone.state_dict()
    for name, _ in sam.model.backbone.named_parameters():
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12)
    assert not torch.equal(got["bn.running_mean"], torch.zeros(4, dtype=torch.float64))
