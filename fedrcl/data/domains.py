"""Domain skew: clients drawn per domain, and the global model's accuracy per domain.

A domain is a camera, a style, a hospital (``DIR/<domain>/<class>/*``, PACS's layout) or a feature-skew shift
(``fedrcl.data.feature_skew``). ``assign_domains`` gives each client one domain (balanced, seeded);
``domain_partition`` splits each domain's samples among its clients with the run's label partition, or draws every
client's mix of domains from a Dirichlet. ``DomainAccuracy`` counts correct test predictions per domain, logged as
``val/acc/<domain>`` beside the union's ``val/acc``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from fedrcl.data.partition import dirichlet_partition

__all__ = ["assign_domains", "domain_partition", "DomainAccuracy", "domain_accuracy_of"]


def assign_domains(num_clients: int, num_domains: int, seed: int) -> np.ndarray:
    """Each client's domain: ``num_clients // num_domains`` clients per domain (the first ``num_clients %
    num_domains`` domains one more), which clients a seeded permutation decides."""
    if num_clients < num_domains:
        raise ValueError(f"data.num_clients {num_clients} is below the {num_domains} domains; each domain needs "
                         f"a client")
    order = np.random.default_rng(seed).permutation(num_clients)
    domain = np.empty(num_clients, dtype=np.int64)
    domain[order] = np.arange(num_clients) % num_domains
    return domain


def domain_partition(labels: np.ndarray, domains: np.ndarray, num_domains: int, num_clients: int, seed: int,
                     label_split: Callable[[np.ndarray, int, int], list[np.ndarray]], mode: str = "one",
                     alpha: float = 1.0) -> tuple[list[np.ndarray], np.ndarray]:
    """Sample indices per client and each client's (main) domain.

    ``one``: each client one domain (``assign_domains``); a domain's samples are split among its clients by
    ``label_split(domain_labels, clients, seed)`` (the run's label partition), seeded by ``(seed, domain)``.
    ``dirichlet``: fedrcl's balanced Dirichlet over domain ids (equal client sizes, each client's mix of domains
    ``~ Dir(alpha)``); a client's domain is its most frequent one.
    """
    if mode == "dirichlet":
        parts = dirichlet_partition(domains, num_clients, alpha, seed=seed, balanced=True)
        main = np.asarray([np.bincount(domains[p], minlength=num_domains).argmax() for p in parts], dtype=np.int64)
        return parts, main
    client_domain = assign_domains(num_clients, num_domains, seed)
    split: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_clients
    for d in range(num_domains):
        members = np.flatnonzero(domains == d)
        clients = np.flatnonzero(client_domain == d)
        domain_seed = int(np.random.SeedSequence([seed, d]).generate_state(1)[0])
        for k, local in zip(clients, label_split(labels[members], len(clients), domain_seed)):
            split[k] = np.sort(members[local])
    return split, client_domain


class DomainAccuracy:
    """Correct top-1 predictions and samples per domain over one evaluation, on the evaluating device.

    ``batch_domain(batch_idx)`` names the domain of each test batch (batches never cross domains); ``compute``
    sums over processes (``strategy.reduce``) and returns ``{"val/acc/<domain>": accuracy}``.
    """

    def __init__(self, names: Sequence[str], batch_domain: Callable[[int], int]):
        self.names, self.batch_domain = list(names), batch_domain
        self.correct: Tensor = torch.zeros(len(self.names), dtype=torch.long)
        self.total: Tensor = torch.zeros(len(self.names), dtype=torch.long)

    def update(self, logits: Tensor, labels: Tensor, batch_idx: int) -> None:
        if self.correct.device != logits.device:
            self.correct, self.total = self.correct.to(logits.device), self.total.to(logits.device)
        d = self.batch_domain(batch_idx)
        self.correct[d] += (logits.argmax(dim=1) == labels).sum()
        self.total[d] += len(labels)

    def compute(self, strategy: Any = None, prefix: str = "val/acc/") -> dict[str, float]:
        """Each evaluated domain's accuracy (domains with no test sample left out); resets the counts."""
        correct, total = self.correct, self.total
        if strategy is not None:
            correct, total = strategy.reduce(correct, reduce_op="sum"), strategy.reduce(total, reduce_op="sum")
        correct_list, total_list = correct.tolist(), total.tolist()
        self.correct, self.total = torch.zeros_like(self.correct), torch.zeros_like(self.total)
        return {f"{prefix}{name}": c / t for name, c, t in zip(self.names, correct_list, total_list) if t}


def domain_accuracy_of(trainer: Any) -> Optional[DomainAccuracy]:
    """The per-domain counts of the data ``trainer`` evaluates (``FederatedDataModule.domain_accuracy``); None
    for data without domains."""
    return getattr(getattr(trainer, "datamodule", None), "domain_accuracy", None)
