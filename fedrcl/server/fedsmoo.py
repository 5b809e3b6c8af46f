"""FedSMOO's server half (Sun et al., "Dynamic Regularized Sharpness Aware Minimization in Federated Learning:
Approaching Global Consistency and Smooth Landscape", ICML 2023, Algorithm 1), used with the client algorithm
``fedrcl.algorithms.FedSMOO``.

Two things are global: FedDyn's ``h`` (the mean of every client's weight dual, scaled), which shifts the mean
of the round's models exactly as ``fedrcl.server.FedDyn`` does (alpha is the paper's ``1 / beta``), and the
global perturbation ``s`` (0 at the start), sent with the weights to every client (``extra_broadcast``: counted
in the byte ledger). Each client uploads its weights and ``mu_i - s_hat_{i,K}`` (its perturbation dual less its
last local perturbation); then (``fedrcl.losses.perturbation_correction.global_perturbation``)

    s  <- rho v / ||v||,   v = sum_{i in S} (n_i / n_all) (mu_i - s_hat_{i,K})

The paper's ``v`` is the unweighted mean over the round's clients; a positive scale does not change ``s``, so
the two are the same with equal client sizes (here clients weigh by sample count, as in fedrcl's aggregation).
The authors' FL-Simulator drops ``s_hat_{i,K}`` from ``v`` ("its norm is small"); this is the paper's rule.
Several processes sum ``v`` at the server step (``fedrcl.server.client_reports``); ``h`` and ``s`` are in the
checkpoint.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from fedrcl.losses.perturbation_correction import global_perturbation
from fedrcl.server.base import State, round_update
from fedrcl.server.feddyn import FedDyn, h_update, server_model


class FedSMOO(FedDyn):
    """FedDyn's ``h`` and the global perturbation ``s`` (see the module docstring).

    Args:
        alpha: the dynamic regulariser's weight, the paper's ``1 / beta``, shared with the clients
            (``fedrcl.algorithms.FedSMOO`` reads it here); > 0. FL-Simulator's ``lamb`` 0.1.
        rho: the perturbation radius of the clients' ``s_hat`` and of ``s``, shared with the clients; >= 0.
            FL-Simulator's default 0.1 (its README's tuned FedSMOO setting on CIFAR-10).
    """

    def __init__(self, alpha: float = 0.1, rho: float = 0.1):
        super().__init__(alpha)
        if not rho >= 0:
            raise ValueError(f"trainer.server.init_args.rho must be >= 0, got {rho}")
        self.rho = rho

    def perturbation(self, like: Mapping[str, Tensor]) -> State:
        """The global perturbation ``s`` (created 0 with ``like``'s shapes if there is none yet)."""
        return self.buffer("perturbation", like)

    def receive(self, num_samples: int, total_samples: int, correction: Mapping[str, Tensor] = {}) -> None:
        """A client's report: its and all clients' sample counts and its ``mu_i - s_hat_{i,K}``."""
        self.reports.add(num_samples, total_samples, correction)

    def broadcast(self, global_state: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """The global model; ``s`` is created (0) over its floating-point entries before the first round, so that
        every round sends it."""
        self.perturbation({k: v for k, v in global_state.items() if v.is_floating_point()})
        return global_state

    def extra_broadcast(self, client: Any) -> Mapping[str, Tensor]:
        return self.memory.get("perturbation", {})

    def load_broadcast(self, client: Any, extra: Mapping[str, Tensor]) -> None:
        """On a client's own machine (``fedrcl.flower``): take ``s`` from what ``extra_broadcast`` sent."""
        if extra:
            self.memory["perturbation"] = dict(extra)
        else:
            self.memory.pop("perturbation", None)

    def step(self, global_state: State, sent: Mapping[str, Tensor], client_mean: Mapping[str, Tensor]) -> State:
        drift = round_update(sent, client_mean)
        fraction, sums = self.reports.total(next(iter(drift.values())).device)
        h = self.buffer("h", drift)
        for k, d in drift.items():
            h[k] = h_update(h[k], d, self.alpha, fraction)
        s = self.memory.setdefault("perturbation", {})  # (``broadcast`` made it over every floating entry)
        for k, new in global_perturbation(sums, self.rho).items():
            s[k] = new.to(global_state[k].dtype)
        return {k: server_model(client_mean[k], h[k], self.alpha).to(w.dtype) if k in drift else w
                for k, w in global_state.items()}
