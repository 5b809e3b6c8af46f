"""The round's global model as a frozen teacher (FedNTD, FitNet, FedMLB), built once per run."""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Optional

import torch
from torch import Tensor, nn

from fedrcl.contract.weights import load_state_
from fedrcl.models.output import ModelOutput


class FrozenGlobalModel:
    """One frozen copy of the backbone that holds the weights the server broadcast this round.

    A plain object, not an ``nn.Module``: stored on a LightningModule it is not registered as a submodule,
    so it stays out of ``state_dict()``, checkpoints, ``parameters()`` (hence the optimizer) and the model
    summary. The copy is made on the first ``load_`` (a ``deepcopy`` of the backbone, eval mode,
    ``requires_grad=False``) and afterwards only overwritten in place, so a run builds one teacher however
    many clients and rounds it has. ``load_`` also moves it to the backbone's device if that changed.
    """

    def __init__(self) -> None:
        self.module: Optional[nn.Module] = None

    def load_(self, backbone: nn.Module, global_state: Mapping[str, Tensor]) -> None:
        """Copy ``global_state`` (a state dict of ``backbone``) into the teacher, building it on first use."""
        if self.module is None:
            self.module = copy.deepcopy(backbone).requires_grad_(False).eval()
            self.module.zero_grad(set_to_none=True)  # no copied gradients
        device = next(backbone.parameters()).device
        if next(self.module.parameters()).device != device:
            self.module.to(device)
        load_state_(self.module, global_state)

    @torch.no_grad()
    def __call__(self, x: Tensor) -> ModelOutput:
        if self.module is None:
            raise RuntimeError("FrozenGlobalModel used before load_ (call it from on_client_start)")
        return self.module(x)
