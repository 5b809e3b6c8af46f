"""The server's view of a deployment's nodes (``fedrcl.flower.nodes``), against a scripted Grid, no processes.

A node lost mid-round and restarted (a new node id, or the same id activated again) gets its partition's
message again and the round ends with the weights of one that never stopped; a node that does not come back,
a ClientApp error or a silence stop the round naming the clients; a node that died before the start and is
still listed does not hold the start; a node that refuses its configuration stops the run, named.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
pytest.importorskip("flwr", reason="Flower is an optional extra: pip install -e '.[flower]'")

from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402
from flwr.proto.node_pb2 import NodeInfo  # noqa: E402

from fedrcl.federated.sampling import sample_clients  # noqa: E402
from fedrcl.flower.nodes import ClientFailure, FleetGrid, NodeLost  # noqa: E402
from fedrcl.flower.strategy import FedrclStrategy  # noqa: E402
from fedrcl.server import FedAvg  # noqa: E402

CLIENTS, PARTS = 6, 2
WEIGHTS = {k: torch.randn(5, generator=torch.Generator().manual_seed(k)) for k in range(CLIENTS)}


@pytest.fixture(autouse=True)
def server_task(monkeypatch):
    """The identity a ServerApp process has (Flower's runtime sets it; messages are stamped with it)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


class ScriptedGrid:
    """Nodes that answer at once: ``query`` with their partition, ``train`` with each client's fixed weights.
    ``silent`` nodes take messages and never answer (killed); ``errors`` maps a node to the error it replies."""

    def __init__(self):
        self.online: dict[int, str] = {}  # node id -> last activated
        self.partition: dict[int, int] = {}
        self.silent: set[int] = set()
        self.errors: dict[int, Error] = {}
        self.sent: list[Message] = []
        self._replies: dict[str, Message] = {}

    def start(self, node: int, partition: int, activated: str = "t0") -> None:
        self.online[node], self.partition[node] = activated, partition
        self.silent.discard(node)

    def kill(self, node: int, listed: bool = True) -> None:
        """The node dies after taking its messages: no answer to them, nor to later ones."""
        self.silent.add(node)
        for message in self.sent:
            if message.metadata.dst_node_id == node:
                self._replies.pop(message.metadata.message_id, None)
        if not listed:
            del self.online[node]

    def get_nodes(self):
        return [NodeInfo(node_id=n, last_activated_at=t) for n, t in self.online.items()]

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = f"m{len(self.sent)}"
            self.sent.append(message)
            ids.append(message.metadata.message_id)
            node = message.metadata.dst_node_id
            if node in self.errors:
                self._replies[message.metadata.message_id] = Message(self.errors[node], reply_to=message)
            elif node in self.online and node not in self.silent:
                self._replies[message.metadata.message_id] = self._answer(node, message)
        return ids

    def pull_messages(self, ids):
        return [self._replies.pop(i) for i in list(ids) if i in self._replies]

    def _answer(self, node: int, message: Message) -> Message:
        part = self.partition[node]
        if message.metadata.message_type == "query":
            clients = list(range(part, CLIENTS, PARTS))
            return Message(RecordDict({"fedrcl.clients": ConfigRecord(
                {"clients": clients, "partition": part, "partitions": PARTS})}), reply_to=message)
        records = {}
        for k in message.content["fedrcl.round"]["clients"]:
            records.update({f"fedrcl.{k}.weights": ArrayRecord.from_torch_state_dict({"w": WEIGHTS[k]}),
                            f"fedrcl.{k}.upload": ArrayRecord(),
                            f"fedrcl.{k}.train": MetricRecord({"steps": 2, "loss": 1.0}),
                            f"fedrcl.{k}.status": ConfigRecord({"failure": "", "state_file": ""})})
        return Message(RecordDict(records), reply_to=message)


def strategy_on(grid: ScriptedGrid, restart_wait: float = 30.0, refusal_grace: float = 10.0) -> FedrclStrategy:
    strategy = FedrclStrategy(FedAvg(), [10 + k for k in range(CLIENTS)], 3, seed=0, steps_per_epoch=[2] * CLIENTS,
                              local_epochs=1, node_wait=5.0, restart_wait=restart_wait)
    strategy.fleet.poll, strategy.fleet.refusal_grace = 0.01, refusal_grace
    strategy.fleet.discover(grid, strategy.node_wait)
    return strategy


def one_round(strategy: FedrclStrategy, grid: ScriptedGrid, on_sent=None, timeout: float = 30.0):
    """Round 1: configure, send and receive through the ``FleetGrid`` (``on_sent(grid)`` runs after the first
    push: a node killed, a node restarted), aggregate; the new global ``w``."""
    messages = list(strategy.configure_train(1, ArrayRecord.from_torch_state_dict({"w": torch.zeros(5)}),
                                             ConfigRecord(), grid))
    if on_sent is not None:
        push = grid.push_messages

        def push_then_act(batch):
            ids = push(batch)
            if all(m.metadata.message_type == "train" for m in batch) and len(grid.sent) == len(messages) + PARTS:
                on_sent(grid)
            return ids
        grid.push_messages = push_then_act
    replies = FleetGrid(grid, strategy.fleet).send_and_receive(messages, timeout=timeout)
    arrays, _ = strategy.aggregate_train(1, replies)
    return arrays.to_torch_state_dict()["w"]


def expected_mean() -> torch.Tensor:
    clients = sample_clients(CLIENTS, 3, 0, 0)
    n = {k: 10 + k for k in clients}
    return (sum(n[k] * WEIGHTS[k].double() for k in clients) / sum(n.values())).float()


def two_nodes() -> ScriptedGrid:
    grid = ScriptedGrid()
    grid.start(101, 0)
    grid.start(102, 1)
    return grid


def owing_partition() -> int:
    """A partition that owes clients in round 1 (the kill must hit a node with work)."""
    return sample_clients(CLIENTS, 3, 0, 0)[0] % PARTS


def test_an_undisturbed_round_gives_the_weighted_mean():
    grid = two_nodes()
    assert torch.equal(one_round(strategy_on(grid), grid), expected_mean())


@pytest.mark.parametrize("restart", ["new id", "same id activated again"])
def test_a_node_killed_mid_round_and_restarted_gets_its_message_again(restart):
    grid = two_nodes()
    part = owing_partition()
    victim = 101 + part

    def kill_and_restart(grid):
        if restart == "new id":
            grid.kill(victim, listed=False)
            grid.start(201, part)
        else:
            grid.kill(victim)
            grid.start(victim, part, activated="t1")

    strategy = strategy_on(grid)
    assert torch.equal(one_round(strategy, grid, kill_and_restart), expected_mean())
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    first = next(m for m in trains if m.metadata.dst_node_id == victim)
    again = trains[-1]
    assert again.metadata.dst_node_id == (201 if restart == "new id" else victim)
    assert again.content["fedrcl.round"]["clients"] == first.content["fedrcl.round"]["clients"]
    assert len(trains) == 3  # the other node's message was not sent again


def test_a_node_reported_unavailable_and_restarted_gets_its_message_again():
    grid = two_nodes()
    part = owing_partition()

    def unavailable_then_back(grid):
        victim = 101 + part
        grid.kill(victim)
        train = next(m for m in grid.sent if m.metadata.dst_node_id == victim and m.metadata.message_type == "train")
        grid._replies[train.metadata.message_id] = Message(Error(ErrorCode.NODE_UNAVAILABLE, "no heartbeat"),
                                                           reply_to=train)
        del grid.online[victim]
        grid.start(301, part)

    assert torch.equal(one_round(strategy_on(grid), grid, unavailable_then_back), expected_mean())


def test_a_node_not_back_in_time_stops_the_round_naming_its_partition_and_clients():
    grid = two_nodes()
    part = owing_partition()
    owed = [k for k in sample_clients(CLIENTS, 3, 0, 0) if k % PARTS == part]

    def kill(grid):
        grid.kill(101 + part, listed=False)

    with pytest.raises(NodeLost, match=rf"round 1: node {101 + part} of partition {part} went away .* within 0 s; "
                                       rf"it owed clients \[{', '.join(map(str, owed))}\]"):
        one_round(strategy_on(grid, restart_wait=0.2), grid, kill)


def slow_to_answer(grid: ScriptedGrid, node: int, seconds: float) -> None:
    """Node ``node`` answers nothing for ``seconds`` (a SuperNode whose ClientApp and worker still start), then
    its query, and from then on every message at once."""
    since, pull = time.monotonic(), grid.pull_messages

    def pull_then_answer(ids):
        if node in grid.silent and time.monotonic() - since > seconds:
            grid.silent.discard(node)
            for message in grid.sent:
                if message.metadata.dst_node_id == node:
                    grid._replies[message.metadata.message_id] = grid._answer(node, message)
        return pull(ids)
    grid.silent.add(node)
    grid.pull_messages = pull_then_answer


def test_a_node_back_but_slow_to_answer_holds_the_lost_partition_up_to_node_wait():
    """Flower learns of a killed node's loss from its heartbeat, often after its replacement came: the restart
    wait (0.2 s) runs out while the new node starts (1 s); the round waits for its answer, within node_wait."""
    part = owing_partition()

    def kill_and_start_slowly(grid):
        grid.kill(101 + part, listed=False)
        grid.start(201, part)
        slow_to_answer(grid, 201, 1.0)

    grid = two_nodes()
    started = time.monotonic()
    assert torch.equal(one_round(strategy_on(grid, restart_wait=0.2), grid, kill_and_start_slowly), expected_mean())
    assert time.monotonic() - started >= 1.0
    assert [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "train"][-1] == 201
    grid = two_nodes()
    strategy = strategy_on(grid, restart_wait=0.2)
    strategy.fleet.node_wait = 0.4  # the new node's answer comes too late: the partition is lost, named
    with pytest.raises(NodeLost, match=rf"node {101 + part} of partition {part} went away"):
        one_round(strategy, grid, kill_and_start_slowly)


def test_a_clientapp_error_or_a_silence_stops_the_round_naming_the_clients():
    grid = two_nodes()
    part = owing_partition()
    owed = [k for k in sample_clients(CLIENTS, 3, 0, 0) if k % PARTS == part]
    strategy = strategy_on(grid)
    grid.errors[101 + part] = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "out of memory")
    with pytest.raises(ClientFailure, match=rf"round 1: node {101 + part} \(partition {part}, clients "
                                            rf"\[{', '.join(map(str, owed))}\]\) failed: out of memory"):
        one_round(strategy, grid)
    grid = two_nodes()
    strategy = strategy_on(grid)
    grid.kill(101 + part)
    with pytest.raises(ClientFailure, match=rf"no reply from clients \[{', '.join(map(str, owed))}\] within"):
        one_round(strategy, grid, timeout=0.2)


