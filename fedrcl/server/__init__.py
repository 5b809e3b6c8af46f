"""Server optimizers: how the clients' average becomes the next global model."""
from fedrcl.server.base import FedAvg, ServerOptimizer

__all__ = ["FedAvg", "ServerOptimizer"]
