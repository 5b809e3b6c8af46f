"""Secure aggregation (Flower's SecAgg+) on fedrcl's Flower apps.

In this process: fedrcl's strategy drives the protocol's four stages against nodes that run Flower's own
``secaggplus_mod`` (each node with its own Context, as a SuperNode keeps it) and fedrcl's node half
(``fedrcl.flower.client.SecureUpdate``): the mean is the clients' weighted mean within ``error_bound`` (not
equal: the protocol quantised it), a node that drops out after sharing its keys is unmasked from its
neighbours' shares and the round completes with the others, a node's error stops the round named, DP-FedAvg's
noise is added by the clients (its spread measured), and what a secure sum cannot serve is refused in one line.
On a localhost deployment (real SuperLink, SuperNodes and ``flwr run``, bounded by timeouts): 2 rounds of digits
on 4 nodes give the plain deployment's weights within the quantisation error.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
pytest.importorskip("flwr", reason="Flower is an optional extra: pip install -e '.[flower]'")

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402
from flwr.common.secure_aggregation.quantization import dequantize, quantize  # noqa: E402
from flwr.proto.node_pb2 import NodeInfo  # noqa: E402  # pylint: disable=no-name-in-module

from fedrcl.federated.sampling import sample_clients  # noqa: E402
from fedrcl.flower.client import SecureUpdate  # noqa: E402
from fedrcl.flower.nodes import ClientFailure  # noqa: E402
from fedrcl.flower.secure_aggregation import (  # noqa: E402
    SecureAggregation, SecureAggregationError, error_bound, protocol_sizes, secure_aggregation_mod)
from fedrcl.flower.strategy import FedrclStrategy  # noqa: E402
from fedrcl.server import FedAvg  # noqa: E402

CLIENTS, NODES, PER_ROUND = 8, 4, 4
SIZE = 20000
WEIGHTS = {k: {"w": 0.1 * torch.randn(SIZE, generator=torch.Generator().manual_seed(k)), "step": torch.tensor(3)}
           for k in range(CLIENTS)}
SAMPLES = [10 + 7 * k for k in range(CLIENTS)]


@pytest.fixture(autouse=True)
def server_task(monkeypatch):
    """The identity a ServerApp process has (Flower's runtime sets it; messages are stamped with it)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def node_app() -> ClientApp:
    """A node as fedrcl's ClientApp is for a SecAgg+ round: Flower's mod around fedrcl's node half."""
    app = ClientApp(mods=[secure_aggregation_mod])

    @app.train()
    def train(message: Message, context: Context) -> Message:
        task = message.content.config_records["fedrcl.round"]
        update = SecureUpdate(message.content.array_records["fedrcl.sent"].to_torch_state_dict(), task)
        records: dict = {}
        for k in task["clients"]:
            update.add(WEIGHTS[k], SAMPLES[k])
            records[f"fedrcl.{k}.train"] = MetricRecord({"steps": 2, "loss": 1.0})
            records[f"fedrcl.{k}.status"] = ConfigRecord({"failure": "", "state_file": ""})
        content = RecordDict(records)
        update.reply(content)
        return Message(content, reply_to=message)

    @app.query()
    def query(message: Message, context: Context) -> Message:
        part = context.node_config["partition-id"]
        return Message(RecordDict({"fedrcl.clients": ConfigRecord({
            "clients": list(range(part, CLIENTS, NODES)), "partition": part, "partitions": NODES})}),
            reply_to=message)

    return app


class NodesGrid:
    """Nodes 101.. answering at once through ``node_app``, each with its own Context. ``silent_at``: node ->
    the protocol stage from which it no longer answers (it went away); ``fails_at``: node -> a stage where its
    ClientApp raises (its errors come back as a SuperNode sends them: an error reply)."""

    def __init__(self):
        self.app = node_app()
        self.contexts = {101 + p: Context(run_id=1, node_id=101 + p, node_config={"partition-id": p},
                                          state=RecordDict(), run_config={}) for p in range(NODES)}
        self.silent_at: dict[int, str] = {}
        self.fails_at: dict[int, str] = {}
        self.stages: list[str] = []
        self.count = 0
        self._replies: dict[str, Message] = {}

    def get_nodes(self):
        return [NodeInfo(node_id=n, last_activated_at="t0") for n in self.contexts]

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = f"m{self.count}"
            self.count += 1
            ids.append(message.metadata.message_id)
            node = message.metadata.dst_node_id
            configs = message.content.config_records.get("secaggplus_configs")
            stage = str(configs["stage"]) if configs is not None else message.metadata.message_type
            if stage not in self.stages:
                self.stages.append(stage)
            if self.silent_at.get(node) in self.stages:
                continue
            if self.fails_at.get(node) == stage:
                self._replies[message.metadata.message_id] = Message(
                    Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "ValueError: injected"), reply_to=message)
                continue
            try:
                reply = self.app(message, self.contexts[node])
            except Exception as error:  # as a SuperNode answers a ClientApp that raised
                reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(error).__name__}: {error}"),
                                reply_to=message)
            self._replies[message.metadata.message_id] = reply
        return ids

    def pull_messages(self, ids):
        return [self._replies.pop(i) for i in list(ids) if i in self._replies]


