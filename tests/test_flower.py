"""fedrcl on Flower gives fedrcl fit's numbers: the same final global weights (bitwise, CPU), curves and bytes.

The quickstart shrunk as ``conftest.run_cli`` does (10 clients, 3 per round, 1 local epoch), 3 rounds, for
FedAvg, FedRCL + FedAvgM, MOON (client 9 trains in rounds 1 and 2: its previous model is used),
FedRCL + FedACG (look-ahead and client term) and the methods that exchange more than weights: SCAFFOLD
(``c`` down, ``delta c_i`` up, ``c_i`` on the node), FedDyn (sample counts to the server half, the dual on
the node) and FedProc (prototypes down, class feature sums up): ``fedrcl fit`` in this process, and all the
runs through one Flower simulation (Ray) in a subprocess with a timeout, whose process group is ended
whatever happens; it starts with one busy process per core beside it (Ray's start once hung on a loaded
machine).
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is imported
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
pytest.importorskip("flwr", reason="Flower is an optional extra: pip install -e '.[flower]'")

from conftest import REPO, run_cli, run_in_process_group  # noqa: E402
from flower_fixtures import NotStarted, started  # noqa: E402
from fedrcl.analysis.runs import load_scalars  # noqa: E402
from fedrcl.federated.sampling import sample_clients  # noqa: E402
from test_baselines_2026_backends import METHODS as BASELINES_2026  # noqa: E402
from test_baselines_2026_backends import method_args as baseline_args  # noqa: E402

TUTORIAL = REPO / "docs" / "tutorial"  # the tutorial's methods, a file outside the package
FLOWER_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "OMP_NUM_THREADS": "1",
              "RAY_DEDUP_LOGS": "0",
              "PYTHONPATH": os.pathsep.join([str(TUTORIAL), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
ROUNDS = 3
RESUMED = ["scaffold", "moon"]  # resumed on Flower, reading the node files of their checkpoint's manifest
METHODS = {  # name: (client algorithm, overlays)
    "fedavg": ("fedrcl.algorithms.FedAvg", ["--trainer.callbacks.init_args.every_n_rounds", "1"]),  # repr/* each round
    "fedrcl_fedavgm": ("fedrcl.algorithms.FedRCL", ["--config", str(REPO / "configs/server/fedavgm.yaml")]),
    "moon": ("fedrcl.algorithms.MOON", ["--config", str(REPO / "configs/methods/moon.yaml")]),
    "fedrcl_fedacg": ("fedrcl.algorithms.FedRCL", ["--config", str(REPO / "configs/server/fedacg.yaml")]),
    "scaffold": ("fedrcl.algorithms.SCAFFOLD", ["--config", str(REPO / "configs/methods/scaffold.yaml")]),
    "feddyn": ("fedrcl.algorithms.FedDyn", ["--config", str(REPO / "configs/methods/feddyn.yaml")]),
    "fedproc": ("fedrcl.algorithms.FedProc",  # anneal_rounds 6: the prototypes still weigh in round 4
                ["--config", str(REPO / "configs/methods/fedproc.yaml"),
                 "--model.init_args.anneal_rounds", "6"]),
    # docs/tutorial.md's methods: per-client state, an upload with its server half, a server optimizer
    "tutorial_stateful": ("my_method.MyStatefulMethod", []),
    "tutorial_counts": ("my_method.MyMethodWithCounts", []),
    "tutorial_server_lr": ("my_method.MyMethod", ["--trainer.server", "my_method.ServerLR",
                                                  "--trainer.server.eta", "1.5"]),
    # methods unlike the shipped ones (tests/semantics_methods.py): a downlink changed in receive_upload, a
    # receive_upload that divides by the client's steps, a loss that reads its client's facts (in float64:
    # the run's precision reaches the nodes and the server's evaluation)
    "running_prior": ("semantics_methods.RunningPrior", []),
    "steps_prior": ("semantics_methods.StepsWeightedPrior", []),
    "client_facts": ("semantics_methods.ClientFactsLoss", ["--trainer.precision", "64-true"]),
    # the 2026 baselines (issue 52), in float64 with their configs: a step of their own (FedSAM, FedGAMMA, FedSpeed,
    # FedSMOO), a downlink that carries the last global update (FedCM, MoFedSAM), step-count normalisation (FedNova)
    **{method.lower(): (f"fedrcl.algorithms.{method}", list(baseline_args(method))) for method in BASELINES_2026},
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
    """Run ``command`` with Flower's telemetry off, in its own process group (``run_in_process_group``)."""
    out = run_in_process_group(command, timeout, cwd, {**os.environ, **FLOWER_ENV})
    return subprocess.CompletedProcess(command, 0, out)


