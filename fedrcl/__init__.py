"""fedrcl: federated learning research on PyTorch Lightning (FedRCL and its baselines)."""
