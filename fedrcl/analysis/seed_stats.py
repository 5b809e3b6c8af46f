"""Statistics over seeds: mean, sample std, n and a 95% Student-t interval, for numbers and for curves; two
methods' runs paired by seed.

The runs of one experiment under several seeds (``fedrcl seeds``) differ only in client sampling, batches,
augmentation and initialisation; their spread is the noise any comparison between methods must beat.
The 95% interval is ``mean +- t_{0.975, n-1} * std / sqrt(n)`` with the sample std (ddof 1); the t
quantiles are a table for 1-30 degrees of freedom and a Cornish-Fisher expansion beyond (error < 1e-5), so
scipy is not needed. Two methods run under the same seeds (the same split, client sampling and batches) are
compared seed by seed (``paired_differences``): the per-seed differences are then summarized like any number.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from fedrcl.analysis.runs import Curve, load_scalars

__all__ = ["SeedSummary", "align", "mean_band", "paired_differences", "seed_curves", "summarize_seeds", "t_quantile",
           "value_at"]

# t_{0.975, df} for df = 1..30.
_T975 = (12.706204736, 4.302652730, 3.182446305, 2.776445105, 2.570581836, 2.446911851, 2.364624252,
         2.306004135, 2.262157163, 2.228138852, 2.200985160, 2.178812830, 2.160368656, 2.144786688,
         2.131449546, 2.119905299, 2.109815578, 2.100922040, 2.093024054, 2.085963447, 2.079613845,
         2.073873068, 2.068657610, 2.063898562, 2.059538553, 2.055529439, 2.051830516, 2.048407142,
         2.045229642, 2.042272456)
_Z975 = 1.959963984540054


def t_quantile(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` >= 1 degrees of freedom (two-sided 95%)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


@dataclass(frozen=True)
class SeedSummary:
    """``mean``, sample ``std``, ``n`` and the 95% interval half-width ``ci95`` (both NaN for n = 1)."""

    mean: float
    std: float
    n: int
    ci95: float

    def format(self, scale: float = 1.0, digits: int = 2) -> str:
        """``"mean ± std"`` (``"mean"`` for one seed), each times ``scale``."""
        if self.n < 2:
            return f"{scale * self.mean:.{digits}f}"
        return f"{scale * self.mean:.{digits}f} ± {scale * self.std:.{digits}f}"

    def interval(self, scale: float = 1.0, digits: int = 2) -> str:
        """``"[low, high]"``, the 95% interval of the mean times ``scale`` (``""`` for one seed)."""
        if self.n < 2:
            return ""
        low, high = scale * (self.mean - self.ci95), scale * (self.mean + self.ci95)
        return f"[{low:.{digits}f}, {high:.{digits}f}]"


def summarize_seeds(values: Sequence[float] | np.ndarray) -> SeedSummary:
    """Mean, sample std (ddof 1), n and 95% t-interval half-width of one number measured under seeds."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError(f"summarize_seeds needs a non-empty 1-d sequence, got shape {x.shape}")
    n = len(x)
    if n == 1:
        return SeedSummary(float(x[0]), math.nan, 1, math.nan)
    std = float(x.std(ddof=1))
    return SeedSummary(float(x.mean()), std, n, t_quantile(n - 1) * std / math.sqrt(n))


def align(curves: Sequence[Curve]) -> tuple[np.ndarray, np.ndarray]:
    """``(rounds, values[n_curves, n_rounds])``: the curves at the rounds every one of them logged."""
    if not curves:
        raise ValueError("align needs at least one curve")
    common = curves[0][0]
    for rounds, _ in curves[1:]:
        common = np.intersect1d(common, rounds)
    return common, np.stack([vals[np.searchsorted(rounds, common)] for rounds, vals in curves])


def value_at(curve: Curve, round_idx: int) -> Optional[float]:
    """The value ``curve`` logged at ``round_idx``, or None where it logged none there (not reached, or not
    evaluated that round): runs are compared at the same round, never at a nearby one."""
    rounds, values = curve
    hit = np.flatnonzero(np.asarray(rounds) == round_idx)
    return float(np.asarray(values)[hit[0]]) if len(hit) else None


def paired_differences(pairs: Mapping[Any, tuple[Curve, Curve]], round_idx: int) -> dict[Any, float]:
    """``{seeds: challenger - reference}`` at ``round_idx``, from ``{seeds: (reference, challenger)}``, for the
    pairs where both curves logged that round (in the order of ``pairs``). The two runs of a pair shared the
    seeds' split, client sampling and batches: their difference leaves out what the seeds change in both alike."""
    out = {}
    for seeds, (reference, challenger) in pairs.items():
        ref, ch = value_at(reference, round_idx), value_at(challenger, round_idx)
        if ref is not None and ch is not None:
            out[seeds] = ch - ref
    return out


def mean_band(values: np.ndarray, band: str = "ci") -> tuple[np.ndarray, np.ndarray]:
    """``(mean, half-width)`` per round of ``values[n_seeds, n_rounds]``: the half-width is the 95% Student-t
    interval of the mean (``band="ci"``) or one sample std (``"std"``); zero for one seed."""
    if band not in ("ci", "std"):
        raise ValueError(f"band must be 'ci' or 'std', got {band!r}")
    values = np.asarray(values, dtype=np.float64)
    mean, n = values.mean(axis=0), values.shape[0]
    if n < 2:
        return mean, np.zeros_like(mean)
    std = values.std(axis=0, ddof=1)
    return mean, std if band == "std" else t_quantile(n - 1) * std / math.sqrt(n)


def seed_curves(runs: Sequence[str | Path], tag: str) -> tuple[np.ndarray, np.ndarray]:
    """``(rounds, values[n_runs, n_rounds])`` of ``tag`` at the rounds every run logged (ascending)."""
    curves: list[Curve] = []
    for run in runs:
        scalars = load_scalars(run)
        if tag not in scalars:
            raise ValueError(f"run {run} has no scalar {tag!r}")
        curves.append(scalars[tag])
    return align(curves)

