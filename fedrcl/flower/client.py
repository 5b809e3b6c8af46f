"""The fedrcl ClientApp: a Flower node that trains the fedrcl clients of its partition on request.

A node serves the clients ``partition-id, partition-id + num-partitions, ...`` of the split (its
``node_config``; in Flower's simulation every node has them, on a SuperNode pass ``--node-config
"partition-id=0 num-partitions=2"``). Every message carries ``fedrcl.run``, the server's fedrcl
arguments, so a node needs no config of its own (``data-root`` in its ``node_config`` points it at its local
data). Messages:

- ``query``: the node's configuration checked (``fedrcl.flower.node.check``: a bad one is refused, named, before
  anything is built), then the run built; reply ``fedrcl.clients``: the node's ``clients``, its ``partition``
  and ``partitions`` (so the server can map a restarted node, a new node id, to its partition).
- ``train``: one message per node and round, for all of the node's sampled clients: content
  ``fedrcl.round`` (``round_idx``; ``clients``, in the sampled order; per client its ``state_files`` and
  ``kept`` files, below), ``fedrcl.sent`` (the broadcast weights, once) and, for methods that send more,
  ``fedrcl.<client>.broadcast`` / ``fedrcl.<client>.download`` (the server's ``extra_broadcast``, the
  algorithm's ``extra_download``: SCAFFOLD's ``c``, FedProc's prototypes). The node runs each client in
  turn (``fedrcl.federated.round.ClientRun``, driven by ``fedrcl.federated.local_update.LocalUpdate`` with
  the engine's (seed, round, client) streams) and replies with, per client, ``fedrcl.<client>.weights``,
  ``fedrcl.<client>.upload`` (its ``extra_upload``, e.g. SCAFFOLD's ``delta c_i``; empty for most methods),
  the summed step losses ``fedrcl.<client>.train`` and ``fedrcl.<client>.status`` (a non-finite loss or
  weights, for the server to stop the round with).

The module, data and optimizer are built once per process and run (``_local_update``), never per client: in
the simulation's Ray actors, and on a deployed node in its worker process (``fedrcl.flower.worker``), which
outlives the ClientApp processes Flower starts per message (``fedrcl.flower.clientapp``).
Per-client state (MOON's previous model, SCAFFOLD's ``c_i``, FedDyn's dual) stays on the node: the
algorithm's ``ClientStateStore`` writes its files under the node's ``state-dir`` (default: a folder of the
Flower run and the fedrcl arguments under the system's temp folder; set it to a lasting folder for runs
resumed after a restart). The server is told which file is each client's current one (``state_file`` in
the reply's ``fedrcl.<client>.status``) and keeps that manifest in its checkpoints, as ``fedrcl fit`` does;
each ``train`` message names its clients' current files (``fedrcl.round``'s ``state_files``, empty: none)
and the ones the server's newest checkpoint refers to (``kept``, never deleted by the node). A node keeps the
file a message names until a later message names another (``ClientStateStore.follow``), for the message may
come again: its node lost after writing a client's new state, before its reply arrived. So a new node process
(a restarted worker or SuperNode) reads the right file, and a run resumed from a checkpoint, on Flower or with
``fedrcl fit`` on the same machine, reads the files as of that checkpoint.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.logger import update_console_handler
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common.recorddict_compat import fitres_to_recorddict

from fedrcl.algorithms.client_state import ClientStateStore
from fedrcl.federated.local_update import LocalUpdate
from fedrcl.federated.round import Downlink
from fedrcl.flower import node
from fedrcl.flower.config import build, client_args
from fedrcl.flower.secure_aggregation import check_range
from fedrcl.privacy.clipping import clip_update

_PROCESS: dict[tuple, LocalUpdate] = {}  # this process's client machinery, per (run, args, state dir)
log = logging.getLogger(__name__)
# Flower's log in this process (a Ray actor, a node's worker): colour codes on a terminal only
update_console_handler(colored=sys.stderr.isatty())


class ClientError(RuntimeError):
    """A client's local update raised: the node's error reply names the client and the round."""


def _as_list(value: object) -> list:
    """A list value of a ``ConfigRecord`` (typed there as any of its value types)."""
    if not isinstance(value, list):
        raise TypeError(f"expected a list in the message, got {type(value).__name__}")
    return value


def node_args(message: Message, context: Context) -> list[str]:
    """The server's fedrcl arguments (sent in every message), with the node's own ``data-root`` if set."""
    args = [str(a) for a in _as_list(message.content.config_records["fedrcl.run"]["args"])]
    if "data-root" in context.node_config:
        args += ["--data.root", str(context.node_config["data-root"])]
    return args


def _local_update(context: Context, args: list[str]) -> LocalUpdate:
    run = f"{zlib.crc32(' '.join(args).encode()):08x}"  # several fedrcl runs may share one Flower run
    state_dir = str(node.state_base(context.node_config) / f"run{context.run_id}" / run)
    key = (context.run_id, tuple(args), state_dir)
    if key not in _PROCESS:
        _PROCESS.clear()  # a new run: drop the previous run's model and data
        started = time.perf_counter()
        cli = build([*args, *client_args(state_dir)])
        _PROCESS[key] = LocalUpdate(cli.trainer, cli.model, cli.datamodule)
        log.info("built the client run of Flower run %s (%s) in %.2f s", context.run_id, run,
                 time.perf_counter() - started)
    return _PROCESS[key]


def make_client_app() -> ClientApp:
    """The ClientApp. It takes fedrcl's arguments from the server's messages, so a node needs no config of
    its own: only its partition (and, if its data lies elsewhere than the config says, ``data-root``)."""
    app = ClientApp()

    @app.query()
    def query(message: Message, context: Context) -> Message:
        node.check(context.node_config)
        update = _local_update(context, node_args(message, context))
        part, parts = node.partition(context.node_config)
        clients = node.served_clients(context.node_config, update.datamodule.num_clients)
        log.info("partition %s of %s: clients %s", part, parts, clients)
        answer = ConfigRecord({"clients": clients, "partition": part, "partitions": parts})
        return Message(RecordDict({"fedrcl.clients": answer}), reply_to=message)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        update = _local_update(context, node_args(message, context))
        task = message.content.config_records["fedrcl.round"]
        round_idx, clients = int(str(task["round_idx"])), [int(k) for k in _as_list(task["clients"])]
        served = node.served_clients(context.node_config, update.datamodule.num_clients)
        foreign = [k for k in clients if k not in served]
        if foreign:
            raise ValueError(f"clients {foreign} are not served by this node ({dict(context.node_config)})")
        store = getattr(update.module, "store", None)
        store = store if isinstance(store, ClientStateStore) else None
        if store is not None:  # the server's manifest: each client's current file, and the checkpointed ones
            store.follow({client_id: str(current) or None
                          for client_id, current in zip(clients, _as_list(task["state_files"]))})
            store.keep([str(kept) for kept in _as_list(task["kept"]) if kept])
        arrays = message.content.array_records
        sent = arrays["fedrcl.sent"].to_torch_state_dict()
        secure = RECORD_KEY_CONFIGS in message.content.config_records  # a SecAgg+ round's masked-vector stage
        replies: dict[str, ArrayRecord | MetricRecord | ConfigRecord] = {}
        node_update = SecureUpdate(sent, task) if secure else None
        for client_id in clients:  # the sampled order
            extras = {name: arrays[f"fedrcl.{client_id}.{name}"].to_torch_state_dict()
                      for name in ("broadcast", "download") if f"fedrcl.{client_id}.{name}" in arrays}
            try:
                result = update.run(round_idx, client_id, Downlink(sent, extras))
            except Exception as error:
                raise ClientError(f"client {client_id} (round {round_idx + 1}): {type(error).__name__}: "
                                  f"{error}") from error
            written = store.file(client_id) if store is not None else None
            if node_update is not None:  # summed on the node; the server gets it masked, with the others'
                node_update.add(result.weights, update.datamodule.client_num_samples(client_id))
            else:
                replies.update({
                    f"fedrcl.{client_id}.weights": ArrayRecord.from_torch_state_dict(dict(result.weights)),
                    f"fedrcl.{client_id}.upload": ArrayRecord.from_torch_state_dict(dict(result.upload))})
            replies.update({
                f"fedrcl.{client_id}.train": MetricRecord({"steps": result.steps, **result.loss_sums}),
                f"fedrcl.{client_id}.status": ConfigRecord({"failure": result.failure or "",
                                                           "state_file": "" if written is None else str(written)}),
            })
        content = RecordDict(replies)
        if node_update is not None:
            node_update.reply(content)
        return Message(content, reply_to=message)

    return app


class SecureUpdate:
    """A node's half of a SecAgg+ round (``fedrcl.flower.secure_aggregation``): its clients' updates
    ``w_k - sent`` (every floating-point entry, float64), with DP-FedAvg each clipped to ``dp_clip_norm`` and
    noised with ``N(0, dp_noise_std^2)`` from this node's own entropy (never the run's seed: the server must not
    know it), summed with weights (sample counts, or 1 with DP); ``reply`` puts their weighted mean and its
    weight where Flower's ``secaggplus_mod`` reads them (a ``FitRes``), checked against the clipping range.

    Args:
        sent: the round's broadcast weights.
        task: the round's ``fedrcl.round`` record (``secure_clipping_range``, ``dp_clip_norm``,
            ``dp_noise_std``: 0 without DP).
    """

    def __init__(self, sent: dict[str, torch.Tensor], task: Mapping[str, Any]):
        self.sent = {k: v for k, v in sent.items() if v.is_floating_point()}  # the server's vector order
        self.clipping_range = float(task["secure_clipping_range"])
        self.clip_norm = float(task["dp_clip_norm"])
        self.noise_std = float(task["dp_noise_std"])
        self.total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in self.sent.items()}
        self.weight = 0
        self.noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))

    def add(self, weights: Mapping[str, torch.Tensor], num_samples: int) -> None:
        """Fold in one client's weights (weight: its sample count; 1 under DP-FedAvg, clipped and noised)."""
        if self.clip_norm > 0:
            weights, _ = clip_update(weights, self.sent, self.clip_norm)
        weight = num_samples if self.clip_norm <= 0 else 1
        for k, acc in self.total.items():
            delta = weights[k].double().cpu() - self.sent[k].double().cpu()
            if self.noise_std > 0:
                delta += torch.randn(delta.shape, generator=self.noise, dtype=torch.float64) * self.noise_std
            acc.add_(delta, alpha=weight)
        self.weight += weight

    def reply(self, content: RecordDict) -> None:
        mean = [(acc / self.weight).numpy() for acc in self.total.values()]
        check_range(mean, list(self.total), self.clipping_range)
        legacy = fitres_to_recorddict(FitRes(Status(Code.OK, ""), ndarrays_to_parameters(mean), self.weight, {}),
                                      keep_input=False)
        content.array_records.update(legacy.array_records)
        content.metric_records.update(legacy.metric_records)
        content.config_records.update(legacy.config_records)
