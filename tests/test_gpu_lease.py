"""The GPU lease (``bench/gpu_lease.sh``) rehearsed on the CPU, and the round-boundary deadline it relies on."""
from __future__ import annotations

from pathlib import Path

import torch

from conftest import assert_same_state, run_cli
from fedrcl.federated.deadline import training_seconds

FEDAVG = "fedrcl.algorithms.FedAvg"


def test_max_time_stops_on_a_whole_round_that_resumes_exactly(data_root, tmp_path):
    """``--trainer.max_time`` is checked after each round: a budget of 1 microsecond stops after round 1 with a checkpoint
    of that round (not every ``checkpoint_every``), which resumes to a run that never stopped, bitwise."""
    stopped = run_cli(data_root, tmp_path / "a", "--trainer.max_time", "{\"microseconds\": 1}", rounds=3, model=FEDAVG)
    assert stopped.trainer.current_epoch == 1  # one round run, then stopped
    folder = tmp_path / "a" / "quickstart" / "version_0" / "checkpoints"
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["last.ckpt", "round0000.ckpt"]
    checkpoint = torch.load(folder / "last.ckpt", weights_only=True)
    assert checkpoint["epoch"] == 0 and training_seconds(checkpoint) > 0
    resumed = run_cli(data_root, tmp_path / "a", "--ckpt_path", str(folder / "last.ckpt"), rounds=3, model=FEDAVG)
    full = run_cli(data_root, tmp_path / "full", rounds=3, model=FEDAVG)
    assert resumed.trainer.current_epoch == full.trainer.current_epoch == 3
    assert_same_state(full.model.state_dict(), resumed.model.state_dict())
