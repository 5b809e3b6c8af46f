"""``DPFedAvg``: user-level differential privacy for any client method and server optimizer (``trainer.privacy``).

DP-FedAvg (McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language Models",
ICLR 2018) with the fixed-size sampling of fedrcl's rounds (``m`` of ``N`` clients, without replacement):

    delta_k <- (w_k - sent) * min(1, C / ||w_k - sent||)          each client's update, clipped (``clipping``)
    mean    <- sent + (1 / m) sum_k delta_k + N(0, (z C / m)^2 I)  uniform weights, Gaussian noise
    global  <- server.step(global, sent, mean)                    FedAvg, FedAdam (DP-FedAdam), ...

Uniform weights (the paper's estimator with every weight 1), not sample counts: a client's weight would
otherwise be data-dependent. The noise is drawn from a generator seeded by (``trainer.seed``, round), not from
the global RNG, so a run is reproducible and a resumed run draws what the uninterrupted one drew; with several
processes every process draws the same noise after the all-reduce. ``adaptive``: the clip norm follows the
``target_quantile`` of the update norms (Andrew et al., NeurIPS 2021), from the noised unclipped count, whose
release is accounted too. Epsilon at ``delta`` after each round: ``fedrcl.privacy.accounting``.

The round (``fedrcl.federated.round.ServerRound``) calls ``clip`` for each client it folds in and ``release``
on the round's mean, on every backend (``fedrcl fit``, batched clients, seeds together, several processes,
Flower). A method whose server half takes more than the clients' weights (``receive_upload``: SCAFFOLD's
control variates, FedDyn, FedProc's prototypes) is refused: those uploads would be neither clipped nor noised.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from fedrcl.privacy import accounting
from fedrcl.privacy.accounting import RoundMechanism
from fedrcl.privacy.clipping import adaptive_clip_norm, clip_update

NOISE_STREAM = 53  # keeps the noise's generator apart from client sampling's, which is seeded by (seed, round)


def round_generator(seed: int, round_idx: int) -> torch.Generator:
    """The CPU generator of round ``round_idx``'s noise: seeded by (seed, round) only."""
    entropy = np.random.default_rng([seed, round_idx, NOISE_STREAM]).integers(2**63)
    return torch.Generator().manual_seed(int(entropy))


def gaussian_like(mean: Mapping[str, Tensor], std: float, generator: torch.Generator) -> dict[str, Tensor]:
    """``N(0, std^2)`` noise for every entry of ``mean``, drawn in float64 on the CPU in ``mean``'s order, then
    put on each entry's device (the same numbers on every device and process)."""
    return {k: (torch.randn(v.shape, generator=generator, dtype=torch.float64) * std).to(v.device)
            for k, v in mean.items()}


