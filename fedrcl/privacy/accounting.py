"""Privacy accounting of DP-FedAvg rounds with Google's ``dp-accounting`` (the optional extra ``fedrcl[dp]``).

One round releases the noised mean of ``m`` clients drawn uniformly *without replacement* from ``N``
(``fedrcl.federated.sampling``), so the round is ``SampledWithoutReplacementDpEvent(N, m, Gaussian)``,
which dp-accounting's RDP accountant supports under the *replace-one* neighbouring relation (a neighbouring
federation has one client's data replaced; ``N`` is public). Under replace-one the clipped sum moves by up to
``2 C`` (``delta`` to ``-delta``), so the Gaussian of standard deviation ``z C`` on the sum has noise multiplier
``z / 2`` with respect to its sensitivity. With adaptive clipping the noised unclipped count (sensitivity 1,
noise ``count_stddev``) is released too: the round's Gaussian is the composition of both.

Epsilon after ``T`` rounds is computed from the rounds' events each time (never accumulated in floats), so
a resumed run reports, bit for bit, the epsilon of a run that never stopped. RDP orders: 29 of dp-accounting's
default 156, from 1.1 to 64 (all 156 cost 0.4 s a round here, these 0.04 s; its orders above 64 matter only for
epsilons far below the ones federated training reaches). Fewer orders can only make epsilon larger, never
smaller; on the settings of ``tests/test_privacy.py`` both sets give the same epsilon to 4 decimals.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

INSTALL = 'pip install -e ".[dp]"'
ORDERS = (1.1, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 12, 14, 16,
          20, 24, 28, 32, 40, 48, 56, 64)


def dp_accounting_module():
    """``dp_accounting``, or a one-line ``ImportError`` naming the install command."""
    try:
        import dp_accounting
    except ImportError:
        raise ImportError(f"trainer.privacy needs Google's dp-accounting: {INSTALL}") from None
    return dp_accounting


@dataclass(frozen=True)
class RoundMechanism:
    """What one round releases, for its accounting: ``noise_multiplier`` (noise standard deviation over the clip
    norm, on the sum of clipped updates), ``count_stddev`` (the unclipped count's noise; 0: none released),
    ``sample_size`` clients drawn without replacement from ``population``."""

    noise_multiplier: float
    count_stddev: float
    sample_size: int
    population: int


def round_event(mechanism: RoundMechanism):
    """The round's ``dp_accounting`` event (see the module docstring)."""
    dpa = dp_accounting_module()
    gaussian = dpa.GaussianDpEvent(mechanism.noise_multiplier / 2)  # replace-one: sensitivity 2 C
    if mechanism.count_stddev > 0:
        gaussian = dpa.ComposedDpEvent([gaussian, dpa.GaussianDpEvent(mechanism.count_stddev)])
    return dpa.SampledWithoutReplacementDpEvent(mechanism.population, mechanism.sample_size, gaussian)


def epsilon(segments: Sequence[tuple[RoundMechanism, int]], delta: float) -> float:
    """Epsilon at ``delta`` after rounds of ``segments`` (each a mechanism and its number of rounds, in order):
    dp-accounting's RDP accountant, replace-one, orders ``ORDERS``; ``inf`` without noise."""
    dpa = dp_accounting_module()
    from dp_accounting.rdp import RdpAccountant
    if any(rounds > 0 and mechanism.noise_multiplier == 0 for mechanism, rounds in segments):
        return math.inf  # no noise: no privacy (dp-accounting's sampled Gaussian divides by the noise)
    accountant = RdpAccountant(list(ORDERS), dpa.NeighboringRelation.REPLACE_ONE)
    for mechanism, rounds in segments:
        if rounds > 0:
            accountant.compose(round_event(mechanism), rounds)
    value = float(accountant.get_epsilon(delta))
    return value if math.isfinite(value) else math.inf


def rounds_within(mechanism: RoundMechanism, delta: float, max_epsilon: float, done: Sequence[tuple[RoundMechanism, int]],
                  limit: int) -> int:
    """How many more rounds of ``mechanism`` (at most ``limit``) keep epsilon at most ``max_epsilon`` after the
    rounds ``done``: a binary search over the round count (epsilon grows with it)."""
    low, high = 0, limit  # epsilon after ``low`` more rounds is within the budget
    if epsilon([*done, (mechanism, high)], delta) <= max_epsilon:
        return high
    while high - low > 1:
        middle = (low + high) // 2
        if epsilon([*done, (mechanism, middle)], delta) <= max_epsilon:
            low = middle
        else:
            high = middle
    return low