STARTED = "answered in"  # the simulation's line once Ray and every node are up


def run_beside_busy_cores(command: list[str], cwd: Path, started: str, start_timeout: float = 240.0,
                          timeout: float = 600.0) -> str:
    """Run ``command`` (in a process group of its own) with one busy process per core beside it until its
    output shows ``started``: Ray's start on a loaded machine hung for minutes once. Fails if it has not
    started within ``start_timeout`` seconds or has not finished within ``timeout``; returns its output."""
    log = cwd / "simulation.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=cwd, env={**os.environ, **FLOWER_ENV}, stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    busy = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(os.cpu_count() or 2)]
    try:
        begun = time.monotonic()
        while started not in log.read_text() and proc.poll() is None:
            if time.monotonic() - begun > start_timeout:
                pytest.fail(f"the simulation did not start in {start_timeout} s with every core busy:\n"
                            f"{log.read_text()[-4000:]}")
            time.sleep(1)
        for process in busy:
            process.kill()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the simulation did not finish in {timeout} s:\n{log.read_text()[-4000:]}")
        text = log.read_text()
        assert proc.returncode == 0, text[-4000:]
        return text
    finally:
        for process in busy:
            process.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def runs(data_root, tmp_path_factory):
    """``{name: (fit version folder, flower version folder)}`` for every method of ``METHODS``; ``RESUMED``'s
    methods also run 3 rounds under ``flower_resumed`` then ``--ckpt_path last`` to round 4, all in one
    simulation (Ray starts once)."""
    tmp = tmp_path_factory.mktemp("flower")
    sys.path.insert(0, str(TUTORIAL))
    try:
        for name, (model, overlays) in METHODS.items():
            run_cli(data_root, tmp / "fit" / name, *overlays, rounds=ROUNDS, model=model)
    finally:
        sys.path.remove(str(TUTORIAL))
    every = [flower_args(data_root, tmp / "flower" / name, name) for name in METHODS]
    for name in RESUMED:  # again in a folder of their own, then resumed there to round 4 (same simulation)
        args = flower_args(data_root, tmp / "flower_resumed" / name, name)
        longer = [*args, "--ckpt_path", "last"]
        longer[longer.index("--trainer.rounds") + 1] = str(ROUNDS + 1)
        every += [args, longer]
    # a user's callback's round hooks, and trainer.max_time of one second: the run stops after its first round
    # (and ClientEvaluation, whose global-model columns the server logs: the local models stay on the nodes)
    every.append([*flower_args(data_root, tmp / "flower_hooks", "fedavg"), "--trainer.callbacks+=round_hooks.RoundHooks",
                  "--trainer.callbacks.path", str(tmp / "hooks.txt"),
                  "--trainer.callbacks+=fedrcl.analysis.ClientEvaluation", "--trainer.callbacks.every_n_rounds", "1",
                  "--trainer.max_time", "00:00:00:01", "--trainer.rounds", "20"])
    script = ("import json, sys; from fedrcl.flower.simulation import simulate; "
              "runs = json.loads(sys.argv[1]); simulate(runs[0], more=runs[1:])")

    def simulation(attempt: int) -> str:
        if attempt:  # a start Ray or Flower lost: again from empty run folders
            for folder in ("flower", "flower_resumed", "flower_hooks"):
                shutil.rmtree(tmp / folder, ignore_errors=True)
        return run_beside_busy_cores([sys.executable, "-c", script, json.dumps(every)], tmp, STARTED)

    out = started("the module's Flower simulation", simulation)
    if isinstance(out, NotStarted):
        return out
    (tmp / "simulation.log").write_text(out)
    return {name: (tmp / "fit" / name / "quickstart" / "version_0",
                   tmp / "flower" / name / "quickstart" / "version_0") for name in METHODS}


