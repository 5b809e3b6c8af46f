"""Client algorithms: one LightningModule each, differing from FedAvg only in their hooks."""
from fedrcl.algorithms.fedavg import FedAvg
from fedrcl.algorithms.fedrcl import FedRCL, FedSCL

__all__ = ["FedAvg", "FedRCL", "FedSCL"]
