"""One federated round, written once: the server's half (``ServerRound``) and one client's (``ClientRun``).

Every backend drives these two objects and keeps only what is its own (moving tensors, processes,
messages): ``fedrcl fit``'s round loop (``fedrcl.federated.federation``: clients one after another in
Lightning's batch stream), batched clients (``fedrcl.federated.batched``: a round's clients on a stacked
axis), a process serving single clients (``fedrcl.federated.local_update``: a Flower node) and Flower's
strategy (``fedrcl.flower.strategy``).

A round has phases, as Flower's configure / aggregate, on every backend:

1. **begin** ``ServerRound(...)``: the algorithm's ``begin_server_round(round_idx, global_state)`` (its
   server copy sees the round's global weights before any downlink), then ``sent = server.broadcast(
   global_state)`` (FedACG: the look-ahead); the ledger's round begins;
2. **configure** ``configure(plan)``: every client's facts (``client_context``: its id, sample count and
   steps from the ``RoundPlan``) and its downlink: ``sent``, the server's ``extra_broadcast`` and the
   algorithm's ``extra_download`` (``fedrcl.contract.exchange``), copied, so fixed: what clients receive
   this round is decided before any upload is folded in, and cannot change afterwards, even when
   ``receive_upload`` changes the state they were computed from (in place or not);
3. **fold** ``add(client, result)``, in the sampled order, as clients finish: a failed client recorded, its
   bytes counted, its upload handed to the algorithm's ``receive_upload`` (which may change server state
   freely), its weights added to the sample-weighted float64 sum;
4. **finish** ``finish()``: a client that failed in any process stops the run (``DivergenceError`` naming it);
   the mean over every process's clients, ``server.step``, the algorithm's ``end_server_round`` (where
   server state is finished for the round), and non-finite new weights stop the run; the ledger's round
   totals. Returns the new global weights.

Client run, per client: ``start()`` loads ``sent`` into the backbone in place, installs the extras in the
client's copies (``load_broadcast``, ``load_download``) and calls ``on_client_start``; ``set_lr`` sets the
client lr of a local epoch on the optimizer; ``add_loss`` sums the step losses on the device; ``end()``
calls ``on_client_end`` and returns the weights, the ``extra_upload`` and a failure (non-finite summed
loss or weights).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from fedrcl.contract.context import ClientContext, ClientData
from fedrcl.contract.exchange import ClientExchange, Reduce, Tensors
from fedrcl.contract.plan import RoundPlan
from fedrcl.contract.weights import load_state_
from fedrcl.federated.aggregation import WeightedSum
from fedrcl.federated.communication import RoundLedger
from fedrcl.federated.divergence import DivergenceError, all_finite, client_failure, divergence_message

if TYPE_CHECKING:  # the round imports neither Lightning nor the algorithms at run time
    import fedrcl.algorithms.fedavg
    from fedrcl.contract.context import ClientServer
    from fedrcl.privacy import DPFedAvg
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


def client_context(plan: RoundPlan, position: int, global_state: Tensors, server: Optional[ClientServer],
                   data: Optional[ClientData] = None) -> ClientContext:
    """The round's facts for the client at ``position`` of ``plan``: the same on the server and on the client's
    side of every backend (its id, sample count, this round's steps, the seed, what was broadcast); ``data``:
    the client's own data, where the client trains."""
    return ClientContext(round_idx=plan.round_idx, client_id=plan.client_ids[position],
                         num_samples=plan.num_samples[position], num_steps=plan.steps[position], seed=plan.seed,
                         global_state=global_state, server=server, data=data, local_epochs=plan.local_epochs)


def freeze(tensors: Tensors, copies: dict[int, Tensor]) -> dict[str, Tensor]:
    """A copy of ``tensors`` that later in-place changes of the originals cannot reach. ``copies`` (original's
    id -> copy) is shared over a round's clients, so that a tensor sent to several (SCAFFOLD's ``c``) is
    copied once."""
    return {name: copies.setdefault(id(t), t.detach().clone()) for name, t in tensors.items()}


class ServerRound:
    """The server's half of one round (see the module docstring).

    Args:
        server: the server optimizer.
        algorithm: the server's copy of the client algorithm: its exchange hooks (``extra_download``,
            ``receive_upload``, ``end_server_round``), all that the round uses of it.
        round_idx: the round's 0-based index.
        global_state: the global weights at the round's start.
        ledger: where the round's bytes and seconds are counted (``None``: nowhere).
        reduce: sums a tensor over processes (``None``: one process).
        vote: whether any process has a failed client, given this one's answer (``None``: one process).
        privacy: ``trainer.privacy`` (``fedrcl.privacy.DPFedAvg``): each client's update clipped as it is folded
            in, with uniform weights, and the mean noised before the server step (``None``: plain averaging).
    """

    def __init__(self, server: ServerOptimizer, algorithm: ClientExchange, round_idx: int,
                 global_state: Mapping[str, Tensor], ledger: Optional[RoundLedger] = None, reduce: Reduce = None,
                 vote: Optional[Callable[[bool], bool]] = None, privacy: Optional[DPFedAvg] = None):
        self.server, self.algorithm, self.round_idx = server, algorithm, round_idx
        self.global_state = dict(global_state)
        algorithm.begin_server_round(round_idx, self.global_state)
        self.sent: Tensors = server.broadcast(self.global_state)
        self.ledger, self.reduce, self.vote = ledger, reduce, vote
        if ledger is not None:
            ledger.start_round(round_idx)
        self.failures: dict[int, str] = {}
        self.clients: dict[int, tuple[ClientContext, Downlink]] = {}  # configured: client -> facts, downlink
        self._folded = False
        self._sum = WeightedSum(self.global_state)
        self.privacy, self._unclipped = privacy, 0  # DP: this process's clients within the clip norm

    def configure(self, plan: RoundPlan, data_of: Optional[Callable[[int], ClientData]] = None
                  ) -> list[tuple[ClientContext, Downlink]]:
        """Phase 2: the facts and the downlink of every client of ``plan``, fixed from now on (see the module
        docstring); in the plan's order. ``data_of``: each client's own data, where clients train in this
        process (``fedrcl fit``); ``None`` where they train elsewhere (Flower's server)."""
        if self._folded:
            raise RuntimeError("a round's downlinks are configured before any upload is folded in")
        contexts = [client_context(plan, i, self.sent, self.server, None if data_of is None else data_of(k))
                    for i, k in enumerate(plan.client_ids)]
        extras = [{"broadcast": self.server.extra_broadcast(c), "download": self.algorithm.extra_download(c)}
                  for c in contexts]  # every downlink computed before any is copied: the originals stay alive
        copies: dict[int, Tensor] = {}
        configured = [(c, Downlink(self.sent, {name: freeze(t, copies) for name, t in one.items() if t}))
                      for c, one in zip(contexts, extras)]
        self.clients.update((c.client_id, (c, down)) for c, down in configured)
        return configured

    def add(self, client_id: int, result: ClientResult) -> None:
        """Phase 3: fold in the result of configured client ``client_id``; call in the round's sampled order."""
        client, down = self.clients[client_id]
        self._folded = True
        if result.failure is not None:
            self.failures[client_id] = result.failure
        if self.ledger is not None:
            self.ledger.count_client([down.sent, *down.extras.values()], [result.weights, result.upload])
            with self.ledger.timed("aggregation"):
                self._fold(client, result)
        else:
            self._fold(client, result)

    def _fold(self, client: ClientContext, result: ClientResult) -> None:
        self.algorithm.receive_upload(client, result.upload)
        if self.privacy is None:
            self._sum.add(result.weights, weight=float(client.num_samples))
            return
        weights, unclipped = self.privacy.clip(result.weights, self.sent)  # DP-FedAvg: per client, uniform
        self._unclipped += unclipped
        self._sum.add(weights, weight=1.0)

    def finish(self) -> dict[str, Tensor]:
        """Phase 4: the new global weights (see the module docstring)."""
        if self.ledger is None:
            return self._step()
        self.ledger.trained()
        with self.ledger.timed("aggregation"):
            new_global = self._step()
        reduce, device = self.reduce, next(iter(new_global.values())).device
        self.ledger.totals(None if reduce is None else lambda n: int(reduce(
            torch.tensor(float(n), dtype=torch.float64, device=device))))
        return new_global

    def _step(self) -> dict[str, Tensor]:
        failed = bool(self.failures)
        if self.vote(failed) if self.vote is not None else failed:  # every process decides together
            raise DivergenceError(divergence_message(self.round_idx, self.failures, HINT))
        mean = self._sum.mean(self.reduce)
        if self.privacy is not None:  # the noise once, after the reduce: the same on every process
            seed = next(iter(self.clients.values()))[0].seed
            mean = self.privacy.release(mean, self._unclipped, seed, self.round_idx, self.reduce)
        new_global = self.server.step(self.global_state, self.sent, mean)
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
        self.loss_sum: Optional[Tensor] = None

    def start(self) -> None:
        """Load the broadcast weights, install the extras, call ``on_client_start``."""
        algorithm, client, extras = self.algorithm, self.client, self.downlink.extras
        assert client.server is not None, "a client's run is given its copy of the server"
        load_state_(algorithm.backbone, self.downlink.sent)
        client.server.load_broadcast(client, extras.get("broadcast", {}))
        algorithm.load_download(client, extras.get("download", {}))
        algorithm.on_client_start(client)

    def set_lr(self, optimizers: Iterable[torch.optim.Optimizer], local_epoch: int) -> None:
        """Set the client lr of local epoch ``local_epoch`` on every parameter group of ``optimizers``."""
        lr = float(self.algorithm.client_lr(self.client.round_idx, local_epoch))
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def add_loss(self, loss: Tensor) -> None:
        """Add a step's loss to the client's sum, on the device (checked once, in ``end``)."""
        loss = loss.detach()
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss

    def end(self) -> ClientResult:
        """Call ``on_client_end`` (the client's weights are in the backbone); the weights (the backbone's own
        tensors: copy them to keep them past the next client), the upload and a failure (a non-finite summed
        loss, or non-finite weights)."""
        self.algorithm.on_client_end(self.client)
        weights = self.algorithm.backbone.state_dict()
        upload = self.algorithm.extra_upload(self.client)
        return ClientResult(weights, upload, client_failure(self.loss_sum, weights))