def one_round(grid: NodesGrid, secure: SecureAggregation, privacy=None):
    strategy = FedrclStrategy(FedAvg(), SAMPLES, PER_ROUND, seed=0, steps_per_epoch=[2] * CLIENTS, local_epochs=1,
                              node_wait=5.0, secure=secure, privacy=privacy)
    strategy.fleet.poll = 0.01
    strategy.fleet.discover(grid, strategy.node_wait)
    strategy.grid = grid
    zero = {"w": torch.zeros(SIZE), "step": torch.tensor(0)}
    messages = strategy.configure_train(1, ArrayRecord.from_torch_state_dict(zero), ConfigRecord(), grid)
    assert list(messages) == []  # the round's messages went out through the protocol's stages
    result = strategy.secure_sum
    arrays, _ = strategy.aggregate_train(1, [])
    return arrays.to_torch_state_dict(), result, strategy


def weighted_mean(clients) -> np.ndarray:
    n = {k: SAMPLES[k] for k in clients}
    return (sum(n[k] * WEIGHTS[k]["w"].double() for k in clients) / sum(n.values())).numpy()


def test_protocol_sizes_as_flowers_workflow_resolves_them():
    assert protocol_sizes(4, 1.0, 0.5) == (4, 2)
    assert protocol_sizes(10, 0.4, 0.5) == (5, 2)  # 4, made odd
    assert protocol_sizes(10, 0.25, 0.6) == (3, 2)  # 2.5 -> 2 -> odd 3; 1.8 -> 2
    assert protocol_sizes(3, 0.5, 1.0) == (3, 3)  # 2 shares or fewer: every node
    assert protocol_sizes(7, 5, 3) == (5, 3)


def test_error_bound_by_hand_and_holds_for_flowers_quantisation():
    assert error_bound(3, 0.5, 2**10, 2.0) == pytest.approx(3 * 3 * 0.5 / (2**10 * 2.0))
    rng = np.random.default_rng(0)
    c, q = 0.25, 2**8  # coarse: the bound is met by a visible margin, never by float rounding
    for _ in range(20):
        n = int(rng.integers(2, 6))
        weights = rng.integers(1, 500, n).astype(float)
        vectors = [rng.uniform(-c, c, 4000) for _ in range(n)]
        exact = sum(w * v for w, v in zip(weights, vectors)) / weights.sum()
        ratios = [round(w / weights.max() * q) / q for w in weights]  # the mod's dq_i
        summed = sum(quantize([r * v], c, q)[0].astype(np.int64) for r, v in zip(ratios, vectors))
        secure = (dequantize([summed], c, q)[0] - (n - 1) * c) / sum(ratios)
        error = np.abs(secure - exact).max()
        assert 0 < error <= error_bound(n, c, q, sum(ratios))


def test_a_secure_round_gives_the_weighted_mean_within_its_quantisation_error():
    secure = SecureAggregation(clipping_range=0.5, quantization_range=2**16)
    grid = NodesGrid()
    new, result, strategy = one_round(grid, secure)
    assert grid.stages == ["query", "setup", "share_keys", "collect_masked_vectors", "unmask"]
    clients = sample_clients(CLIENTS, PER_ROUND, 0, 0)
    exact = weighted_mean(clients)
    bound = error_bound(len(result.replies), 0.5, 2**16, result.weight_sum)
    error = np.abs(new["w"].double().numpy() - exact).max()
    assert 0 < error <= bound + 1e-7  # + float32's rounding of the new weights (|w| < 1)
    assert torch.equal(new["step"], torch.tensor(0))  # integer entries are not averaged
    assert result.dropped == {} and strategy.steps == 2 * PER_ROUND
    # the server got masked vectors: no node's reply holds its update
    for reply in result.replies.values():
        assert all(len(record) == 0 for record in reply.array_records.values())


