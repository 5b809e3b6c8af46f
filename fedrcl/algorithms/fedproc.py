"""FedProc client (Mu et al., "FedProc: Prototypical Contrastive Federated Learning on Non-IID Data", Future
Generation Computer Systems 2023).

    loss = (1 - alpha_t) * CE(f(x), y) + alpha_t * L_pc(z, y; c),   alpha_t = 1 - t / T

with ``z`` the last feature level (pooled, before its ReLU), ``c`` the global class prototypes and ``L_pc``
the prototypical contrastive loss (``fedrcl.losses.prototype_contrastive``); ``t`` is the round index and ``T``
the run's rounds (``anneal_rounds``), so the CE weight grows from 0 to 1 while the prototype term fades (the paper's annealed
hybrid loss). Round 0 has no prototypes yet: its clients train on CE alone (weight 1), since the paper's
schedule would give them no loss at all.
Checked against a public FedProc implementation (the FPL benchmark code): the same hybrid loss and linear
schedule, there with ``T - 1`` in place of ``T`` (its last round is CE only), cosine similarities without a
temperature (our default ``temperature=1``), and a zero loss in the prototype-less first round.

Server side (``PrototypeServer``): after local training each client computes, on its own data and with its
own final weights, the per-class sums of ``z`` (un-augmented images) and its per-class counts, and reports
only these. The server adds the reports up; at the round's end it divides sums by counts, which is
the count-weighted mean of the clients' class means. It never sees an image or a label.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms.fedavg import FedAvg
from fedrcl.contract.context import ClientContext
from fedrcl.losses.prototype_contrastive import class_feature_sums, prototype_contrastive_loss
from fedrcl.models.output import ModelOutput


class PrototypeServer:
    """Global class prototypes from the clients' reports (class feature sums and counts).

    ``prototypes`` (``[C, D]``) and ``available`` (``[C]``, classes some client has reported) hold the result
    of the last finished round; ``report`` adds a client's statistics to the current round; ``finish_round``
    turns them into new prototypes (classes nobody reported keep their previous prototype).
    """

    def __init__(self) -> None:
        self.prototypes: Optional[Tensor] = None
        self.available: Optional[Tensor] = None
        self._sums: Optional[Tensor] = None
        self._counts: Optional[Tensor] = None

    def report(self, sums: Tensor, counts: Tensor) -> None:
        self._sums = sums if self._sums is None else self._sums + sums
        self._counts = counts if self._counts is None else self._counts + counts

    def finish_round(self, reduce: Optional[Callable[[Tensor], Tensor]] = None) -> None:
        """Fold the pending reports into the prototypes (``reduce`` sums them across processes)."""
        if self._sums is None:
            return
        sums, counts = self._sums, self._counts
        assert counts is not None  # reported together with the sums
        if reduce is not None:
            sums, counts = reduce(sums), reduce(counts)
        seen = counts > 0
        if self.prototypes is None:
            self.prototypes, self.available = torch.zeros_like(sums), torch.zeros_like(seen)
        assert self.available is not None  # set together with the prototypes
        self.prototypes = torch.where(seen.unsqueeze(1), sums / counts.clamp(min=1).unsqueeze(1), self.prototypes)
        self.available = self.available | seen
        self._sums = self._counts = None

    def state_dict(self) -> dict[str, Optional[Tensor]]:
        return {"prototypes": self.prototypes, "available": self.available, "sums": self._sums,
                "counts": self._counts}

    def load_state_dict(self, state: dict[str, Optional[Tensor]]) -> None:
        self.prototypes, self.available = state["prototypes"], state["available"]
        self._sums, self._counts = state["sums"], state["counts"]


class FedProc(FedAvg):
    """Annealed mix of cross-entropy and contrastive alignment to the global class prototypes.

    Args:
        temperature: temperature of the prototype softmax (cosine similarities); must be > 0.
        anneal_rounds: T of the schedule alpha_t = 1 - t / T; null: the run's ``trainer.rounds`` (set it to
            keep the schedule when a run is resumed with more rounds).
    """

    def __init__(self, temperature: float = 1.0, anneal_rounds: Optional[int] = None, **kwargs: Any):
        super().__init__(**kwargs)
        if temperature <= 0:
            raise ValueError(f"model.temperature must be > 0, got {temperature}")
        if anneal_rounds is not None and anneal_rounds < 1:
            raise ValueError(f"model.anneal_rounds must be >= 1 or null, got {anneal_rounds}")
        self.temperature, self.anneal_rounds = temperature, anneal_rounds
        self.prototype_server = PrototypeServer()

    def proto_weight(self, round_idx: int) -> float:
        """alpha_t = 1 - t / T (0 while there are no prototypes)."""
        if self.prototype_server.prototypes is None:
            return 0.0
        rounds = self.anneal_rounds or self.trainer.max_epochs
        assert rounds is not None  # FederatedTrainer sets max_epochs to trainer.rounds
        return max(0.0, 1.0 - round_idx / rounds)

    def end_server_round(self, reduce: Optional[Callable[[Tensor], Tensor]] = None) -> None:
        """The round's reports become the prototypes (after the server step, before the round's checkpoint;
        with several processes ``reduce`` sums every process's reports, so rank 0's checkpoint holds finished
        prototypes)."""
        self.prototype_server.finish_round(reduce)

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        ce = F.cross_entropy(out.logits, y)
        assert self.client is not None, "client_loss runs in a client's run"
        alpha = self.proto_weight(self.client.round_idx)
        if alpha == 0.0:
            return ce, {"ce": ce, "proto": torch.zeros_like(ce)}
        prototypes, available = self.prototype_server.prototypes, self.prototype_server.available
        assert prototypes is not None and available is not None  # alpha > 0: there are prototypes
        proto = prototype_contrastive_loss(out.features[-1], y, prototypes.to(ce.device), available.to(ce.device),
                                           self.temperature)
        return (1 - alpha) * ce + alpha * proto, {"ce": ce, "proto": proto}

    @torch.no_grad()
    def on_client_end(self, client: ClientContext) -> None:
        """The client reports class sums and counts of its representations (computed on its own data)."""
        assert client.data is not None, "the round hands a training client its data"
        sums: Optional[Tensor] = None
        counts: Optional[Tensor] = None
        for x, y in client.data.batches():
            z = self.backbone(x).features[-1].float()
            s, c = class_feature_sums(z, y, client.data.num_classes)
            sums, counts = (s, c) if sums is None or counts is None else (sums + s, counts + c)
        assert sums is not None and counts is not None, f"client {client.client_id} has no training samples"
        self._report = {"sums": sums, "counts": counts}

    def receive_upload(self, client: ClientContext, upload: Mapping[str, Tensor]) -> None:
        """The server half takes a client's report (called by the round, on the server's copy)."""
        self.prototype_server.report(upload["sums"], upload["counts"])

    def extra_download(self, client: ClientContext) -> dict[str, Tensor]:
        """Sent to a client besides the weights (for the byte count): the prototypes, once there are any."""
        server = self.prototype_server
        if server.prototypes is None or server.available is None:  # set together
            return {}
        return {"prototypes": server.prototypes, "available": server.available}

    def load_download(self, client: ClientContext, extra: Mapping[str, Tensor]) -> None:
        """The client's copy takes the prototypes ``extra_download`` sent."""
        self.prototype_server.prototypes = extra.get("prototypes")
        self.prototype_server.available = extra.get("available")

    def extra_upload(self, client: ClientContext) -> dict[str, Tensor]:
        """Sent by a client besides its weights: its last report (class feature sums and counts)."""
        return self._report

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["prototype_server"] = self.prototype_server.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if "prototype_server" in checkpoint:
            self.prototype_server.load_state_dict(checkpoint["prototype_server"])
            self.prototype_server.finish_round()  # reports pending in a checkpoint of an older version
