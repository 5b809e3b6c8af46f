"""A Flower ``Strategy`` around any fedrcl server optimizer, with fedrcl's sampling and aggregation.

Per round (``server_round`` 1-based, fedrcl's ``round_idx`` = ``server_round - 1``; ``fedrcl.flower.server`` runs
the rounds in ``fedrcl fit``'s loop, ``start`` in Flower's own):

- ``configure_train``: the clients of ``fedrcl.federated.sampling.sample_clients`` (seeded by (seed, round),
  never Python's global ``random``), the round's ``fedrcl.federated.round.ServerRound`` begun from the
  global weights and configured (every client's facts, its steps included, and its downlink, fixed before
  any upload is folded in, as in ``fedrcl fit``), and one ``train`` message per node with sampled clients (``fedrcl.flower.client``), to the
  node serving their partition now (``fedrcl.flower.nodes.Fleet``: nodes are asked with a ``query`` message
  which partition they serve), carrying the broadcast weights once and each client's extras;
- the messages go out and come back through ``Fleet.exchange`` (``start`` hands Flower's loop a
  ``FleetGrid``): a node lost mid-round and restarted gets its message again; an error, a silence past the
  round's timeout, or a node not back in time stops the round naming the clients (a round never averages
  fewer clients);
- ``aggregate_train``: the replies put back in the sampled order (never arrival order); each client's result
  (weights, ``fedrcl.<client>.upload``: its ``extra_upload``, a failure; a reply whose step count is not the
  planned one stops the round) is added to the server round, whose
  ``finish`` gives the new global weights exactly as in ``fedrcl fit`` (divergence check, ``receive_upload``
  in the sampled order, server step, ``end_server_round``).

With ``secure`` (``fedrcl.flower.secure_aggregation``), ``configure_train`` runs the round's SecAgg+ stages itself
over Flower's grid, the ``train`` messages going out in its masked-vector stage, and hands Flower's loop nothing
to send; ``aggregate_train`` folds in the surviving clients' facts (status, steps, losses) and the secure mean
(``SecureServerRound``).

The server optimizer's memory (momenta) lives in the strategy between rounds; ``ledger`` counts fedrcl's
bytes and seconds, and ``payload`` the bytes Flower carried (``ArrayRecord.count_bytes``). For methods with
per-client state, the algorithm's ``ClientStateStore`` on the server holds the manifest (client -> the file
on its node, from each reply's ``state_file``) that checkpoints keep; each ``train`` message names the
client's current file and the one the newest checkpoint refers to (``kept``), so that nodes never delete
what a resume needs (``fedrcl.flower.client``).
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from logging import INFO
from typing import Any, Optional

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
import torch
from torch import Tensor

from fedrcl.algorithms.client_state import ClientStateStore
from fedrcl.contract.exchange import ClientExchange
from fedrcl.contract.plan import RoundPlan
from fedrcl.federated.communication import RoundLedger
from fedrcl.federated.round import ClientResult, ServerRound
from fedrcl.federated.sampling import sample_clients
from fedrcl.flower.nodes import ClientFailure, Fleet, FleetGrid
from fedrcl.flower.secure_aggregation import SecAggPlusRound, SecureAggregation, SecureSum, error_bound
from fedrcl.server import ServerOptimizer

__all__ = ["ClientFailure", "FedrclStrategy"]


class SecureServerRound(ServerRound):
    """A ``ServerRound`` whose mean is given (``mean_update``: the SecAgg+ round's weighted mean update, float64, in
    the order of the broadcast's floating-point entries) instead of summed from each client's weights; its
    clients are still folded in one by one (their facts, failures, bytes, ``receive_upload`` with nothing)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.mean_update: Sequence = ()
        self._sum = self  # type: ignore[assignment]  # ``_step`` takes the round's mean from ``mean`` below

    def _fold(self, client: Any, result: ClientResult) -> None:
        self.algorithm.receive_upload(client, {})

    def mean(self, reduce: Any = None) -> dict[str, Tensor]:
        floating = [(k, v) for k, v in self.sent.items() if v.is_floating_point()]
        return {k: (v.double() + torch.from_numpy(u)).to(v.dtype) for (k, v), u in zip(floating, self.mean_update)}


class FedrclStrategy(Strategy):
    """fedrcl's round on Flower's Message API (see the module docstring).

    Args:
        server: the fedrcl server optimizer (``fedrcl.server``: FedAvg, FedAvgM, FedAdam, FedYogi,
            FedAdagrad, FedACG).
        num_samples: each client's training-set size (aggregation weights), in client order.
        steps_per_epoch: each client's local steps per local epoch, in client order.
        local_epochs: local epochs each client trains per round.
        clients_per_round: clients sampled per round.
        seed: the federation's seed (``trainer.seed``).
        node_wait: seconds to wait for nodes that serve every client before the first round; also what a node
            that comes back mid-run has to say which partition it serves (``Fleet``).
        restart_wait: seconds a round waits for a lost node's partition to be served again (``Fleet``).
        algorithm: the server's copy of the client algorithm (for methods that exchange more than weights:
            ``extra_download``, ``receive_upload``, ``end_server_round``; ``fedrcl.federated.communication``).
        run_args: fedrcl's arguments of the run, sent to the nodes with every message.
        ledger: where bytes and seconds are counted (default: a new ``RoundLedger``).
        privacy: ``trainer.privacy`` (``fedrcl.privacy.DPFedAvg``): the replies clipped and their mean noised in
            the server round, as in ``fedrcl fit``; ``None``: none.
        secure: Flower's SecAgg+ for each round's sum (``fedrcl.flower.secure_aggregation``): the server gets the
            round's mean update, never a client's; ``None``: the replies carry each client's weights.
    """

    def __init__(self, server: ServerOptimizer, num_samples: Sequence[int], clients_per_round: int, seed: int,
                 *, steps_per_epoch: Sequence[int], local_epochs: int,
                 node_wait: float = 600.0, algorithm: Any = None, run_args: Sequence[str] = (),
                 ledger: Optional[RoundLedger] = None, restart_wait: float = 300.0, privacy: Any = None,
                 secure: Optional[SecureAggregation] = None):
        self.server, self.num_samples = server, list(num_samples)
        self.secure = secure
        self.secure_sum: Optional[SecureSum] = None  # the round's SecAgg+ outcome, from configure to aggregate
        self.secure_nodes: dict[int, list[int]] = {}  # its nodes' clients
        self.grid: Optional[Grid] = None  # Flower's own grid, for the SecAgg+ stages (``start``)
        self.timeout = 3600.0
        self.steps_per_epoch, self.local_epochs = list(steps_per_epoch), local_epochs
        self.clients_per_round, self.seed = clients_per_round, seed
        self.node_wait, self.privacy = node_wait, privacy
        self.algorithm = algorithm if algorithm is not None else ClientExchange()  # FedAvg's: sends nothing more
        self.run_args = [str(a) for a in run_args]
        self.fleet = Fleet(len(self.num_samples), lambda: RecordDict({"fedrcl.run": self._run_record()}),
                           restart_wait, node_wait=node_wait)
        self.ledger = ledger if ledger is not None else RoundLedger()
        self.payload = {"down": 0, "up": 0}  # this round's bytes in Flower's ArrayRecords
        self.train_metrics: dict[str, float] = {}
        self.loss_sums: dict[str, float] = {}  # the last round's summed step losses, over its clients
        self.round_steps = 0  # the last round's client steps
        self.steps = 0  # local steps of every client so far (Lightning's global_step in fedrcl fit)
        self.round: Optional[ServerRound] = None  # the round in progress
        self.clients: list[int] = []  # its clients, in the sampled order
        store = getattr(algorithm, "store", None)
        self.store = store if isinstance(store, ClientStateStore) else None  # the client-state manifest
        self.kept: dict[int, str] = {}  # client -> its file in the newest checkpoint's manifest

    def manifest(self) -> dict[int, str]:
        """Client -> its current state file on its node (methods with per-client state; else empty)."""
        if self.store is None:
            return {}
        return {k: str(self.store.file(k)) for k in range(len(self.num_samples)) if self.store.file(k) is not None}

    def round_idx(self, server_round: int) -> int:
        return server_round - 1

    def _run_record(self) -> ConfigRecord:
        return ConfigRecord({"args": self.run_args})

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: Optional[ConfigRecord] = None, evaluate_config: Optional[ConfigRecord] = None,
              evaluate_fn: Any = None) -> Result:
        """Flower's own loop (for a ServerApp of your own: no checkpoints, no evaluation but ``evaluate_fn``), with the
        rounds' messages sent and received by the ``Fleet`` (``FleetGrid``); the nodes are mapped to their partitions
        first, waiting up to ``node_wait`` seconds. fedrcl's ServerApp runs ``fedrcl fit``'s loop instead."""
        return super().start(self.connect(grid, timeout), initial_arrays, num_rounds, timeout, train_config,
                             evaluate_config, evaluate_fn)

    def connect(self, grid: Grid, timeout: float) -> FleetGrid:
        """Map the nodes to their partitions, waiting up to ``node_wait`` seconds; the grid whose
        ``send_and_receive`` exchanges a round's messages through the ``Fleet`` (``timeout``: seconds a round waits)."""
        started = time.perf_counter()
        self.grid, self.timeout = grid, timeout
        self.fleet.discover(grid, self.node_wait)
        log(INFO, "fedrcl: the nodes of all %s clients answered in %.1f s (a simulation: Ray's start included)",
            len(self.num_samples), time.perf_counter() - started)
        return FleetGrid(grid, self.fleet)

    # -- training -----------------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        round_idx = self.round_idx(server_round)
        if self.secure is None:
            self.round = ServerRound(self.server, self.algorithm, round_idx, arrays.to_torch_state_dict(),
                                     self.ledger, privacy=self.privacy)
        else:  # the mean comes from the secure sum; DP's clipping and noise happen on the nodes
            self.round = SecureServerRound(self.server, self.algorithm, round_idx, arrays.to_torch_state_dict(),
                                           self.ledger)
        self.clients = sample_clients(len(self.num_samples), self.clients_per_round, self.seed, round_idx)
        plan = RoundPlan.of_clients(round_idx, self.clients, self.num_samples.__getitem__,
                                    self.steps_per_epoch.__getitem__, self.local_epochs, self.seed)
        self.round.configure(plan)
        self.payload = {"down": 0, "up": 0}
        by_node: dict[int, list[int]] = {}
        for client in self.clients:  # each node's clients, in the sampled order
            by_node.setdefault(self.fleet.node_of(client), []).append(client)
        messages = []

        for node, clients in by_node.items():
            records = {"fedrcl.sent": ArrayRecord.from_torch_state_dict(dict(self.round.sent))}  # once per node
            for client in clients:
                for name, tensors in self.round.clients[client][1].extras.items():
                    records[f"fedrcl.{client}.{name}"] = ArrayRecord.from_torch_state_dict(dict(tensors))
            self.payload["down"] += sum(record.count_bytes() for record in records.values())
            task: dict[str, Any] = {"round_idx": round_idx, "clients": clients}
            if self.store is not None:
                files = [self.store.file(client) for client in clients]
                task.update(state_files=["" if f is None else str(f) for f in files],
                            kept=[self.kept.get(client, "") for client in clients])
            if self.secure is not None:
                task.update(self._secure_task())
            content = RecordDict({**records, "fedrcl.run": self._run_record(), "fedrcl.round": ConfigRecord(task)})
            messages.append(Message(content, dst_node_id=node, message_type="train", group_id=str(server_round)))
        if self.secure is None:
            return messages
        # SecAgg+: the round's four stages here, over Flower's grid; Flower's loop gets no message to send
        assert self.grid is not None
        weights = {node: float(len(clients) if self.privacy is not None else
                               sum(self.num_samples[k] for k in clients)) for node, clients in by_node.items()}
        protocol = SecAggPlusRound(self.secure, self.grid, self.secure.timeout or self.timeout, str(server_round),
                                   [self.seed, round_idx])
        self.secure_sum = protocol.aggregate({m.metadata.dst_node_id: m.content for m in messages}, weights)
        self.secure_nodes = by_node
        self.payload = dict(self.secure_sum.bytes)
        return []

    def _secure_task(self) -> dict[str, Any]:
        """What a node needs for its half of a SecAgg+ round: the clipping range; with DP-FedAvg the clip norm
        and each client's noise, ``N(0, (z C)^2 / m)``, so that the sum of ``m`` carries the central noise."""
        assert self.secure is not None
        task: dict[str, Any] = {"secure_clipping_range": self.secure.clipping_range, "dp_clip_norm": 0.0,
                                "dp_noise_std": 0.0}
        if self.privacy is not None:
            task.update(dp_clip_norm=float(self.privacy.clip_norm),
                        dp_noise_std=float(self.privacy.noise_multiplier * self.privacy.clip_norm
                                           / math.sqrt(self.clients_per_round)))
        return task

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        round_idx = self.round_idx(server_round)
        received: dict[int, RecordDict] = {}  # client -> the reply holding its result
        if self.secure_sum is not None:  # SecAgg+: each surviving node's reply, without its weights
            received = {k: self.secure_sum.replies[node] for node, clients in self.secure_nodes.items()
                        for k in clients if node in self.secure_sum.replies}
            self._secure_round_line(round_idx, [k for k in self.clients if k not in received])
        for reply in replies:  # errors and silences stopped the round in ``Fleet.exchange``
            for name in reply.content.array_records:
                if name.endswith(".weights"):
                    received[int(name.split(".")[1])] = reply.content
        missing = [k for k in self.clients if k not in received]
        if missing and self.secure_sum is None:
            raise ClientFailure(f"round {round_idx + 1}: no result for clients {missing}. The round is not aggregated.")
        assert self.round is not None
        sums: dict[str, float] = {}
        steps = 0
        for client in [k for k in self.clients if k in received]:  # the sampled order
            content, prefix = received[client], f"fedrcl.{client}."
            arrays, configs = content.array_records, content.config_records
            status = configs[prefix + "status"]
            if self.store is not None and status["state_file"]:
                self.store.adopt({client: str(status["state_file"])})
            metrics = content.metric_records[prefix + "train"]
            client_steps = int(metrics["steps"])  # type: ignore[arg-type]  # a MetricRecord value: a number here
            planned = self.round.clients[client][0].num_steps
            if client_steps != planned:
                raise ClientFailure(f"round {round_idx + 1}: client {client} trained {client_steps} steps, the "
                                    f"server planned {planned}: the node runs other data or settings")
            if self.secure_sum is None:
                record, uploaded = arrays[prefix + "weights"], arrays[prefix + "upload"]
                self.payload["up"] += record.count_bytes() + uploaded.count_bytes()
                result = ClientResult(record.to_torch_state_dict(), uploaded.to_torch_state_dict(),
                                      str(status["failure"]) or None)
            else:  # its weights are in the sum only (counted in the ledger as the weights they stand for)
                result = ClientResult(self.round.sent, {}, str(status["failure"]) or None)
            self.round.add(client, result)
            steps += client_steps
            for key, value in metrics.items():
                if key != "steps":
                    sums[key] = sums.get(key, 0.0) + float(value)  # type: ignore[arg-type]
        if self.secure_sum is not None:
            assert isinstance(self.round, SecureServerRound)
            self.round.mean_update = self.secure_sum.mean
            if self.privacy is not None:  # the clients clipped and noised: the round is accounted here
                self.privacy.released_by_clients()
            self.secure_sum = None
        new_global = self.round.finish()
        self.round = None
        self.steps += steps
        self.loss_sums, self.round_steps = sums, steps
        self.train_metrics = {f"train/{k}": v / steps for k, v in sums.items()}
        return ArrayRecord.from_torch_state_dict(new_global), MetricRecord(dict(self.train_metrics))

    def _secure_round_line(self, round_idx: int, dropped: list[int]) -> None:
        """Log the SecAgg+ round: nodes summed, the clients of nodes dropped (DP-FedAvg refuses any: the noise
        would be below the accounted), and the mean's quantisation error bound (``error_bound``)."""
        result, secure = self.secure_sum, self.secure
        assert result is not None and secure is not None
        if dropped and self.privacy is not None:
            raise ClientFailure(f"round {round_idx + 1}: clients {dropped} dropped out of the secure sum; with "
                                "trainer.privacy their noise is missing from it, so the round is not aggregated")
        bound = error_bound(len(result.replies), secure.clipping_range, secure.quantization_range, result.weight_sum)
        log(INFO, "fedrcl: secure aggregation of round %s: %s nodes summed, dropped clients %s; the mean's "
            "quantisation error <= %.3g per coordinate", round_idx + 1, len(result.replies), dropped or "none", bound)

    # -- evaluation is central (``fedrcl.flower.server``): no client evaluation round -------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Optional[MetricRecord]:
        return None

    def summary(self) -> None:
        log(INFO, "\t├── fedrcl server optimizer: %s", type(self.server).__name__)
        log(INFO, "\t├── clients: %s, %s per round, seed %s", len(self.num_samples), self.clients_per_round,
            self.seed)
        log(INFO, "\t└── evaluation: central, on the server")
