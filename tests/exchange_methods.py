"""Methods with a broken exchange, for tests/test_exchange.py and tests/test_flower.py (importable by path)."""
from __future__ import annotations

import torch

from fedrcl.algorithms import FedAvg


class HalfPair(FedAvg):
    """Uploads label counts with no ``receive_upload``: what it sends would reach nothing."""

    def extra_upload(self, client):
        return {"n": torch.tensor(client.num_samples)}


class MisspeltHook(FedAvg):
    """``extra_uplaod``: a hook's name, misspelt; it would never be called."""

    def extra_uplaod(self, client):
        return {"n": torch.tensor(client.num_samples)}
