"""The federation: rounds, client sampling, weight swapping, aggregation.

``ClientContext`` is light; ``FederatedTrainer`` (Lightning) is imported on first use, so that code which
only needs the round's facts (algorithms, tools that read runs) does not load the Trainer.
"""
from typing import Any

from fedrcl.contract.context import ClientContext

__all__ = ["ClientContext", "FederatedTrainer"]


def __getattr__(name: str) -> Any:
    if name == "FederatedTrainer":
        from fedrcl.federated.trainer import FederatedTrainer
        return FederatedTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
