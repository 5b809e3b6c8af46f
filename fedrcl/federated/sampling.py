"""Client sampling: which clients take part in a round."""
from __future__ import annotations

import numpy as np


def sample_clients(num_clients: int, clients_per_round: int, seed: int, round_idx: int) -> list[int]:
    """Draw ``clients_per_round`` distinct clients uniformly, from a generator seeded by (seed, round).

    The draw depends only on its arguments, never on the method or on earlier rounds, so two methods run
    with the same seed train the same clients in every round, and a resumed run draws what the
    uninterrupted run drew.
    """
    if not 1 <= clients_per_round <= num_clients:
        raise ValueError(f"clients_per_round must be in [1, num_clients={num_clients}], got {clients_per_round}")
    rng = np.random.default_rng([seed, round_idx])
    return rng.choice(num_clients, size=clients_per_round, replace=False).tolist()
