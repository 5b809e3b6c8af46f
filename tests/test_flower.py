"""fedrcl on Flower gives fedrcl fit's numbers: the same final global weights (bitwise, CPU), curves and bytes.

The quickstart shrunk as ``conftest.run_cli`` does (10 clients, 3 per round, 1 local epoch), 3 rounds, for
FedAvg, FedRCL + FedAvgM, MOON (client 9 trains in rounds 1 and 2: its previous model is used) and
FedRCL + FedACG (look-ahead and client term): ``fedrcl fit`` in this process, and all four runs through one
Flower simulation (Ray) in a subprocess with a timeout, whose process group is ended whatever happens.
"""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is imported
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
pytest.importorskip("flwr", reason="Flower is an optional extra: pip install -e '.[flower]'")

from conftest import REPO, run_cli  # noqa: E402
from fedrcl.analysis.runs import load_scalars  # noqa: E402
from fedrcl.federated.sampling import sample_clients  # noqa: E402

FLOWER_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "OMP_NUM_THREADS": "1",
              "RAY_DEDUP_LOGS": "0"}
ROUNDS = 3
METHODS = {  # name: (client algorithm, overlays)
    "fedavg": ("fedrcl.algorithms.FedAvg", []),
    "fedrcl_fedavgm": ("fedrcl.algorithms.FedRCL", ["--config", str(REPO / "configs/server/fedavgm.yaml")]),
    "moon": ("fedrcl.algorithms.MOON", ["--config", str(REPO / "configs/methods/moon.yaml")]),
    "fedrcl_fedacg": ("fedrcl.algorithms.FedRCL", ["--config", str(REPO / "configs/server/fedacg.yaml")]),
}


def flower_args(data_root: Path, save_dir: Path, name: str) -> list[str]:
    """``conftest.run_cli``'s fit arguments for method ``name`` (without the subcommand)."""
    model, overlays = METHODS[name]
    return ["--config", str(REPO / "configs" / "quickstart.yaml"), "--model", model,
            "--data.root", str(data_root), "--data.num_clients", "10", "--trainer.accelerator", "cpu",
            "--trainer.logger.init_args.save_dir", str(save_dir), "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.rounds", str(ROUNDS),
            "--trainer.local_epochs", "1", "--trainer.clients_per_round", "3", *overlays]


def run_process(command: list[str], timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``command`` in its own process group; on timeout or error, end the whole group (Ray's too)."""
    proc = subprocess.Popen(command, cwd=cwd, env={**os.environ, **FLOWER_ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{command[:3]} did not finish in {timeout} s:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # Ray's workers and anything else left in the group
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-6000:]
    return subprocess.CompletedProcess(command, proc.returncode, out)


@pytest.fixture(scope="module")
def runs(data_root, tmp_path_factory):
    """``{name: (fit version folder, flower version folder)}`` for every method of ``METHODS``."""
    tmp = tmp_path_factory.mktemp("flower")
    for name, (model, overlays) in METHODS.items():
        run_cli(data_root, tmp / "fit" / name, *overlays, rounds=ROUNDS, model=model)
    script = ("import json, sys; from fedrcl.flower.simulation import simulate; "
              "runs = json.loads(sys.argv[1]); simulate(runs[0], more=runs[1:])")
    every = [flower_args(data_root, tmp / "flower" / name, name) for name in METHODS]
    run_process([sys.executable, "-c", script, json.dumps(every)], timeout=240, cwd=tmp)
    return {name: (tmp / "fit" / name / "quickstart" / "version_0",
                   tmp / "flower" / name / "quickstart" / "version_0") for name in METHODS}


def last_weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.parametrize("name", list(METHODS))
def test_flower_simulation_gives_fit_weights(runs, name):
    fit, flower = runs[name]
    a, b = last_weights(fit), last_weights(flower)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{name}: {key} differs by {(a[key] - b[key]).abs().max()}"
    fit_scalars, flower_scalars = load_scalars(fit), load_scalars(flower)
    for tag in ("val/acc", "val/acc_ema", "train/lr", "comm/down_bytes", "comm/up_bytes"):
        for fit_curve, flower_curve in zip(fit_scalars[tag], flower_scalars[tag]):
            np.testing.assert_array_equal(fit_curve, flower_curve, err_msg=f"{name}: {tag}")
    rounds, loss = flower_scalars["train/loss"]
    np.testing.assert_array_equal(rounds, fit_scalars["train/loss"][0])
    np.testing.assert_allclose(loss, fit_scalars["train/loss"][1], rtol=1e-5)  # summed in another order
    assert (flower / "config.yaml").is_file() and (flower / "split.json").read_text() == (fit / "split.json").read_text()


def test_moon_run_reuses_a_client():
    """The MOON case is meaningful: a client trains twice, so its stored previous model is read."""
    sampled = [set(sample_clients(10, 3, 0, r)) for r in range(ROUNDS)]
    assert any(sampled[i] & sampled[j] for i in range(ROUNDS) for j in range(i))


def test_flower_payload_is_fedrcl_ledger_plus_npy_headers(runs):
    """Flower carries each tensor as a ``.npy`` buffer under its name: fedrcl's ledger (tensor bytes) plus,
    per array, the ``.npy`` header and the key's length."""
    fit, flower = runs["fedavg"]
    scalars = load_scalars(flower)
    state = last_weights(fit)
    overhead = 0
    for key, tensor in state.items():
        buffer = io.BytesIO()
        np.save(buffer, tensor.numpy().copy())  # a writable, C-ordered array, as Flower serialises it
        overhead += len(buffer.getvalue()) - tensor.numel() * tensor.element_size() + len(key.removeprefix("backbone."))
    for direction in ("down", "up"):
        ledger = np.array(scalars[f"comm/{direction}_bytes"][1])
        payload = np.array(scalars[f"flower/{direction}_bytes"][1])
        np.testing.assert_array_equal(payload - ledger, 3 * overhead)  # 3 clients per round