def test_the_simulation_log_is_one_line_per_round_without_noise(runs):
    """A redirected ``simulate`` log: fedrcl's line per round, no colour codes, no metric dumps, no notice that
    ``run_simulation`` is deprecated."""
    log = (runs["fedavg"][1].parents[3] / "simulation.log").read_text()
    assert "\x1b[" not in log
    assert "MetricRecord" not in log and "Final results" not in log and "deprecated" not in log
    for done in range(1, ROUNDS + 1):
        assert log.count(f"Round {done}/{ROUNDS}  val/acc") == len(METHODS) + len(RESUMED), log[-3000:]
    assert log.count(f"Round {ROUNDS + 1}/{ROUNDS + 1}  val/acc") == len(RESUMED), log[-3000:]
    # each run ends with its run folder and checkpoint, as fedrcl fit's does
    runs_logged = len(METHODS) + 2 * len(RESUMED) + 1  # and the run of a callback's hooks
    assert log.count("  run folder: ") == log.count("  checkpoint: ") == runs_logged
    assert f"  run folder: {runs['fedavg'][1]}" in log


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
    # RepresentationMonitor's global-model measures (its local-model ones need the nodes' models): the same numbers
    measured = [tag for tag in flower_scalars if tag.startswith("repr/")]
    assert not any(tag.startswith("repr/local/") for tag in measured)
    if name == "fedavg":
        assert "repr/deviation_below_1" in measured and "repr/level0/effective_rank" in measured
    for tag in measured:
        np.testing.assert_array_equal(fit_scalars[tag][1], flower_scalars[tag][1], err_msg=f"{name}: {tag}")
    rounds, loss = flower_scalars["train/loss"]
    np.testing.assert_array_equal(rounds, fit_scalars["train/loss"][0])
    np.testing.assert_allclose(loss, fit_scalars["train/loss"][1], rtol=1e-5)  # summed in another order
    assert (flower / "config.yaml").is_file()
    assert (flower / "split.json").read_text() == (fit / "split.json").read_text()


def test_moon_run_reuses_a_client():
    """The MOON case is meaningful: a client trains twice, so its stored previous model is read."""
    sampled = [set(sample_clients(10, 3, 0, r)) for r in range(ROUNDS)]
    assert any(sampled[i] & sampled[j] for i in range(ROUNDS) for j in range(i))


def npy_overhead(state: dict[str, torch.Tensor]) -> int:
    """Bytes Flower adds to a state dict's tensor bytes: per array, the ``.npy`` header and the key."""
    overhead = 0
    for key, tensor in state.items():
        buffer = io.BytesIO()
        np.save(buffer, tensor.numpy().copy())  # a writable, C-ordered array, as Flower serialises it
        overhead += len(buffer.getvalue()) - tensor.numel() * tensor.element_size() + len(key)
    return overhead


@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_flower_payload_is_fedrcl_ledger_plus_npy_headers(runs, data_root, tmp_path, name):
    """Flower carries each tensor as a ``.npy`` buffer under its name: fedrcl's ledger (tensor bytes) plus,
    per array, the ``.npy`` header and the key's length. SCAFFOLD also sends ``c`` (0 in round 1) and
    uploads ``delta c_i``, one tensor per parameter: twice FedAvg's traffic, in every round, with
    ``fedrcl fit`` and on Flower alike."""
    fit, flower = runs[name]
    scalars = load_scalars(flower)
    state = {k.removeprefix("backbone."): v for k, v in last_weights(fit).items()}
    weights = npy_overhead(state)
    params = 0
    if name == "scaffold":
        from fedrcl.flower.config import build

        backbone = build(flower_args(data_root, tmp_path, name)).model.backbone
        names = [n for n, _ in backbone.named_parameters()]
        params = npy_overhead({n: state[n] for n in names})
    extra = {"down": np.full(ROUNDS, params), "up": np.full(ROUNDS, params)}
    param_bytes = sum(state[n].numel() * state[n].element_size() for n in names) if params else 0
    fit_scalars, fedavg = load_scalars(fit), load_scalars(runs["fedavg"][1])
    for direction in ("down", "up"):
        ledger = np.array(scalars[f"comm/{direction}_bytes"][1])
        payload = np.array(scalars[f"flower/{direction}_bytes"][1])
        np.testing.assert_array_equal(payload - ledger, 3 * (weights + extra[direction]))  # 3 clients/round
        np.testing.assert_array_equal(np.array(fit_scalars[f"comm/{direction}_bytes"][1]), ledger)
        extra_bytes = np.array(fedavg[f"comm/{direction}_bytes"][1]) + 3 * param_bytes
        np.testing.assert_array_equal(ledger, extra_bytes)  # SCAFFOLD: c and delta c_i, the parameters' bytes


