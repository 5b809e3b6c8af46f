"""What a method exchanges besides the weights: its hooks, declared once, with no-op defaults, and their check.

A round (``fedrcl.federated.round``) calls every hook, on every backend (``fedrcl fit``, batched clients,
several processes, Flower); a method overrides the ones it needs. Each thing sent has its receiving end:

- the server optimizer's ``extra_broadcast(client)`` is installed in the client's copy of the server by
  ``load_broadcast(client, extra)`` (SCAFFOLD's control variate);
- the algorithm's ``extra_download(client)`` is installed in the client's copy of the algorithm by
  ``load_download(client, extra)`` (FedProc's prototypes);
- the algorithm's ``extra_upload(client)`` (called after ``on_client_end``) is handed to the server's copy of
  the algorithm by ``receive_upload(client, upload)``, in the round's sampled order, before the server step;
  a method whose server half needs only the client's facts (FedDyn: its sample count) overrides
  ``receive_upload`` alone;
- ``begin_server_round(round_idx, global_state)`` runs on the server's copy when a round begins, before any
  client's downlink is computed: it sees the round's global weights (FedCM's global update is the difference
  from the last round's);
- ``end_server_round(reduce)`` runs on the server's copy after the server step (``reduce`` sums a tensor over
  processes, or is ``None``).

In one process the client's copy and the server's are the same objects, so what is installed is what was
sent; on Flower they live on different machines. ``check_method`` refuses, before training, a sender whose
receiving end is missing and a name that looks like a hook and is not one (``extra_uplaod``), and a
method paired with the wrong server half (``server_half``).
"""
from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Optional

from torch import Tensor

from fedrcl.contract.context import ClientContext

Tensors = Mapping[str, Tensor]
Reduce = Optional[Callable[[Tensor], Tensor]]


class ClientExchange:
    """The exchange hooks of a client algorithm (``fedrcl.algorithms.FedAvg`` inherits them): defaults send
    nothing and take nothing.

    ``server_half``: ``(server optimizer class, config overlay)`` when the method only works with that
    server (SCAFFOLD, FedDyn); the run is refused otherwise, naming ``trainer.server`` and the overlay.
    """

    server_half: ClassVar[Optional[tuple[type, str]]] = None

    def begin_server_round(self, round_idx: int, global_state: Tensors) -> None:
        """The server's copy begins round ``round_idx`` from ``global_state`` (read-only), before any downlink."""

    def extra_download(self, client: ClientContext) -> Tensors:
        """Sent to ``client`` besides the weights (counted in the byte ledger)."""
        return {}

    def load_download(self, client: ClientContext, extra: Tensors) -> None:
        """Install, in the client's copy, what ``extra_download`` sent."""

    def extra_upload(self, client: ClientContext) -> Tensors:
        """Sent by ``client`` besides its weights, after its ``on_client_end`` (counted in the byte ledger)."""
        return {}

    def receive_upload(self, client: ClientContext, upload: Tensors) -> None:
        """The server's copy takes a client's upload (``{}`` when the method uploads nothing extra)."""

    def end_server_round(self, reduce: Reduce = None) -> None:
        """The server's copy finishes the round, after the server step."""


class ServerExchange:
    """The exchange hooks of a server optimizer (``fedrcl.server.ServerOptimizer`` inherits them)."""

    def extra_broadcast(self, client: ClientContext) -> Tensors:
        """Sent to ``client`` besides the weights (counted in the byte ledger)."""
        return {}

    def load_broadcast(self, client: ClientContext, extra: Tensors) -> None:
        """Install, in the client's copy of the server, what ``extra_broadcast`` sent."""


# sender -> its receiving end, per base
PAIRS: dict[type, dict[str, str]] = {
    ClientExchange: {"extra_download": "load_download", "extra_upload": "receive_upload"},
    ServerExchange: {"extra_broadcast": "load_broadcast"},
}
HOOKS = ("begin_server_round", "extra_download", "load_download", "extra_upload", "receive_upload", "end_server_round",
         "extra_broadcast", "load_broadcast")


def overrides(obj: Any, base: type, name: str) -> bool:
    """Whether ``obj``'s class defines ``name`` other than ``base`` does."""
    return getattr(type(obj), name, None) is not getattr(base, name)


def own_names(obj: Any, base: type) -> set[str]:
    """Names defined by the classes of ``obj`` that derive from ``base`` (not by ``base``, not by others such
    as Lightning's)."""
    return {name for cls in type(obj).__mro__
            if cls is not base and isinstance(cls, type) and issubclass(cls, base) for name in vars(cls)}


def exchange_errors(obj: Any, base: type, role: str) -> list[str]:
    """What is wrong with ``obj``'s exchange hooks (``role``: how the error names it)."""
    name = type(obj).__name__
    errors = [f"{role} {name} defines {sender} but not {end}: what it sends would not be received "
              f"(fedrcl.contract.exchange)"
              for sender, end in PAIRS[base].items() if overrides(obj, base, sender) and not overrides(obj, base, end)]
    for own in sorted(own_names(obj, base) - set(HOOKS)):
        close = difflib.get_close_matches(own, HOOKS, n=1, cutoff=0.8)
        if close:
            errors.append(f"{role} {name} defines {own}, which is not an exchange hook: did you mean {close[0]}? "
                          f"(the hooks: {', '.join(HOOKS)})")
    return errors


def check_method(algorithm: Any, server: Any, training: bool = True) -> None:
    """Refuse, before training, a method whose exchange cannot work on every backend (see the module
    docstring): ``ValueError`` naming each problem. Without ``training`` (evaluating a checkpoint) the server
    half is not needed."""
    errors = []
    if isinstance(algorithm, ClientExchange):
        errors += exchange_errors(algorithm, ClientExchange, "model")
        half = algorithm.server_half
        if training and half is not None and not isinstance(server, half[0]):
            errors.append(f"model {type(algorithm).__name__} needs trainer.server fedrcl.server.{half[0].__name__} "
                          f"(its server half), got {type(server).__name__}: add --config {half[1]}")
    if isinstance(server, ServerExchange):
        errors += exchange_errors(server, ServerExchange, "trainer.server")
    if errors:
        raise ValueError("; ".join(errors))
