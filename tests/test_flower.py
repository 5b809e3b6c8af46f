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
import socket
import subprocess
import sys
import time
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


def run_process(command: list[str], timeout: float, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` in its own process group; on timeout or error, end the whole group (Ray's too)."""
    env = {**os.environ, **FLOWER_ENV, **(env or {})}
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_localhost_deployment_gives_fit_weights(data_root, tmp_path):
    """A SuperLink and 2 SuperNodes as real processes over HTTP on localhost, each SuperNode serving half
    the clients, ``flwr run`` of ``examples/flower_app``: FedRCL's 2 rounds equal ``fedrcl fit``'s."""
    run_cli(data_root, tmp_path / "fit", rounds=2)  # FedRCL, the quickstart's method
    args = flower_args(data_root, tmp_path / "flower", "fedavg")
    args[args.index("--model") + 1] = "fedrcl.algorithms.FedRCL"
    args[args.index("--trainer.rounds") + 1] = "2"
    home, port = tmp_path / "flwr_home", free_port()
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "localhost"\n\n[superlink.localhost]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    env = {**os.environ, **FLOWER_ENV, "FLWR_HOME": str(home)}
    commands = [["flower-superlink", "--insecure", "--port", str(port), "--disable-runtime-dependency-installation"]]
    commands += [["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
                  "--node-config", f"partition-id={i} num-partitions=2"] for i in range(2)]
    started = []
    try:
        for i, command in enumerate(commands):
            log = open(tmp_path / f"process{i}.log", "w")
            started.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True))
            if i == 0:
                deadline = time.monotonic() + 60
                while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
                    assert time.monotonic() < deadline, "the SuperLink did not open its port in 60 s"
                    time.sleep(0.5)
        run_process(["flwr", "run", str(REPO / "examples" / "flower_app"), "localhost", "--stream",
                     "--run-config", f"fedrcl-args={json.dumps(' '.join(args))}"], timeout=420, cwd=tmp_path,
                    env={"FLWR_HOME": str(home)})
    finally:
        for proc in started:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("process*.log")))
    flower = tmp_path / "flower" / "quickstart" / "version_0"
    assert (flower / "checkpoints" / "last.ckpt").is_file(), logs
    a, b = last_weights(tmp_path / "fit" / "quickstart" / "version_0"), last_weights(flower)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert load_scalars(flower)["val/acc_ema"][1].tolist() == \
        load_scalars(tmp_path / "fit" / "quickstart" / "version_0")["val/acc_ema"][1].tolist()