@pytest.mark.parametrize("name", ["fedavg", "fedrcl_fedacg", "fedproc", "scaffold"])
def test_fit_resumes_a_flower_run(runs, data_root, tmp_path, name):
    """``fedrcl fit --ckpt_path last`` continues a Flower run (FedACG: with the momentum the strategy kept;
    FedProc: with the prototypes the server made from the clients' uploads; SCAFFOLD: with the c_i files of
    the simulation's nodes, on this machine, that the checkpoint's manifest names) to round 4 with the
    weights of a run that never stopped; ``fedrcl validate`` reads its checkpoint."""
    model, overlays = METHODS[name]
    flower_save = tmp_path / "flower"  # a copy: resuming writes a version_1 beside the run
    shutil.copytree(runs[name][1].parents[1], flower_save)
    evaluated = run_cli(data_root, flower_save, *overlays, "--ckpt_path", "last", subcommand="validate", model=model)
    assert evaluated.trainer.callback_metrics["val/acc"].item() == load_scalars(runs[name][1])["val/acc"][1][-1]
    resumed = run_cli(data_root, flower_save, *overlays, "--ckpt_path", "last", rounds=4, model=model)
    straight = run_cli(data_root, tmp_path / "straight", *overlays, rounds=4, model=model)
    a, b = resumed.model.backbone.state_dict(), straight.model.backbone.state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# -- the strategy alone: order, failures (no Flower runtime) ---------------------------------------------------
@pytest.fixture
def server_task(monkeypatch):
    """The identity a ServerApp process has (Flower's runtime sets it; messages are stamped with it)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def _round(num_clients: int = 6, nodes: Optional[dict[int, int]] = None):
    from flwr.app import ArrayRecord, ConfigRecord

    from fedrcl.flower.nodes import Partition
    from fedrcl.flower.strategy import FedrclStrategy
    from fedrcl.server import FedAvg

    strategy = FedrclStrategy(FedAvg(), [10 + k for k in range(num_clients)], 3, seed=0,
                              steps_per_epoch=[2] * num_clients, local_epochs=1)
    nodes = nodes or {k: 100 + k for k in range(num_clients)}
    for node in set(nodes.values()):  # one partition per node
        strategy.fleet.partitions[node] = Partition(node, [k for k, n in nodes.items() if n == node], (node, ""))
    start = {"w": torch.zeros(5)}
    messages = list(strategy.configure_train(1, ArrayRecord.from_torch_state_dict(start), ConfigRecord(), None))
    for i, message in enumerate(messages):
        message.metadata.__dict__["_message_id"] = f"m{i}"  # what a Grid sets when it pushes a message
    return strategy, messages


def _reply(message, weights: dict[int, torch.Tensor], failure: dict[int, str] = {}, steps: int = 2):
    """A node's reply: per client of the message, its weights, summed losses, steps and status."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    records = {}
    for k in message.content["fedrcl.round"]["clients"]:
        records.update({f"fedrcl.{k}.weights": ArrayRecord.from_torch_state_dict({"w": weights[k]}),
                        f"fedrcl.{k}.upload": ArrayRecord(),
                        f"fedrcl.{k}.train": MetricRecord({"steps": steps, "loss": 1.5}),
                        f"fedrcl.{k}.status": ConfigRecord({"failure": failure.get(k, ""), "state_file": ""})})
    return Message(RecordDict(records), reply_to=message)


