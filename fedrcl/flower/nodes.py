"""The nodes of a Flower deployment, by partition: who serves which clients, and a restarted node's work sent again.

A node serves one partition of the clients (``partition-id`` of ``num-partitions``: clients ``i, i + N, ...``).
The server knows nodes by *incarnation*: Flower's node id and the time it was last activated, so a SuperNode
restarted by a supervisor is a new incarnation whether it comes back with a new id (no authentication) or
with its old one (an authenticated node's key). ``Fleet`` asks each new incarnation which partition it
serves (a ``query`` message; the node checks its configuration there and refuses a bad one, named; one
error names every node that refused) and
sends a partition's messages to its newest incarnation.

``Fleet.exchange`` is the round's send-and-receive: it pushes one message per partition and polls for the
replies. A partition whose node is lost (Flower reports it unavailable, or it leaves the online nodes) or
replaced by a newer incarnation gets its message again, unchanged, at that newer incarnation, as soon as one
answers its query: so a node killed mid-round and restarted costs the round that node's work again, and the
run goes on with the weights of one that never stopped (clients are seeded by (seed, round, client), their
state files versioned by round). A partition still without a node ``restart_wait`` seconds after it was lost
stops the round with ``NodeLost``, naming the partition, its last node and the clients it owed, unless a node
that came since has not yet said which partition it serves: that node has ``node_wait`` seconds to answer
(as at the start), for its start may take longer than ``restart_wait`` (a ClientApp process, a worker that
imports torch), and Flower may learn of a killed node's loss only when that start is well under way (its
heartbeat, 60-90 s after a ``kill -9``). An error the ClientApp raised stops the round at once
(``ClientFailure``), as does the round's ``timeout``.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from flwr.app import Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=no-name-in-module
from flwr.serverapp import Grid
from flwr.supercore.run import Run

LOST = {ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
        ErrorCode.CLIENT_APP_CRASHED}  # the node (or its process) went away: the work is sent again
Incarnation = tuple[int, str]  # (Flower node id, when it was last activated)


class ClientFailure(RuntimeError):
    """A client of the round sent an error or no reply: the round stops, naming it."""


class NodeLost(ClientFailure):
    """A partition's node went away and no node came back for it in time: the run stops, naming it."""


@dataclass
class Partition:
    """One partition of the clients and the node that serves it now."""

    index: int
    clients: list[int]
    node: Incarnation


@dataclass
class _Pending:
    """A partition's message of the round: its content, where it went, since when its node is lost."""

    message: Message
    partition: int
    clients: list[int]
    sent_to: Incarnation
    message_id: str = ""
    lost_since: Optional[float] = None
    reply: Optional[Message] = field(default=None, repr=False)


