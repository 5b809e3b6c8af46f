"""Augmentation of whole uint8 image batches on the device that trains on them.

Data sets are held as uint8 NHWC tensors (see :mod:`fedrcl.data.datasets`);
these functions turn a batch of them into normalised float32 NCHW input,
optionally with the usual random rotation / padded crop / horizontal flip,
without a Python loop over samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fedrcl.data.datasets import DatasetInfo

__all__ = ["augment_batch", "to_normalized", "to_unit_float", "normalize"]


def _check(images: Tensor, info: DatasetInfo) -> None:
    if images.dtype != torch.uint8 or images.ndim != 4:
        raise ValueError(
            f"images must be a uint8 tensor [B, H, W, C], got {images.dtype} of shape {tuple(images.shape)}"
        )
    if images.shape[-1] != info.in_channels:
        raise ValueError(
            f"images have {images.shape[-1]} channels (last dim), expected {info.in_channels} "
            f"for {info.name!r}"
        )


def to_unit_float(images: Tensor) -> Tensor:
    """uint8 ``[B, H, W, C]`` -> float32 ``[B, C, H, W]`` in [0, 1] (contiguous)."""
    return images.permute(0, 3, 1, 2).to(torch.float32).div(255.0).contiguous()


def normalize(x: Tensor, info: DatasetInfo) -> Tensor:
    """Per-channel ``(x - mean) / std`` of a float ``[B, C, H, W]`` batch."""
    mean = torch.tensor(info.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    std = torch.tensor(info.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - mean) / std


def to_normalized(images: Tensor, info: DatasetInfo) -> Tensor:
    """Evaluation path: uint8 ``[B, H, W, C]`` -> normalised float32 ``[B, C, H, W]``."""
    _check(images, info)
    return normalize(to_unit_float(images), info)


def _random_theta(
    batch: int, height: int, width: int, generator: torch.Generator, info: DatasetInfo, device: torch.device
) -> Tensor:
    """Per-sample 2x3 sampling matrices for :func:`F.affine_grid` (``[B, 2, 3]``).

    An output location ``u`` (normalised coordinates) samples the input at
    ``R(angle) @ (flip * u + t)``: undo the flip, undo the crop shift, undo the
    rotation, i.e. the rotation is applied first to the image, then the crop,
    then the flip.  All random numbers are drawn as one tensor each.
    """
    angle = (torch.rand(batch, generator=generator, device=device) * 2.0 - 1.0) * (float(info.rotation) * math.pi / 180.0)
    p = int(info.crop_padding)
    shift = torch.randint(-p, p + 1, (batch, 2), generator=generator, device=device).to(torch.float32)  # (dx, dy) pixels
    if info.hflip:
        flip = torch.where(torch.rand(batch, generator=generator, device=device) < 0.5, -1.0, 1.0)
    else:
        flip = torch.ones(batch, device=device)

    # An integer shift of k pixels is 2k/W in normalised coordinates
    # (align_corners=False); output[i] = input[i + k].
    t = torch.stack([shift[:, 0] * (2.0 / width), shift[:, 1] * (2.0 / height)], dim=1)
    cos, sin = torch.cos(angle), torch.sin(angle)
    # Rotation in pixel space expressed in normalised coordinates
    # (S^-1 R S with S = diag(W/2, H/2)); equal to R for square images.
    m = torch.stack(
        [
            torch.stack([cos, -sin * (height / width)], dim=1),
            torch.stack([sin * (width / height), cos], dim=1),
        ],
        dim=1,
    )  # [B, 2, 2]
    # M @ diag(flip, 1): scale the first column of M by the flip sign.
    linear = m * torch.stack([flip, torch.ones_like(flip)], dim=1).unsqueeze(1)
    offset = torch.bmm(m, t.unsqueeze(-1))  # M @ t, [B, 2, 1]
    return torch.cat([linear, offset], dim=2)


Shift = Callable[[Tensor, Optional[torch.Generator]], Tensor]


def augment_batch(images: Tensor, generator: Optional[torch.Generator], info: DatasetInfo, train: bool,
                  shift: Optional[Shift] = None) -> Tensor:
    """uint8 ``[B, H, W, C]`` -> normalised float32 ``[B, C, H, W]``, augmented if ``train``.

    With ``train=True`` every sample gets its own random rotation, uniform in
    ``[-info.rotation, info.rotation]`` degrees, a random crop after zero
    padding by ``info.crop_padding`` (an integer translation uniform in
    ``[-p, p]`` along each axis, zero fill) and, if ``info.hflip``, a
    horizontal flip with probability 0.5.  The three are composed into ONE
    affine warp per sample and the whole batch is resampled by a single
    :func:`F.affine_grid` + :func:`F.grid_sample` call (bilinear, zero
    padding, ``align_corners=False``); the random numbers are drawn from
    ``generator``, which must live on the same device as ``images``, as one
    tensor per quantity per batch.  Normalisation with ``info.mean`` /
    ``info.std`` comes after the warp, so filled pixels are black (0) as with
    torchvision's padding.

    Composing the three into one warp differs from the sequential torchvision
    transforms (RandomRotation -> RandomCrop(padding) -> RandomHorizontalFlip)
    only at the zero-filled borders: the single warp can bring in image content
    near the frame edge that the sequential version would already have cut off
    after the rotation, and bilinear interpolation there blends with zeros
    slightly differently.  (Also, torchvision's RandomRotation interpolates with
    nearest neighbour by default; this uses bilinear everywhere.)  Integer
    shifts and flips alone reproduce the shifted / flipped image up to float
    rounding.

    With ``train=False`` this is :func:`to_normalized`. A ``shift`` (feature skew,
    ``fedrcl.data.feature_skew.FeatureShift``) maps the batch in [0, 1] after the
    warp and before normalisation, drawing from ``generator`` after the warp's draws.
    """
    _check(images, info)
    if not train:
        return to_normalized(images, info) if shift is None else normalize(shift(to_unit_float(images), generator),
                                                                           info)
    if generator is None:
        raise ValueError("augmenting (train=True) needs a generator on the images' device")
    if generator.device.type != images.device.type:
        raise ValueError(
            f"generator lives on {generator.device} but images on {images.device}; "
            "create the generator on the images' device"
        )
    x = to_unit_float(images)
    b, _, h, w = x.shape
    theta = _random_theta(b, h, w, generator, info, x.device)
    grid = F.affine_grid(theta, [b, x.shape[1], h, w], align_corners=False)
    x = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return normalize(x if shift is None else shift(x, generator), info)