def test_strategy_samples_with_fedrcl_and_ignores_arrival_order(server_task):
    strategy, messages = _round()
    clients = sample_clients(6, 3, 0, 0)
    assert [m.content["fedrcl.round"]["clients"] for m in messages] == [[k] for k in clients]
    assert [m.metadata.dst_node_id for m in messages] == [100 + k for k in clients]
    weights = {k: torch.randn(5, generator=torch.Generator().manual_seed(k)) for k in clients}
    replies = [_reply(m, weights) for m in messages]
    arrays, metrics = strategy.aggregate_train(1, list(reversed(replies)))
    n = {k: 10 + k for k in clients}
    expected = (sum(n[k] * weights[k].double() for k in clients) / sum(n.values())).float()
    assert torch.equal(arrays.to_torch_state_dict()["w"], expected)
    assert metrics["train/loss"] == 1.5 * 3 / 6  # summed step losses over all steps


def test_one_message_per_node_and_round_with_its_clients_in_sampled_order(server_task):
    """Two nodes serving 6 clients (even / odd): a round sends one message per node that has sampled
    clients, the broadcast weights once in it, its clients in the sampled order; the replies fold in the
    sampled order, so the mean is the one of a message per client."""
    clients = sample_clients(6, 3, 0, 0)
    strategy, messages = _round(nodes={k: 200 + k % 2 for k in range(6)})
    by_node = {node: [k for k in clients if 200 + k % 2 == node] for node in (200, 201)}
    assert len(messages) == len([c for c in by_node.values() if c])
    for message in messages:
        assert message.content["fedrcl.round"]["clients"] == by_node[message.metadata.dst_node_id]
        assert [name for name in message.content.array_records] == ["fedrcl.sent"]
    weights = {k: torch.randn(5, generator=torch.Generator().manual_seed(k)) for k in clients}
    arrays, _ = strategy.aggregate_train(1, [_reply(m, weights) for m in reversed(messages)])
    one_each, singles = _round()
    expected, _ = one_each.aggregate_train(1, [_reply(m, weights) for m in singles])
    assert torch.equal(arrays.to_torch_state_dict()["w"], expected.to_torch_state_dict()["w"])
    assert strategy.payload["down"] == sum(m.content["fedrcl.sent"].count_bytes() for m in messages)


def test_a_diverged_client_stops_the_round_naming_it(server_task):
    from fedrcl.federated.divergence import DivergenceError

    strategy, messages = _round()
    clients = sample_clients(6, 3, 0, 0)
    ones = {k: torch.ones(5) for k in clients}
    diverged = [_reply(m, ones, failure={clients[1]: "non-finite loss"}) for m in messages]
    with pytest.raises(DivergenceError, match=f"client {clients[1]} \\(non-finite loss\\)"):
        strategy.aggregate_train(1, diverged)


def test_the_servers_client_facts_are_the_planned_ones_and_a_node_that_trained_others_stops_the_round(
        server_task):
    """``receive_upload`` sees each client's planned steps (it saw 0 on Flower); a reply with other steps (a
    node with other data or settings) stops the round naming the client."""
    from fedrcl.flower.nodes import ClientFailure

    strategy, messages = _round()
    assert strategy.round is not None
    assert {context.num_steps for context, _ in strategy.round.clients.values()} == {2}
    assert all(context.data is None for context, _ in strategy.round.clients.values())  # no client data here
    clients = sample_clients(6, 3, 0, 0)
    ones = {k: torch.ones(5) for k in clients}
    with pytest.raises(ClientFailure, match=f"client {clients[0]} trained 3 steps, the server planned 2"):
        strategy.aggregate_train(1, [_reply(m, ones, steps=3) for m in messages])


@pytest.mark.parametrize("model, message", [
    ("exchange_methods.HalfPair", "HalfPair defines extra_upload but not receive_upload"),
    ("exchange_methods.MisspeltHook", "extra_uplaod, which is not an exchange hook: did you mean extra_upload"),
])
def test_a_broken_exchange_is_refused_before_anything_is_written(data_root, tmp_path, model, message):
    """A method that sends something with no hook to take it on the other machine, or a misspelt hook, stops
    the Flower run as it stops ``fedrcl fit`` (``fedrcl.contract.exchange``), before the run folder is
    written. Callbacks that see the clients' local models are named as not run."""
    from fedrcl.flower.config import build
    from fedrcl.flower.server import not_run, run_federation

    args = flower_args(data_root, tmp_path, "fedavg")
    with pytest.raises(ValueError, match=message):
        run_federation(None, [*args, "--model", model])
    assert not (tmp_path / "quickstart").exists()  # nothing written
    cli = build([*args, "--trainer.callbacks+=fedrcl.analysis.ClientEvaluation"])
    assert {"ClientEvaluation.on_client_end", "RepresentationMonitor.on_client_end"} <= set(not_run(cli.trainer))