def test_a_node_dropped_after_sharing_its_keys_is_unmasked_and_the_round_completes():
    clients = sample_clients(CLIENTS, PER_ROUND, 0, 0)
    grid = NodesGrid()
    gone = 101 + clients[0] % NODES
    grid.silent_at[gone] = "collect_masked_vectors"
    secure = SecureAggregation(clipping_range=0.5, quantization_range=2**16, timeout=0.5)
    new, result, _ = one_round(grid, secure)
    assert gone in result.dropped and "no reply" in result.dropped[gone]
    survivors = [k for k in clients if 101 + k % NODES != gone]
    exact = weighted_mean(survivors)
    error = np.abs(new["w"].double().numpy() - exact).max()
    assert error <= error_bound(len(result.replies), 0.5, 2**16, result.weight_sum) + 1e-7
    # too many gone: the threshold (every node keeps 3 of its neighbours) cannot be met
    grid = NodesGrid()
    for node in (101, 102):
        grid.silent_at[node] = "collect_masked_vectors"
    with pytest.raises(ClientFailure, match="fewer than 3 neighbours"):
        one_round(grid, SecureAggregation(reconstruction_threshold=3, clipping_range=0.5, timeout=0.5))


def test_a_nodes_error_stops_the_round_named_and_an_update_outside_the_range_is_one():
    grid = NodesGrid()
    failing = 101 + sample_clients(CLIENTS, PER_ROUND, 0, 0)[0] % NODES
    grid.fails_at[failing] = "share_keys"
    with pytest.raises(ClientFailure, match=f"node {failing} failed: ValueError: injected"):
        one_round(grid, SecureAggregation(clipping_range=0.5))
    with pytest.raises(ClientFailure, match="outside secure-aggregation.clipping-range 0.01: raise it"):
        one_round(NodesGrid(), SecureAggregation(clipping_range=0.01))


def test_distributed_dp_clients_clip_and_noise_so_the_sum_carries_the_central_noise():
    from fedrcl.algorithms import FedAvg as FedAvgMethod
    from fedrcl.privacy import DPFedAvg

    privacy = DPFedAvg(noise_multiplier=2.0, clip_norm=1.0, delta=1e-3)
    privacy.bind(CLIENTS, PER_ROUND, FedAvgMethod.__new__(FedAvgMethod))
    new, result, _ = one_round(NodesGrid(), SecureAggregation(clipping_range=8.0), privacy=privacy)
    clients = sample_clients(CLIENTS, PER_ROUND, 0, 0)
    clipped = [WEIGHTS[k]["w"].double() * min(1.0, 1.0 / float(WEIGHTS[k]["w"].double().norm())) for k in clients]
    uniform = (sum(clipped) / PER_ROUND).numpy()  # DP-FedAvg's estimator: uniform weights, clipped updates
    noise = new["w"].double().numpy() - uniform
    expected = 2.0 * 1.0 / PER_ROUND  # z C / m, as DP-FedAvg's central noise
    assert abs(noise.std() / expected - 1) < 0.05  # 20000 coordinates: the std's own spread is ~0.5 %
    assert abs(noise.mean()) < 4 * expected / math.sqrt(SIZE)
    assert len(privacy.segments) == 1 and privacy.epsilon > 0  # the round is accounted


def test_what_a_secure_sum_cannot_serve_is_refused_in_one_line(data_root, tmp_path):
    from fedrcl.flower.config import build
    from fedrcl.privacy import DPFedAvg
    from test_flower import flower_args

    secure = SecureAggregation()
    for name in ("scaffold", "feddyn", "fedproc"):
        cli = build(flower_args(data_root, tmp_path / name, name))
        with pytest.raises(SecureAggregationError, match=f"model {type(cli.model).__name__} gives its server half"):
            secure.check_method(cli.model, None)
    for name in ("fedavg", "fedrcl_fedavgm", "moon", "fedrcl_fedacg"):
        secure.check_method(build(flower_args(data_root, tmp_path / name, name)).model, None)
    with pytest.raises(SecureAggregationError, match="adaptive true: adaptive clipping"):
        secure.check_method(object(), DPFedAvg(adaptive=True))
    with pytest.raises(SecureAggregationError, match="needs >= 2 clients per round"):
        secure.check_run(1)
    with pytest.raises(SecureAggregationError, match="3 shares needed, but a round has at most 2 nodes"):
        SecureAggregation(reconstruction_threshold=3).check_run(2)
    on = {"secure-aggregation.enabled": True}
    for config, message in (({"secure-aggregation.num-share": 3}, "num-share: not a secure aggregation setting"),
                            ({"secure-aggregation.num-shares": 2}, "num-shares=2: an integer >= 3"),
                            ({"secure-aggregation.clipping-range": -1.0}, "clipping-range=-1.0: a number > 0"),
                            ({"secure-aggregation.modulus-range": 3 * 2**22}, "modulus-range=12582912: a power of 2")):
        with pytest.raises(SecureAggregationError, match=message):
            SecureAggregation.from_run_config({**on, **config})
    assert SecureAggregation.from_run_config({"round-timeout": 60.0}) is None
    assert SecureAggregation.from_run_config({"secure-aggregation.enabled": False,
                                              "secure-aggregation.num-shares": 1.0}) is None
    settings = SecureAggregation.from_run_config({"secure-aggregation.enabled": True, "secure-aggregation.num-shares": 5,
                                                  "secure-aggregation.clipping-range": 0.25})
    assert settings is not None and settings.num_shares == 5 and settings.clipping_range == 0.25


