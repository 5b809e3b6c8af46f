"""Model weights moved in place: the global model into the one client model, and copies of it."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


def load_state_(module: torch.nn.Module, state: Mapping[str, Tensor]) -> None:
    """Copy ``state`` into ``module``'s parameters and buffers in place (no new tensors, no new module). A
    tensor of another shape is refused, named: ``copy_`` would broadcast it silently."""
    with torch.no_grad():
        for key, tensor in module.state_dict().items():
            if state[key].shape != tensor.shape:
                raise ValueError(f"weights {key!r}: shape {tuple(state[key].shape)} does not fit the model's "
                                 f"{tuple(tensor.shape)}")
            tensor.copy_(state[key])


def snapshot(module: torch.nn.Module) -> dict[str, Tensor]:
    """A detached copy of ``module``'s state on its device."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
