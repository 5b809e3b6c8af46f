"""Communication and time per round: the bytes a deployment would send, and where the wall seconds go.

Bytes: every sampled client receives what the server broadcasts (``Federation``'s ``sent`` state dict:
the global model, or FedACG's look-ahead ``w + lam M``) and uploads its whole local state dict; every
floating and integer entry counts, at its dtype's size (``state_bytes``). A method that sends more says
so with two optional methods on the client algorithm, each returning the extra tensors of one client in
the round (their bytes are added by dtype):

- ``extra_download(client) -> Mapping[str, Tensor]``: received besides the weights (FedProc: the global
  class prototypes and which classes have one);
- ``extra_upload(client) -> Mapping[str, Tensor]``: sent besides the weights (FedProc: its per-class
  feature sums and counts), called after ``on_client_end``.

State a client keeps for itself (MOON's previous local model, on the client's disk) is not sent and counts
nothing. A server optimizer may define ``extra_broadcast(client)`` the same way (control variates).

Where clients run on other machines (``fedrcl.flower``) these extras travel in the messages, and each has
its receiving end: ``load_broadcast(client, extra)`` on the server optimizer and ``load_download(client,
extra)`` on the client algorithm install what came down in the client's copy before it trains;
``receive_upload(client, upload)`` on the client algorithm hands a client's upload (``{}`` for a method that
reports only its sample count, FedDyn) to its server half, which the round then finishes with the server
step and, if the algorithm has it, ``end_server_round()``. In one process the client half calls them itself.

Time: the round's wall seconds (from one round's start to the next's) split into ``local_training``
(clients' steps and their ``on_client_end``), ``aggregation`` (the weighted sum and the server step),
``evaluation`` (the validation loop, client-end analysis callbacks, and what callbacks report with
``RoundLedger.add``) and ``logging`` (the rest: metric and checkpoint writing, other callbacks).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Callable, Optional

from torch import Tensor

PARTS = ("local_training", "aggregation", "evaluation", "logging")


def state_bytes(state: Mapping[str, Tensor]) -> Counter:
    """Bytes of a state dict by dtype name (``{"float32": 4 * numel, "int64": ...}``)."""
    sizes: Counter = Counter()
    for tensor in state.values():
        sizes[str(tensor.dtype).removeprefix("torch.")] += tensor.numel() * tensor.element_size()
    return sizes


def client_traffic(sent: Mapping[str, Tensor], uploaded: Mapping[str, Tensor], algorithm: Any = None,
                   server: Any = None, client: Any = None) -> tuple[Counter, Counter]:
    """``(down, up)`` bytes by dtype of one client in one round (see the module docstring)."""
    down, up = state_bytes(sent), state_bytes(uploaded)
    for owner, name, total in ((algorithm, "extra_download", down), (server, "extra_broadcast", down),
                               (algorithm, "extra_upload", up)):
        extra: Optional[Callable] = getattr(owner, name, None)
        if extra is not None:
            total.update(state_bytes(extra(client)))
    return down, up


class RoundLedger:
    """Bytes and seconds of the current round, and the run's cumulative bytes (kept in checkpoints).

    The federation calls ``start_round`` at each round's start, ``count_client`` at each client's end,
    ``timed(part)`` around aggregation and evaluation and ``trained`` when the last client is done;
    ``metrics`` gives the finished round's values under ``comm/...`` and ``time/..._seconds``.
    """

    def __init__(self) -> None:
        self.cumulative = {"down": 0, "up": 0}
        self._round: Optional[int] = None
        self._started = self._trained = 0.0
        self._seconds: dict[str, float] = {}
        self._bytes: dict[str, Counter] = {}

    def start_round(self, round_idx: int) -> None:
        self._round, self._started, self._trained = round_idx, time.perf_counter(), 0.0
        self._seconds = dict.fromkeys(PARTS, 0.0)
        self._bytes = {"down": Counter(), "up": Counter()}

    def count_client(self, sent: Mapping[str, Tensor], uploaded: Mapping[str, Tensor], algorithm: Any = None,
                     server: Any = None, client: Any = None) -> None:
        down, up = client_traffic(sent, uploaded, algorithm, server, client)
        self._bytes["down"].update(down)
        self._bytes["up"].update(up)

    def add(self, part: str, seconds: float) -> None:
        """Count ``seconds`` of the current round under ``part`` (``aggregation`` or ``evaluation``)."""
        if self._round is not None:
            self._seconds[part] += seconds

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, time.perf_counter() - started)

    def trained(self) -> None:
        """The round's last client is done: what is not aggregation or evaluation so far is local training."""
        elapsed = time.perf_counter() - self._started
        self._seconds["local_training"] = elapsed - self._seconds["aggregation"] - self._seconds["evaluation"]

    def totals(self, reduce: Optional[Callable[[int], int]] = None) -> None:
        """Fold the round's bytes into the cumulative counts (``reduce`` sums them over processes)."""
        for direction, sizes in self._bytes.items():
            if reduce is not None:
                self._bytes[direction] = sizes = Counter({k: reduce(v) for k, v in sorted(sizes.items())})
            self.cumulative[direction] += sum(sizes.values())

    def metrics(self) -> tuple[Optional[int], dict[str, float]]:
        """``(round_idx, metrics)`` of the round begun last (``None`` before any); its wall time ends now."""
        if self._round is None:
            return None, {}
        wall = time.perf_counter() - self._started
        seconds = dict(self._seconds)
        seconds["logging"] = max(0.0, wall - sum(seconds[p] for p in PARTS if p != "logging"))
        out = {f"time/{part}_seconds": value for part, value in seconds.items()}
        out["time/round_wall_seconds"] = wall
        out.update(self.comm_metrics())
        round_idx, self._round = self._round, None
        return round_idx, out

    def comm_metrics(self) -> dict[str, float]:
        """The ``comm/...`` part of ``metrics``, without ending the round: final once ``totals`` ran (the
        round's checkpoint logs them first, so that a stop after it leaves no round without them)."""
        out = {}
        for direction, sizes in self._bytes.items():
            out[f"comm/{direction}_bytes"] = float(sum(sizes.values()))
            out.update({f"comm/{direction}_bytes_{dtype}": float(n) for dtype, n in sizes.items()})
            out[f"comm/cumulative_{direction}_bytes"] = float(self.cumulative[direction])
        out["comm/cumulative_bytes"] = float(self.cumulative["down"] + self.cumulative["up"])
        return out

    def state_dict(self) -> dict[str, int]:
        return dict(self.cumulative)

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.cumulative = {"down": int(state["down"]), "up": int(state["up"])}