# -- a localhost deployment ----------------------------------------------------------------------------------
import lightning as L  # noqa: E402


class RoundWeights(L.Callback):
    """Saves the global weights after each round (``round<N>.pt``, 1-based) in ``folder``: what the ServerApp's
    model holds at a round's end (``--trainer.callbacks+=test_secagg.RoundWeights``)."""

    def __init__(self, folder: str):
        self.folder = Path(folder)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save(dict(pl_module.backbone.state_dict()), self.folder / f"round{trainer.current_epoch + 1}.pt")


SECURE = {"secure-aggregation.enabled": True, "secure-aggregation.clipping-range": 1.0,
          "secure-aggregation.timeout": 120.0}
BOUND = re.compile(r"secure aggregation of round (\d+): (\d+) nodes summed.*error <= ([0-9.e+-]+) per coordinate")


def deployment_args(data_root: Path, save_dir: Path, weights: Path, rounds: int) -> list[str]:
    """digits on 4 clients (one a node), 3 a round, 1 local epoch, FedRCL; a checkpoint every round."""
    from conftest import REPO

    return ["--config", str(REPO / "configs" / "quickstart.yaml"), "--model", "fedrcl.algorithms.FedRCL",
            "--data.root", str(data_root), "--data.num_clients", "4", "--trainer.accelerator", "cpu",
            "--trainer.logger.init_args.save_dir", str(save_dir), "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.rounds", str(rounds),
            "--trainer.local_epochs", "1", "--trainer.clients_per_round", "3", "--trainer.checkpoint_every", "1",
            "--trainer.callbacks+=test_secagg.RoundWeights", "--trainer.callbacks.folder", str(weights)]


@pytest.fixture(scope="module")
def deployed(data_root, tmp_path_factory):
    """On one localhost deployment of 4 SuperNodes: the plain run's round 1; the secure run's rounds 1 and 2
    (its weights moved to ``secure_weights``); and round 2 plain from the secure run's round-1 checkpoint (a
    resume), so that each secure round is compared with the exact mean of the same clients from the same start."""
    from flower_fixtures import NotStarted, started
    from test_flower import FLOWER_ENV

    from fedrcl.flower.localhost import LocalDeployment

    def runs(attempt: int) -> dict:
        tmp = tmp_path_factory.mktemp(f"secagg{attempt}")
        with LocalDeployment(nodes=4, workdir=tmp / "deployment", env=FLOWER_ENV) as nodes:
            plain = nodes.run(deployment_args(data_root, tmp / "plain", tmp / "plain_weights", 1), timeout=600)
            nodes.run_config = dict(SECURE)
            secure_args = deployment_args(data_root, tmp / "secure", tmp / "weights", 2)
            secure = nodes.run(secure_args, timeout=600)
            (tmp / "weights").rename(tmp / "secure_weights")
            nodes.run_config = {}
            first = tmp / "secure" / "quickstart" / "version_0" / "checkpoints" / "round0000.ckpt"
            resumed = nodes.run([*secure_args, "--ckpt_path", str(first)], timeout=600)
        return {"tmp": tmp, "plain": plain, "secure": secure, "resumed": resumed}

    out = started("the SecAgg+ localhost deployment", runs)
    return out if isinstance(out, NotStarted) else out


@pytest.mark.slow
def test_secagg_on_a_localhost_deployment_gives_the_plain_weights_within_its_quantisation_error(deployed):
    tmp = deployed["tmp"]
    bounds = {int(r): (int(n), float(b)) for r, n, b in BOUND.findall(deployed["secure"])}
    assert sorted(bounds) == [1, 2] and all(n == 3 for n, _ in bounds.values()), deployed["secure"][-3000:]
    assert not BOUND.search(deployed["plain"]) and not BOUND.search(deployed["resumed"])
    for server_round, plain_folder in ((1, "plain_weights"), (2, "weights")):  # round 2: from the same start
        plain = torch.load(tmp / plain_folder / f"round{server_round}.pt", weights_only=True)
        secure = torch.load(tmp / "secure_weights" / f"round{server_round}.pt", weights_only=True)
        floating = [k for k in plain if plain[k].is_floating_point()]
        difference = max(float((plain[k].double() - secure[k].double()).abs().max()) for k in floating)
        largest = max(float(plain[k].abs().max()) for k in floating)
        # the quantisation's error, and float32's rounding of each side's float64 mean
        assert 0 < difference <= bounds[server_round][1] + 2.0**-23 * largest, (server_round, difference)
        for k in plain:
            if not plain[k].is_floating_point():
                assert torch.equal(plain[k], secure[k]), k