def test_several_server_processes_are_refused_before_anything_is_written(data_root, tmp_path):
    """Flower's server runs ``fedrcl fit``'s loop in one process (its clients are on the nodes): two devices would
    start a second server process; refused in one line naming the key, before the run folder is written."""
    from fedrcl.flower.server import run_federation

    args = flower_args(data_root, tmp_path, "fedavg")
    with pytest.raises(ValueError, match="trainer.devices x trainer.num_nodes is 2 on Flower's server"):
        run_federation(None, [*args, "--trainer.devices", "2"])
    assert not (tmp_path / "quickstart").exists()


def test_a_flower_resume_from_a_bad_checkpoint_stops_before_anything_is_written(data_root, tmp_path):
    """``--ckpt_path`` on Flower is checked as ``fedrcl fit`` checks it: a missing file, or a checkpoint of
    another configuration (here FedAvg's for FedRCL), stops the run naming it, before the strategy starts
    and before the run folder is written."""
    from fedrcl.flower.server import run_federation

    args = flower_args(data_root, tmp_path / "run", "fedavg")
    with pytest.raises(FileNotFoundError, match="missing.ckpt: no such file"):
        run_federation(None, [*args, "--ckpt_path", str(tmp_path / "missing.ckpt")])
    other = run_cli(data_root, tmp_path / "other", rounds=1, model="fedrcl.algorithms.FedAvg")
    ckpt = Path(other.trainer.log_dir) / "checkpoints" / "last.ckpt"
    fedrcl_args = flower_args(data_root, tmp_path / "run", "fedavg")
    fedrcl_args[fedrcl_args.index("--model") + 1] = "fedrcl.algorithms.FedRCL"
    with pytest.raises(ValueError, match="model"):
        run_federation(None, [*fedrcl_args, "--ckpt_path", str(ckpt)])
    assert not (tmp_path / "run").exists()


class OneNode:
    """A node's ClientApp called in this process, as Flower calls it with each message: ``train(round, file)``
    sends client 9 (partition 9 of 10) round ``round`` and the state file the server names for it, and returns
    the reply's weights and the file it names. ``new_process()`` forgets the built run, as a new process."""

    def __init__(self, data_root: Path, tmp_path: Path, name: str, run: int = 0):
        from flwr.app import Context, RecordDict

        from fedrcl.flower import client as flower_client
        from fedrcl.flower.config import build

        self.args = flower_args(data_root, tmp_path, name)
        self.start = build(self.args).model.backbone.state_dict()
        self.app, self.client = flower_client.make_client_app(), flower_client
        self.state_dir = tmp_path / f"state{run}"
        config = {"partition-id": 9, "num-partitions": 10, "state-dir": str(self.state_dir)}
        self.context = Context(run_id=run, node_id=1, state=RecordDict(), run_config={}, node_config=config)

    def train(self, round_idx: int, state_file: str = "") -> tuple[dict, str]:
        from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

        task = {"round_idx": round_idx, "clients": [9], "state_files": [state_file], "kept": [""]}
        content = RecordDict({"fedrcl.run": ConfigRecord({"args": self.args}),
                              "fedrcl.round": ConfigRecord(task),
                              "fedrcl.sent": ArrayRecord.from_torch_state_dict(self.start)})
        message = Message(content, dst_node_id=1, message_type="train")
        message.metadata.__dict__["_message_id"] = f"m{round_idx}"
        reply = self.app(message, self.context)
        status = reply.content["fedrcl.9.status"]
        return reply.content["fedrcl.9.weights"].to_torch_state_dict(), status["state_file"]

    def new_process(self) -> None:
        self.client._PROCESS.clear()

    def module(self):
        return next(iter(self.client._PROCESS.values())).module


