"""Communication and time per round: the bytes a deployment would send, and where the wall seconds go.

Bytes: every sampled client receives what the server broadcasts (``ServerRound.sent``: the global model,
or FedACG's look-ahead ``w + lam M``) and uploads its whole local state dict; every floating and integer
entry counts, at its dtype's size (``state_bytes``). What a method sends besides the weights (its exchange
hooks, ``fedrcl.contract.exchange``: the server's ``extra_broadcast``, the algorithm's ``extra_download``
and ``extra_upload``) is counted with them: the round (``fedrcl.federated.round.ServerRound.add``) hands
each client's down- and uploaded state dicts to ``RoundLedger.count_client``. State a client keeps for
itself (MOON's previous local model, on the client's disk) is not sent and counts nothing.

Time: the round's wall seconds (from one round's start to the next's) split into ``local_training``
(clients' steps and their ``on_client_end``), ``aggregation`` (the weighted sum and the server step),
``evaluation`` (the validation loop, client-end analysis callbacks, and what callbacks report with
``RoundLedger.add``) and ``logging`` (the rest: metric and checkpoint writing, other callbacks).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Callable, Optional

from torch import Tensor

PARTS = ("local_training", "aggregation", "evaluation", "logging")


def state_bytes(state: Mapping[str, Tensor]) -> Counter:
    """Bytes of a state dict by dtype name (``{"float32": 4 * numel, "int64": ...}``)."""
    sizes: Counter = Counter()
    for tensor in state.values():
        sizes[str(tensor.dtype).removeprefix("torch.")] += tensor.numel() * tensor.element_size()
    return sizes


def client_traffic(down: Iterable[Mapping[str, Tensor]], up: Iterable[Mapping[str, Tensor]]) -> tuple[Counter, Counter]:
    """``(down, up)`` bytes by dtype of one client in one round: the state dicts it received and sent."""
    received: Counter[str] = Counter()
    sent: Counter[str] = Counter()
    for state in down:
        received.update(state_bytes(state))
    for state in up:
        sent.update(state_bytes(state))
    return received, sent


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

    def count_client(self, down: Iterable[Mapping[str, Tensor]], up: Iterable[Mapping[str, Tensor]]) -> None:
        """Count one client's bytes: the state dicts it received (``down``) and sent (``up``)."""
        received, sent = client_traffic(down, up)
        self._bytes["down"].update(received)
        self._bytes["up"].update(sent)

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