class DPFedAvg:
    """User-level DP-FedAvg with an accountant (see the module docstring).

    Args:
        noise_multiplier: z: the noise's standard deviation on the sum of clipped updates over the clip norm
            (the paper: 1.0); 0 adds no noise (epsilon is then infinite).
        clip_norm: C: the L2 norm each client's update (all floating-point weights) is clipped to; with
            ``adaptive``, its initial value.
        delta: the delta of the (epsilon, delta) reported; below 1 / data.num_clients to mean something.
        max_epsilon: stop the run at the round boundary before epsilon would pass this (checkpointed);
            ``None``: no budget.
        adaptive: adapt the clip norm to the ``target_quantile`` of the update norms (Andrew et al., 2021).
        target_quantile: with ``adaptive``: the fraction of clients whose update is not clipped (paper: 0.5).
        clip_learning_rate: with ``adaptive``: eta of ``C <- C exp(-eta (b - target_quantile))`` (paper: 0.2).
        count_stddev: with ``adaptive``: the noise standard deviation of the unclipped count; ``None``: the
            paper's m / 20.
    """

    def __init__(self, noise_multiplier: float = 1.0, clip_norm: float = 1.0, delta: float = 1e-5,
                 max_epsilon: Optional[float] = None, adaptive: bool = False, target_quantile: float = 0.5,
                 clip_learning_rate: float = 0.2, count_stddev: Optional[float] = None):
        accounting.dp_accounting_module()  # refused in one line without the extra
        checks = (("noise_multiplier", noise_multiplier, noise_multiplier >= 0, ">= 0"),
                  ("clip_norm", clip_norm, clip_norm > 0, "> 0"), ("delta", delta, 0 < delta < 1, "in (0, 1)"),
                  ("max_epsilon", max_epsilon, max_epsilon is None or max_epsilon > 0, "> 0 or null"),
                  ("target_quantile", target_quantile, 0 <= target_quantile <= 1, "in [0, 1]"),
                  ("clip_learning_rate", clip_learning_rate, clip_learning_rate >= 0, ">= 0"),
                  ("count_stddev", count_stddev, count_stddev is None or count_stddev >= 0, ">= 0 or null"))
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"trainer.privacy.init_args.{name} must be {allowed}, got {value}")
        if max_epsilon is not None and noise_multiplier == 0:
            raise ValueError("trainer.privacy.init_args.max_epsilon needs noise_multiplier > 0: without noise "
                             "epsilon is infinite from the first round")
        self.noise_multiplier, self.clip_norm, self.delta = noise_multiplier, clip_norm, delta
        self.max_epsilon, self.adaptive = max_epsilon, adaptive
        self.target_quantile, self.clip_learning_rate, self.count_stddev = target_quantile, clip_learning_rate, \
            count_stddev
        self.population, self.sample_size = 0, 0  # set by ``bind``
        self.segments: list[list[Any]] = []  # [noise_multiplier, count_stddev, m, N, rounds]: the rounds accounted
        self.clip_norms: list[float] = []  # the clip norm each round used
        self._epsilon: tuple[Any, float] = ((), 0.0)  # the last epsilon computed, and the segments it is of

    # -- set-up -----------------------------------------------------------------------------------------
    def bind(self, population: int, sample_size: int, algorithm: Any) -> None:
        """The run's sampling (``sample_size`` of ``population`` clients a round) and method, before training:
        refuses a method whose uploads would escape clipping and noise, and a budget the first round passes."""
        from fedrcl.contract.exchange import ClientExchange, overrides
        if overrides(algorithm, ClientExchange, "receive_upload"):
            raise ValueError(f"trainer.privacy: {type(algorithm).__name__}'s server half takes each client's "
                             "upload or facts (receive_upload), which DP-FedAvg neither clips nor noises; use a "
                             "method that sends only its weights")
        self.population, self.sample_size = population, sample_size
        if self.max_epsilon is not None and self.rounds_left(1) < 1:
            raise ValueError(f"trainer.privacy.init_args.max_epsilon {self.max_epsilon}: the first round already "
                             f"spends epsilon {self.epsilon_after(1):.4g} at delta {self.delta} ({sample_size} of "
                             f"{population} clients, noise_multiplier {self.noise_multiplier})")

    @property
    def mechanism(self) -> RoundMechanism:
        """What a round releases now (``accounting``)."""
        count = (self.sample_size / 20 if self.count_stddev is None else self.count_stddev) if self.adaptive else 0.0
        return RoundMechanism(self.noise_multiplier, float(count), self.sample_size, self.population)

    def _done(self) -> list[tuple[RoundMechanism, int]]:
        return [(RoundMechanism(z, s, int(m), int(n)), int(t)) for z, s, m, n, t in self.segments]

    def epsilon_after(self, more: int) -> float:
        """Epsilon at ``delta`` after the rounds accounted and ``more`` rounds of the current mechanism."""
        return accounting.epsilon([*self._done(), (self.mechanism, more)], self.delta)

    def rounds_left(self, limit: int) -> int:
        """How many more rounds (at most ``limit``) keep epsilon within ``max_epsilon`` (``limit``: no budget)."""
        if self.max_epsilon is None:
            return limit
        return accounting.rounds_within(self.mechanism, self.delta, self.max_epsilon, self._done(), limit)

    def budget_spent(self) -> bool:
        """Whether one more round would pass ``max_epsilon`` (never without a budget)."""
        return self.max_epsilon is not None and self.rounds_left(1) < 1

    def metrics(self) -> dict[str, float]:
        """The scalars of the last round: ``privacy/epsilon`` and the clip norm it used ``privacy/clip_norm``."""
        return {"privacy/epsilon": self.epsilon, "privacy/clip_norm": self.clip_norms[-1]}

    def budget_line(self, done: int) -> str:
        """Why the run stops after ``done`` rounds: the next round would pass ``max_epsilon``."""
        return (f"fedrcl: trainer.privacy.init_args.max_epsilon {self.max_epsilon}: the run stops after round {done}, "
                f"epsilon {self.epsilon:.4g} at delta {self.delta}; one more round would make it "
                f"{self.epsilon_after(1):.4g}")

    # -- the round ----------------------------------------------------------------------------------------
    def clip(self, weights: Mapping[str, Tensor], sent: Mapping[str, Tensor]) -> tuple[Mapping[str, Tensor], bool]:
        """A client's weights with its update clipped to the clip norm, and whether it was within the norm."""
        clipped, norm = clip_update(weights, sent, self.clip_norm)
        return clipped, norm <= self.clip_norm

    def release(self, mean: Mapping[str, Tensor], unclipped: int, seed: int, round_idx: int,
                reduce: Optional[Any] = None) -> dict[str, Tensor]:
        """The round's noised mean of the clipped clients (``mean``: their uniform mean, every process's clients
        already summed); ``unclipped``: this process's clients within the norm. Accounts the round, and with
        ``adaptive`` sets the next round's clip norm from the noised unclipped fraction."""
        generator = round_generator(seed, round_idx)
        mechanism = self.mechanism
        std = self.noise_multiplier * self.clip_norm / self.sample_size
        noised = dict(mean)
        if std > 0:
            noise = gaussian_like(mean, std, generator)
            noised = {k: (v.double() + noise[k]).to(v.dtype) for k, v in mean.items()}
        self.clip_norms.append(self.clip_norm)
        self._account(mechanism)
        if self.adaptive:
            count = torch.tensor(float(unclipped), dtype=torch.float64, device=next(iter(mean.values())).device)
            total = float(reduce(count) if reduce is not None else count)
            count_noise = float(torch.randn((), generator=generator, dtype=torch.float64)) * mechanism.count_stddev
            fraction = (total + count_noise) / self.sample_size
            self.clip_norm = adaptive_clip_norm(self.clip_norm, fraction, self.target_quantile,
                                                self.clip_learning_rate)
        return noised

    def released_by_clients(self) -> None:
        """Account a round whose clipping and noise happened on the clients (distributed DP under Flower's secure
        aggregation, ``fedrcl.flower.secure_aggregation``: each of the ``m`` clients added ``N(0, (z C)^2 / m)``, so
        the secure sum carries ``release``'s noise). Fixed clipping only: adaptive clipping's noised count is
        not released that way (refused there)."""
        if self.adaptive:
            raise ValueError("adaptive clipping's unclipped count is released on the server, not by the clients")
        self.clip_norms.append(self.clip_norm)
        self._account(self.mechanism)

    def _account(self, mechanism: RoundMechanism) -> None:
        key = [mechanism.noise_multiplier, mechanism.count_stddev, mechanism.sample_size, mechanism.population]
        if self.segments and self.segments[-1][:4] == key:
            self.segments[-1][4] += 1
        else:
            self.segments.append([*key, 1])

    @property
    def epsilon(self) -> float:
        """Epsilon at ``delta`` after the rounds so far (0 before the first), computed when first asked for."""
        key = tuple(tuple(s) for s in self.segments)
        if self._epsilon[0] != key:
            self._epsilon = (key, accounting.epsilon(self._done(), self.delta) if key else 0.0)
        return self._epsilon[1]

    # -- checkpoint ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The clip norm and the accountant's history (plain numbers: read with ``weights_only``)."""
        return {"clip_norm": self.clip_norm, "segments": [list(s) for s in self.segments],
                "epsilon": self.epsilon, "clip_norms": list(self.clip_norms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``'s history; the adapted clip norm too (a fixed one is the config's)."""
        if self.adaptive:
            self.clip_norm = float(state["clip_norm"])
        self.segments = [list(s) for s in state["segments"]]
        self.clip_norms = [float(c) for c in state["clip_norms"]]