@pytest.mark.parametrize("name", ["moon", "scaffold", "feddyn"])
def test_a_new_clientapp_process_finds_client_state_through_the_servers_manifest(data_root, tmp_path,
                                                                                 server_task, name):
    """A SuperNode starts a new ClientApp process per message: client 9's state of round 1 (MOON's previous
    model, SCAFFOLD's c_i, FedDyn's dual) must be found in round 2 through the file its reply named and the
    server's next message names again, giving the same weights as one process, and other weights than a
    message that names none."""
    results = []
    for new_process in (False, True):
        node = OneNode(data_root, tmp_path, name, run=int(new_process))
        _, written = node.train(0)
        assert Path(written).is_file() and Path(written).is_relative_to(node.state_dir)
        if new_process:
            node.new_process()
        results.append(node.train(1, written)[0])
        if name == "moon":
            assert node.module().has_previous
    node.new_process()
    lost, _ = OneNode(data_root, tmp_path, name, run=2).train(1)  # round 2, told of no state for client 9
    node.new_process()
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key
    assert any(not torch.equal(results[0][k], lost[k]) for k in lost if lost[k].is_floating_point())


@pytest.mark.parametrize("new_process", [False, True], ids=["same process", "new process"])
def test_a_message_sent_again_after_its_reply_was_lost_finds_its_state_and_gives_the_same_reply(
        data_root, tmp_path, server_task, new_process):
    """A node lost after writing client 9's state of round 2 but before its reply arrived: the server sends
    round 2's message again, naming round 1's file (no checkpoint took it: checkpoint_every > 1). The file
    must still be there and the reply the same, bitwise; once round 3's message names round 2's file, round
    1's goes (no checkpoint kept it)."""
    node = OneNode(data_root, tmp_path, "scaffold")
    _, first = node.train(0)
    weights, second = node.train(1, first)
    assert Path(first).is_file()  # the server has not acknowledged round 2's file yet
    if new_process:
        node.new_process()
    again, second_again = node.train(1, first)  # the reply was lost: the same message, sent again
    assert second_again == second
    for key in weights:
        assert torch.equal(weights[key], again[key]), key
    node.train(2, second)
    assert not Path(first).exists() and Path(second).is_file()
    node.new_process()


@pytest.mark.parametrize("name", RESUMED)
def test_flower_resumes_a_flower_run_with_its_client_state(runs, data_root, tmp_path, name):
    """``python -m fedrcl.flower ... --ckpt_path last`` continues the 3-round Flower runs of SCAFFOLD and MOON
    to round 4 on Flower (in the ``runs`` simulation). Round 4's clients (4, 8, 9) all trained before, so
    their c_i / previous models are read from the node files the checkpoint's manifest names: the final
    weights are those of a ``fedrcl fit`` run that never stopped, and round 4's scalars go to a new version
    folder."""
    before = set().union(*(sample_clients(10, 3, 0, r) for r in range(ROUNDS)))
    assert set(sample_clients(10, 3, 0, ROUNDS)) <= before
    model, overlays = METHODS[name]
    run_cli(data_root, tmp_path / "straight", *overlays, rounds=ROUNDS + 1, model=model)
    resumed = runs[name][1].parents[3] / "flower_resumed" / name / "quickstart" / "version_1"
    a, b = last_weights(resumed), last_weights(tmp_path / "straight" / "quickstart" / "version_0")
    for key in b:
        assert torch.equal(a[key], b[key]), f"{name}: {key}"
    assert load_scalars(resumed)["val/acc"][0].tolist() == [ROUNDS + 1]


def test_fedrcl_report_reads_a_flower_run_as_the_fit_run(runs, tmp_path):
    """``fedrcl report`` puts a Flower run in the same cells with the same numbers as the fit run."""
    from fedrcl.report import main as report

    tables = []
    for run, name in zip(runs["fedrcl_fedacg"], ("fit", "flower")):
        report([str(run.parents[1]), "--out", str(tmp_path / f"{name}.md")])
        tables.append((tmp_path / f"{name}.md").read_text().replace(str(run.parents[1]), "RUNS"))
    assert tables[0] == tables[1]
    assert "FedACG" in tables[1]