def test_a_dead_node_still_listed_does_not_hold_the_start_and_a_bad_one_is_named():
    grid = two_nodes()
    grid.start(103, 1)
    grid.kill(103)  # died a moment ago: listed online, never answers
    strategy = strategy_on(grid)
    assert {p.index: p.node[0] for p in strategy.fleet.partitions.values()} == {0: 101, 1: 102}
    grid = two_nodes()
    grid.start(104, 0)
    grid.errors[104] = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "partition-id=7 must be in [0, 2)")
    with pytest.raises(ClientFailure, match=r"node 104 refused to serve: partition-id=7 must be in \[0, 2\)"):
        strategy_on(grid)


def test_every_node_that_refused_is_named_in_one_error():
    """Two bad nodes: one error names both (an operator fixes them in one restart); a node still listed but
    silent holds that error only ``refusal_grace`` seconds."""
    grid = two_nodes()
    for node, why in ((104, "partition-id=7 must be in [0, 2)"), (105, "data-root '/missing' does not exist")):
        grid.start(node, 0)
        grid.errors[node] = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, why)
    with pytest.raises(ClientFailure) as refused:
        strategy_on(grid)
    assert str(refused.value) == ("node 104 refused to serve: partition-id=7 must be in [0, 2); "
                                  "node 105 refused to serve: data-root '/missing' does not exist")
    grid.start(106, 1)
    grid.kill(106)  # listed, never answers its query
    started = time.monotonic()
    with pytest.raises(ClientFailure, match=r"^node 104 refused .*; node 105 refused [^;]*$"):
        strategy_on(grid, refusal_grace=0.3)
    assert 0.3 <= time.monotonic() - started < 4.0


def test_flowers_own_loop_runs_the_strategy_as_fedrcls_server_does():
    """A ServerApp of the user's own may run the strategy with Flower's ``Strategy.start`` (fedrcl's ServerApp runs
    ``fedrcl fit``'s loop instead, its rounds through the same ``configure_train`` / ``aggregate_train``): the nodes
    are mapped and the round's messages go through the ``Fleet``, giving the round's weighted mean."""
    grid = two_nodes()
    strategy = FedrclStrategy(FedAvg(), [10 + k for k in range(CLIENTS)], 3, seed=0, steps_per_epoch=[2] * CLIENTS,
                              local_epochs=1, node_wait=5.0)
    strategy.fleet.poll = 0.01
    result = strategy.start(grid, ArrayRecord.from_torch_state_dict({"w": torch.zeros(5)}), num_rounds=1, timeout=30)
    assert torch.equal(result.arrays.to_torch_state_dict()["w"], expected_mean())
