"""Feature skew: a per-domain input shift, applied on the device to whole batches of images in [0, 1].

Each name is one shift; a feature-skew run lists some (``--data.feature_skew [rotation, gaussian_noise]``), each
listed shift is a domain, and each client belongs to one domain (``fedrcl.data.domains``). A shift has a severity 1-5;
its fixed parameters (a rotation's sign, a colour shift's offsets) are drawn once per domain from a generator seeded
by (data seed, domain), its per-pixel randomness (noise) from the batch's own generator, so a run is bitwise
reproducible and a resumed one draws what an unbroken one draws. The labels' split is not touched.

The CIFAR-10-C corruptions among them (Hendrycks & Dietterich, ICLR 2019, ``make_cifar_c.py``) use its
CIFAR severities; those that need external files (frost) or ImageMagick (motion blur, snow) are not here.
All functions take and return float ``[B, C, H, W]`` in [0, 1], whatever B, with no loop over samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["SEVERITIES", "FeatureShift", "make_shift", "rotate", "colour_shift", "gaussian_noise", "shot_noise",
           "impulse_noise", "speckle_noise", "gaussian_blur", "contrast", "brightness", "pixelate"]

# The parameter of each shift at severities 1..5 (CIFAR-10-C's for its corruptions).
SEVERITIES: dict[str, tuple[float, ...]] = {
    "none": (0, 0, 0, 0, 0),
    "rotation": (15, 30, 45, 60, 90),            # degrees, sign drawn per domain
    "colour_shift": (0.05, 0.1, 0.15, 0.2, 0.3),  # largest per-channel offset, offsets drawn per domain
    "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),  # std
    "shot_noise": (500, 250, 100, 75, 50),       # Poisson rate
    "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),  # fraction of values set to 0 or 1
    "speckle_noise": (0.06, 0.1, 0.12, 0.16, 0.2),  # std of the multiplicative noise
    "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1.0),  # sigma in pixels
    "contrast": (0.75, 0.5, 0.4, 0.3, 0.15),     # factor towards each image's channel mean
    "brightness": (0.05, 0.1, 0.15, 0.2, 0.3),   # added to HSV's value
    "pixelate": (0.95, 0.9, 0.85, 0.75, 0.65),   # side of the coarse image, a fraction of the side
}


def rotate(x: Tensor, degrees: float) -> Tensor:
    """Every image rotated by ``degrees`` about its centre (counter-clockwise, bilinear, black outside)."""
    b, c, h, w = x.shape
    a = math.radians(degrees)
    theta = torch.tensor([[math.cos(a), -math.sin(a) * h / w, 0.0], [math.sin(a) * w / h, math.cos(a), 0.0]],
                         dtype=x.dtype, device=x.device).expand(b, 2, 3)
    grid = F.affine_grid(theta, [b, c, h, w], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def colour_shift(x: Tensor, offset: Tensor) -> Tensor:
    """``clip(x + offset[c], 0, 1)`` per channel ``c``."""
    return (x + offset.to(x.dtype).view(1, -1, 1, 1)).clamp(0, 1)


def gaussian_noise(x: Tensor, std: float, generator: Optional[torch.Generator]) -> Tensor:
    """``clip(x + N(0, std^2), 0, 1)``, independent per value."""
    return (x + std * torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)).clamp(0, 1)


def shot_noise(x: Tensor, rate: float, generator: Optional[torch.Generator]) -> Tensor:
    """``clip(Poisson(x * rate) / rate, 0, 1)``."""
    return (torch.poisson(x * rate, generator=generator) / rate).clamp(0, 1)


def impulse_noise(x: Tensor, amount: float, generator: Optional[torch.Generator]) -> Tensor:
    """Salt and pepper: each value with probability ``amount`` becomes 0 or 1 (even odds)."""
    hit = torch.rand(x.shape, generator=generator, device=x.device) < amount
    salt = torch.rand(x.shape, generator=generator, device=x.device) < 0.5
    return torch.where(hit, salt.to(x.dtype), x)


def speckle_noise(x: Tensor, std: float, generator: Optional[torch.Generator]) -> Tensor:
    """``clip(x + x * N(0, std^2), 0, 1)``."""
    return (x + x * std * torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)).clamp(0, 1)


def gaussian_kernel(sigma: float, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> Tensor:
    """The normalised 1-D Gaussian of ``sigma`` over ``[-r, r]``, ``r = int(4 sigma + 0.5)`` (scikit-image's
    ``gaussian``, truncate 4)."""
    r = int(4.0 * sigma + 0.5)
    t = torch.arange(-r, r + 1, dtype=dtype, device=device)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    return k / k.sum()


def gaussian_blur(x: Tensor, sigma: float) -> Tensor:
    """Separable Gaussian blur of ``sigma`` pixels, edges repeated (scikit-image's ``mode='nearest'``)."""
    b, c, h, w = x.shape
    k = gaussian_kernel(sigma, x.dtype, x.device)
    r = (len(k) - 1) // 2
    y = F.pad(x.reshape(b * c, 1, h, w), (r, r, r, r), mode="replicate")
    y = F.conv2d(F.conv2d(y, k.view(1, 1, 1, -1)), k.view(1, 1, -1, 1))
    return y.reshape(b, c, h, w)


def contrast(x: Tensor, factor: float) -> Tensor:
    """``clip((x - m) * factor + m, 0, 1)`` with ``m`` each image's per-channel mean."""
    m = x.mean(dim=(2, 3), keepdim=True)
    return ((x - m) * factor + m).clamp(0, 1)


def brightness(x: Tensor, delta: float) -> Tensor:
    """HSV's value raised by ``delta`` (clipped to 1), hue and saturation kept: the pixel scaled by ``V' / V``
    (V the channels' maximum); a black pixel becomes grey ``V'``. One channel: ``clip(x + delta, 0, 1)``."""
    v = x.amax(dim=1, keepdim=True)
    v_new = (v + delta).clamp(0, 1)
    return torch.where(v > 0, x * (v_new / v.clamp_min(1e-12)), v_new.expand_as(x))


def pixelate(x: Tensor, fraction: float) -> Tensor:
    """Down to ``int(side * fraction)`` pixels by box averages, back up by nearest neighbour (PIL's BOX both ways
    up to its rounding at the box borders)."""
    h, w = x.shape[-2:]
    small = F.adaptive_avg_pool2d(x, (max(1, int(h * fraction)), max(1, int(w * fraction))))
    return F.interpolate(small, size=(h, w), mode="nearest")


@dataclass(frozen=True, eq=False)
class FeatureShift:
    """One domain's input shift: ``kind`` (a key of ``SEVERITIES``) at ``severity``, with its fixed parameters
    (``offset``: a colour shift's per-channel offsets; ``sign``: a rotation's direction)."""

    kind: str
    severity: int
    offset: Optional[Tensor] = None
    sign: float = 1.0

    def __call__(self, x: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        """The shifted batch (float ``[B, C, H, W]`` in [0, 1]); noise draws from ``generator``."""
        return _APPLY[self.kind](x, SEVERITIES[self.kind][self.severity - 1], self, generator)


# Each shift from (batch, severity's parameter, the domain's shift, the batch's generator).
_APPLY = {
    "none": lambda x, p, s, g: x,
    "rotation": lambda x, p, s, g: rotate(x, s.sign * p),
    "colour_shift": lambda x, p, s, g: colour_shift(x, s.offset),
    "gaussian_noise": lambda x, p, s, g: gaussian_noise(x, p, g),
    "shot_noise": lambda x, p, s, g: shot_noise(x, p, g),
    "impulse_noise": lambda x, p, s, g: impulse_noise(x, p, g),
    "speckle_noise": lambda x, p, s, g: speckle_noise(x, p, g),
    "gaussian_blur": lambda x, p, s, g: gaussian_blur(x, p),
    "contrast": lambda x, p, s, g: contrast(x, p),
    "brightness": lambda x, p, s, g: brightness(x, p),
    "pixelate": lambda x, p, s, g: pixelate(x, p),
}


def make_shift(kind: str, severity: int, channels: int, seed: int, domain: int,
               device: torch.device | str = "cpu") -> FeatureShift:
    """Domain ``domain``'s shift of ``kind`` at ``severity``, its fixed parameters drawn from a generator seeded
    by ``(seed, domain)``."""
    if kind not in SEVERITIES:
        raise ValueError(f"data.feature_skew: unknown shift {kind!r}; allowed: {', '.join(SEVERITIES)}")
    if not 1 <= severity <= 5:
        raise ValueError(f"data.feature_skew_severity must be in 1..5, got {severity}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + domain)
    sign = 1.0 if torch.rand(1, generator=gen).item() < 0.5 else -1.0
    offset = None
    if kind == "colour_shift":
        bound = SEVERITIES[kind][severity - 1]
        offset = ((torch.rand(channels, generator=gen) * 2 - 1) * bound).to(device)
    return FeatureShift(kind, severity, offset, sign)
