"""One federated round, written once: the server's half (``ServerRound``) and one client's (``ClientRun``).

Every backend drives these two objects and keeps only what is its own (moving tensors, processes,
messages): ``fedrcl fit``'s round loop (``fedrcl.federated.federation``: clients one after another in
Lightning's batch stream), batched clients (``fedrcl.federated.batched``: a round's clients on a stacked
axis), a process serving single clients (``fedrcl.federated.local_update``: a Flower node) and Flower's
strategy (``fedrcl.flower.strategy``).

Server round, per round:

1. ``ServerRound(...)``: ``sent = server.broadcast(global_state)`` (FedACG: the look-ahead);
2. ``downlink(client)``: what a sampled client receives: ``sent``, the server's ``extra_broadcast`` and the
   algorithm's ``extra_download`` (``fedrcl.federated.exchange``);
3. ``add(client, result)``, in the sampled order: a failed client recorded, its bytes counted, its upload
   handed to the algorithm's ``receive_upload``, its weights added to the sample-weighted float64 sum;
4. ``finish()``: a client that failed in any process stops the run (``DivergenceError`` naming it); the
   mean over every process's clients, ``server.step``, the algorithm's ``end_server_round``, and non-finite
   new weights stop the run. Returns the new global weights.

Client run, per client: ``start()`` loads ``sent`` into the backbone in place, installs the extras in the
client's copies (``load_broadcast``, ``load_download``) and calls ``on_client_start``; ``lr(local_epoch)``
is the client lr of each local epoch; the backend runs the steps; ``end(loss_sum)`` calls ``on_client_end``
and returns the weights, the ``extra_upload`` and a failure (non-finite loss or weights).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from torch import Tensor

from fedrcl.federated.aggregation import WeightedSum
from fedrcl.federated.communication import RoundLedger
from fedrcl.federated.context import ClientContext
from fedrcl.federated.divergence import DivergenceError, all_finite, client_failure, divergence_message
from fedrcl.federated.exchange import ClientExchange, Reduce, Tensors
from fedrcl.federated.weights import load_state_

if TYPE_CHECKING:  # the round imports neither Lightning nor the algorithms at run time
    import fedrcl.algorithms.fedavg
    from fedrcl.server.base import ServerOptimizer

HINT = ("Lower model.init_args.lr or set model.init_args.grad_clip_norm; --ckpt_path last resumes from the last "
        "good checkpoint.")


@dataclass(frozen=True)
class Downlink:
    """What one client receives: the broadcast weights and, by name, what the method sends besides them
    (``broadcast``: the server's ``extra_broadcast``; ``download``: the algorithm's ``extra_download``)."""

    sent: Tensors
    extras: Mapping[str, Tensors] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientResult:
    """A finished client: its weights, what it uploads besides them, and why it failed (``None``: it did not)."""

    weights: Tensors
    upload: Tensors
    failure: Optional[str]


class ServerRound:
    """The server's half of one round (see the module docstring).

    Args:
        server: the server optimizer.
        algorithm: the server's copy of the client algorithm: its exchange hooks (``extra_download``,
            ``receive_upload``, ``end_server_round``), all that the round uses of it.
        round_idx: the round's 0-based index.
        global_state: the global weights at the round's start.
        ledger: where the round's bytes are counted (``None``: nowhere).
        reduce: sums a tensor over processes (``None``: one process).
        vote: whether any process has a failed client, given this one's answer (``None``: one process).
    """

    def __init__(self, server: ServerOptimizer, algorithm: ClientExchange, round_idx: int,
                 global_state: Mapping[str, Tensor], ledger: Optional[RoundLedger] = None, reduce: Reduce = None,
                 vote: Optional[Callable[[bool], bool]] = None):
        self.server, self.algorithm, self.round_idx = server, algorithm, round_idx
        self.global_state = dict(global_state)
        self.sent: Tensors = server.broadcast(self.global_state)
        self.ledger, self.reduce, self.vote = ledger, reduce, vote
        self.failures: dict[int, str] = {}
        self._sum = WeightedSum(self.global_state)

    def context(self, client_id: int, num_samples: int, num_steps: int, seed: int) -> ClientContext:
        """The round's facts for client ``client_id``, the server's client term included."""
        return ClientContext(round_idx=self.round_idx, client_id=client_id, num_samples=num_samples,
                             num_steps=num_steps, seed=seed, global_state=self.sent, server=self.server)

    def downlink(self, client: ClientContext) -> Downlink:
        """What ``client`` receives this round."""
        extras = {"broadcast": self.server.extra_broadcast(client),
                  "download": self.algorithm.extra_download(client)}
        return Downlink(self.sent, {name: dict(t) for name, t in extras.items() if t})

    def add(self, client: ClientContext, result: ClientResult, downlink: Optional[Downlink] = None) -> None:
        """Fold in one client's result; call in the round's sampled order (``downlink``: what it received,
        for the byte count; by default the broadcast weights alone)."""
        if result.failure is not None:
            self.failures[client.client_id] = result.failure
        if self.ledger is not None:
            down = downlink if downlink is not None else Downlink(self.sent)
            self.ledger.count_client([down.sent, *down.extras.values()], [result.weights, result.upload])
            with self.ledger.timed("aggregation"):
                self._fold(client, result)
        else:
            self._fold(client, result)

    def _fold(self, client: ClientContext, result: ClientResult) -> None:
        self.algorithm.receive_upload(client, result.upload)
        self._sum.add(result.weights, weight=float(client.num_samples))

    def finish(self) -> dict[str, Tensor]:
        """The new global weights (see the module docstring)."""
        failed = bool(self.failures)
        if self.vote(failed) if self.vote is not None else failed:  # every process decides together
            raise DivergenceError(divergence_message(self.round_idx, self.failures, HINT))
        new_global = self.server.step(self.global_state, self.sent, self._sum.mean(self.reduce))
        self.algorithm.end_server_round(self.reduce)
        if not all_finite(new_global.values()):
            raise DivergenceError(f"training diverged in round {self.round_idx + 1}: the server step "
                                  f"({type(self.server).__name__}) gave non-finite global weights. {HINT}")
        return new_global


class ClientRun:
    """One client's local update around the steps the backend runs (see the module docstring).

    Args:
        algorithm: the client algorithm (its ``backbone`` is the one client model).
        client: the round's facts for this client (``client.server``: the client's copy of the server).
        downlink: what the client received.
    """

    def __init__(self, algorithm: fedrcl.algorithms.fedavg.FedAvg, client: ClientContext, downlink: Downlink):
        self.algorithm, self.client, self.downlink = algorithm, client, downlink

    def start(self) -> None:
        """Load the broadcast weights, install the extras, call ``on_client_start``."""
        algorithm, client, extras = self.algorithm, self.client, self.downlink.extras
        assert client.server is not None, "a client's run is given its copy of the server"
        load_state_(algorithm.backbone, self.downlink.sent)
        client.server.load_broadcast(client, extras.get("broadcast", {}))
        algorithm.load_download(client, extras.get("download", {}))
        algorithm.on_client_start(client)

    def lr(self, local_epoch: int) -> float:
        """The client lr of local epoch ``local_epoch``."""
        return float(self.algorithm.client_lr(self.client.round_idx, local_epoch))

    def end(self, loss_sum: Optional[Tensor]) -> ClientResult:
        """Call ``on_client_end`` (the client's weights are in the backbone); the weights (the backbone's own
        tensors: copy them to keep them past the next client), the upload and a failure (``loss_sum``: the
        client's summed step losses, checked once here)."""
        self.algorithm.on_client_end(self.client)
        weights = self.algorithm.backbone.state_dict()
        upload = self.algorithm.extra_upload(self.client)
        return ClientResult(weights, upload, client_failure(loss_sum, weights))