def test_a_flower_run_opens_on_accuracy_in_tensorboard_as_a_fit_run(runs):
    """The ``accuracy/`` copies of ``val/acc`` and ``val/acc_ema`` (``fedrcl.analysis.layout``), every round."""
    fit, flower = runs["fedavg"]
    copies = [{tag: values[1].tolist() for tag, values in load_scalars(run).items() if tag.startswith("accuracy/")}
              for run in (fit, flower)]
    assert copies[0] == copies[1] and set(copies[0]) == {"accuracy/val/acc", "accuracy/val/acc_ema"}
    assert len(copies[1]["accuracy/val/acc"]) == ROUNDS


def test_flower_calls_a_callbacks_round_hooks_and_honours_max_time(runs):
    """On Flower's server a user's callback sees the run's start, each round's start and end and the run's end, and
    ``ClientEvaluation`` logs its global model's columns every round;
    ``trainer.max_time`` (one second) ends the run of 20 rounds after the round that passes it, checkpointed, and
    the summary says why: Flower's server runs ``fedrcl fit``'s loop."""
    tmp = runs["fedavg"][1].parents[3]
    log = (tmp / "simulation.log").read_text()
    done = int(re.findall(r"stopped early after round (\d+)/20: trainer.max_time reached", log)[-1])
    assert 1 <= done < 20
    rounds = [line for k in range(done) for line in (f"round_start {k}", f"round_end {k}")]
    assert (tmp / "hooks.txt").read_text().split("\n")[:-1] == ["start", *rounds, "end"]
    ckpt = torch.load(tmp / "flower_hooks" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt",
                      weights_only=True)
    assert ckpt["epoch"] == done - 1
    scalars = load_scalars(tmp / "flower_hooks" / "quickstart" / "version_0")
    assert scalars["clients/global_mix_acc_mean"][0].tolist() == list(range(1, done + 1))  # every round's
    assert "clients/local_test_acc_mean" not in scalars  # the local models are on the nodes
    assert "ClientEvaluation.on_client_end" in log  # named before the run


def test_sigterm_stops_a_simulation_after_the_round_checkpointed(data_root, tmp_path):
    """SIGTERM to ``python -m fedrcl.flower`` (Ray's driver would abort: exit 134, nothing checkpointed) ends the run
    after the round in progress, as ``fedrcl fit`` does: exit status 143, the line that says where it stopped and
    how to resume, and that round's checkpoint, with the weights of a ``fedrcl fit`` of as many rounds."""
    rounds = 30
    args = flower_args(data_root, tmp_path / "runs", "fedavg")
    args[args.index("--trainer.rounds") + 1] = str(rounds)
    args += ["--trainer.checkpoint_every", "100"]  # the stop's checkpoint is not a due one
    log = tmp_path / "simulation.out"

    def stopped_run(attempt: int) -> tuple[int, str]:
        shutil.rmtree(tmp_path / "runs", ignore_errors=True)
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "fedrcl.flower", *args], cwd=tmp_path, stdout=out,
                                    stderr=subprocess.STDOUT, env={**os.environ, **FLOWER_ENV}, start_new_session=True)
        try:
            begun = time.monotonic()
            while f"Round 2/{rounds}  val/acc" not in log.read_text():
                assert proc.poll() is None, log.read_text()[-4000:]
                if time.monotonic() - begun > 300:
                    pytest.fail(f"no second round in 300 s:\n{log.read_text()[-4000:]}")
                time.sleep(0.5)
            os.kill(proc.pid, signal.SIGTERM)  # this process only, as `kill PID` does
            return proc.wait(timeout=180), log.read_text()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    out = started("the simulation stopped by SIGTERM", stopped_run)
    if isinstance(out, NotStarted):
        out.fail()
    status, out = out
    assert status == 128 + signal.SIGTERM, out[-3000:]
    done = int(re.findall(r"SIGTERM: The run stopped after round (\d+), checkpoint (\S+);", out)[0][0])
    assert 2 <= done < rounds and "resume with --ckpt_path last" in out, out[-3000:]
    assert "SIGTERM received" not in out  # Ray's abort
    ckpt = torch.load(tmp_path / "runs" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["epoch"] == done - 1
    straight = run_cli(data_root, tmp_path / "fit", rounds=done, model="fedrcl.algorithms.FedAvg")
    for key, value in straight.model.state_dict().items():
        assert torch.equal(ckpt["state_dict"][key], value), key
