"""The federation: rounds, client sampling, weight swapping, aggregation."""
from fedrcl.federated.context import ClientContext
from fedrcl.federated.trainer import FederatedTrainer

__all__ = ["ClientContext", "FederatedTrainer"]