class Fleet:
    """The deployment's nodes by partition (see the module docstring).

    Args:
        num_clients: clients of the federation; every one must be served before the first round.
        query: the content of a ``query`` message (fedrcl's arguments for the node to check itself against).
        restart_wait: seconds a round waits for a lost partition's node to come back.
        node_wait: seconds a node that came back mid-run has to say which partition it serves (a lost
            partition waits for its answer meanwhile), as ``discover``'s ``wait`` at the start.
        poll: seconds between two polls of the SuperLink.
        refusal_grace: seconds the start waits, after a node refused its configuration, for the other nodes
            asked to answer, so that one error names every node that refused (an operator fixes them at once).
    """

    def __init__(self, num_clients: int, query: Callable[[], RecordDict], restart_wait: float = 300.0,
                 poll: float = 0.25, refusal_grace: float = 10.0, node_wait: float = 600.0):
        self.num_clients, self.query, self.restart_wait, self.poll = num_clients, query, restart_wait, poll
        self.refusal_grace, self.node_wait = refusal_grace, node_wait
        self.partitions: dict[int, Partition] = {}
        self._refused: dict[int, str] = {}  # node id -> why it refused its configuration
        self._asked: dict[str, tuple[Incarnation, float]] = {}  # query message id -> the incarnation, when asked
        self._known: set[Incarnation] = set()  # incarnations asked already

    def node_of(self, client: int) -> int:
        """The Flower node id serving ``client`` now."""
        for partition in self.partitions.values():
            if client in partition.clients:
                return partition.node[0]
        raise KeyError(f"no node serves client {client}")

    def partition_of(self, node: int) -> int:
        return next(p.index for p in self.partitions.values() if p.node[0] == node)

    def missing(self) -> list[int]:
        served = {k for p in self.partitions.values() for k in p.clients}
        return [k for k in range(self.num_clients) if k not in served]

    # -- discovery ---------------------------------------------------------------------------------------
    def _online(self, grid: Grid) -> dict[int, Incarnation]:
        return {n.node_id: (n.node_id, n.last_activated_at) for n in grid.get_nodes()}

    def _ask_new(self, grid: Grid, online: dict[int, Incarnation]) -> None:
        """Send a ``query`` to every online incarnation not asked yet."""
        new = [inc for inc in online.values() if inc not in self._known]
        if not new:
            return
        queries = [Message(self.query(), dst_node_id=inc[0], message_type="query") for inc in new]
        for message_id, inc in zip(grid.push_messages(queries), new):
            self._asked[message_id] = (inc, time.monotonic())
            self._known.add(inc)

    def _coming(self, now: float) -> bool:
        """Whether a node asked its partition less than ``node_wait`` seconds ago has not answered yet."""
        return any(now - asked_at < self.node_wait for _, asked_at in self._asked.values())

    def _answers(self, grid: Grid) -> list[int]:
        """Take the query replies arrived: map each answering incarnation to its partition. Returns the
        partitions whose node changed. A node that refused its configuration is noted (``_refusal``)."""
        changed = []
        for reply in grid.pull_messages(list(self._asked)) if self._asked else []:
            asked = self._asked.pop(reply.metadata.reply_to_message_id, None)
            if asked is None:
                continue
            inc = asked[0]
            if reply.has_error():
                if reply.error.code in LOST:
                    continue  # asked a node that is gone
                self._refused[inc[0]] = str(reply.error.reason)
                continue
            answer = reply.content.config_records["fedrcl.clients"]
            clients = answer["clients"]
            assert isinstance(clients, list)  # the node's ConfigRecord({"clients": [...], ...})
            index = int(answer.get("partition", min(clients)))  # type: ignore[arg-type]  # partition i's first client is i
            current = self.partitions.get(index)
            if current is None or current.node != inc:
                self.partitions[index] = Partition(index, [int(k) for k in clients], inc)
                changed.append(index)
        return changed

    def _refusal(self) -> ClientFailure:
        """One error naming every node that refused its configuration, each with its reason."""
        return ClientFailure("; ".join(f"node {node} refused to serve: {why}"
                                       for node, why in sorted(self._refused.items())))

    def discover(self, grid: Grid, wait: float) -> None:
        """Query the online nodes until every client is served (or raise after ``wait`` seconds). Nodes that
        do not answer (a node that died recently and is still listed) do not hold the start. Refusals stop
        the start once every node asked has answered, or ``refusal_grace`` seconds after the first."""
        deadline, first_refusal = time.monotonic() + wait, None
        while True:
            self._ask_new(grid, self._online(grid))
            self._answers(grid)
            now = time.monotonic()
            if self._refused:
                first_refusal = first_refusal or now
                if not self._asked or now - first_refusal > self.refusal_grace or now > deadline:
                    raise self._refusal()
            elif not self.missing():
                return
            elif now > deadline:
                raise ClientFailure(f"no node serves clients {self.missing()} after {wait:.0f} s: start a SuperNode "
                                    "for each partition (--node-config 'partition-id=i num-partitions=N')")
            time.sleep(self.poll)

    # -- a round -----------------------------------------------------------------------------------------
    def exchange(self, grid: Grid, messages: Sequence[Message], clients: Sequence[Sequence[int]],
                 timeout: float, label: str = "the round") -> list[Message]:
        """Send each message (for the clients ``clients[i]``) to its partition's node and return the replies
        in the messages' order, sending a message again to its partition's new node when the old one is lost
        (module docstring); ``label`` names the round in errors."""
        pending = []
        for message, owed in zip(messages, clients):
            partition = self.partition_of(message.metadata.dst_node_id)
            pending.append(_Pending(message, partition, list(owed), self.partitions[partition].node))
        self._push(grid, pending)
        deadline = time.monotonic() + timeout
        while any(p.reply is None for p in pending):
            waiting = {p.message_id: p for p in pending if p.reply is None}
            for reply in grid.pull_messages(list(waiting)):
                job = waiting.get(reply.metadata.reply_to_message_id)
                if job is None:
                    continue
                if not reply.has_error():
                    job.reply = reply
                elif reply.error.code in LOST:
                    job.lost_since = job.lost_since or time.monotonic()
                else:
                    raise ClientFailure(f"{label}: node {job.sent_to[0]} (partition {job.partition}, clients {job.clients}) "
                                        f"failed: {reply.error.reason}. The round is not aggregated.")
            self._follow(grid, [p for p in pending if p.reply is None])
            now = time.monotonic()
            for job in pending:
                if job.reply is None and job.lost_since is not None and now - job.lost_since > self.restart_wait \
                        and not self._coming(now):
                    raise NodeLost(f"{label}: node {job.sent_to[0]} of partition {job.partition} went away and no node came "
                                   f"back for it within {self.restart_wait:.0f} s; it owed clients {job.clients}. "
                                   "The round is not aggregated.")
            if now > deadline:
                silent = [k for p in pending if p.reply is None for k in p.clients]
                raise ClientFailure(f"{label}: no reply from clients {silent} within the round's timeout ({timeout:.0f} s). "
                                    "The round is not aggregated.")
            if any(p.reply is None for p in pending):
                time.sleep(self.poll)
        return [p.reply for p in pending if p.reply is not None]

    def _push(self, grid: Grid, jobs: Iterable[_Pending]) -> None:
        jobs = list(jobs)
        for job in jobs:  # addressed to the partition's node now
            job.sent_to = self.partitions[job.partition].node
            job.message = Message(job.message.content, dst_node_id=job.sent_to[0],
                                  message_type=job.message.metadata.message_type,
                                  group_id=job.message.metadata.group_id)
        for job, message_id in zip(jobs, grid.push_messages([job.message for job in jobs])):
            job.message_id = message_id

    def _follow(self, grid: Grid, waiting: list[_Pending]) -> None:
        """Mark the partitions whose node left the online nodes as lost; ask new nodes their partition, and
        send a waiting partition's message again to its new node."""
        online = self._online(grid)
        for job in waiting:
            if job.sent_to[0] not in online or online[job.sent_to[0]] != job.sent_to:
                job.lost_since = job.lost_since or time.monotonic()
        self._ask_new(grid, online)
        changed = set(self._answers(grid))
        if self._refused:  # a node started mid-run with a configuration it cannot serve
            raise self._refusal()
        again = [job for job in waiting if job.partition in changed and self.partitions[job.partition].node != job.sent_to]
        for job in again:
            job.lost_since = None
        if again:
            self._push(grid, again)


class FleetGrid(Grid):
    """A ``Grid`` whose ``send_and_receive`` is ``Fleet.exchange``: what ``Strategy.start`` and
    ``fedrcl.flower.server.NodeRounds`` call each round.
    Everything else is the wrapped grid's."""

    def __init__(self, grid: Grid, fleet: Fleet):
        self.grid, self.fleet = grid, fleet

    def set_run(self, run: Run) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: Optional[float] = None) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def get_nodes(self) -> Iterable[NodeInfo]:
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: Optional[float] = None) -> Iterable[Message]:
        messages = list(messages)
        if not messages:
            return []
        tasks = [m.content.config_records["fedrcl.round"] for m in messages]
        owed = [[int(k) for k in task["clients"]] for task in tasks]  # type: ignore[union-attr]  # a list here
        label = f"round {int(tasks[0]['round_idx']) + 1}"  # type: ignore[arg-type]  # fedrcl's, 1-based
        return self.fleet.exchange(self.grid, messages, owed, float("inf") if timeout is None else timeout, label)
