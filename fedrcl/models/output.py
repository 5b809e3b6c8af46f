"""The output contract shared by every backbone in :mod:`fedrcl.models`."""

from typing import NamedTuple

from torch import Tensor


class ModelOutput(NamedTuple):
    """What a backbone's ``forward`` returns: logits plus per-level features from the same pass.

    Attributes:
        logits: Class scores, shape ``[B, num_classes]``.
        features: One tensor of shape ``[B, C_l]`` per level, in order from input to output.
            Each is the global average pool of that level's activation taken *before* the
            level's final ReLU. ``C_l`` matches the backbone's ``feature_dims[l]``.
    """

    logits: Tensor
    features: list[Tensor]
