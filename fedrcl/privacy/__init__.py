"""Differential privacy for federated runs (``trainer.privacy``): user-level DP-FedAvg with per-client clipping,
seeded Gaussian noise, adaptive clipping and an accountant (``dp-accounting``, the extra ``fedrcl[dp]``)."""
from fedrcl.privacy.dp_fedavg import DPFedAvg

__all__ = ["DPFedAvg"]
