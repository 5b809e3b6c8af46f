"""Matplotlib figures of runs and partitions (matplotlib is imported on first use: a ``dev`` extra).

Each function draws into ``ax`` (or a new figure) and returns the figure; none computes a metric: curves
come from ``runs.load_scalars``, per-client class counts from ``partitions.partition_counts``, means and
bands over seeds from ``seed_stats``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Optional

import numpy as np

from fedrcl.analysis.runs import Curve
from fedrcl.analysis.seed_stats import align, mean_band

__all__ = ["plot_partition", "plot_runs", "plot_levels", "plot_seed_groups", "LEVEL_METRICS"]

LEVEL_METRICS = ("effective_rank", "vci", "within_trace", "between_trace")
"""The per-level curves of ``RepresentationMonitor``: ``repr/level{l}/<metric>``."""


def _axes(ax: Any, figsize: tuple[float, float]) -> tuple[Any, Any]:
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=figsize, layout="constrained")
        return fig, ax
    return ax.figure, ax


def distinct_colours(n: int) -> np.ndarray:
    """``n`` RGBA colours, no two alike up to 20 (tab10, then tab20), then spread over turbo: matplotlib's own
    cycle repeats after 10, so an 11th curve took the first one's colour."""
    import matplotlib as mpl

    cmap = mpl.colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "turbo"]
    return cmap(np.linspace(0, 1, n)) if n > 20 else cmap(np.arange(n))


def plot_partition(counts: np.ndarray, ax: Any = None, scale: Literal["dataset", "client"] = "dataset",
                   title: Optional[str] = None) -> Any:
    """The clients' label distributions as stacked bars (the supplement's figure).

    One bar per client, clients sorted by size (largest first); each bar stacks the client's classes
    in class order, coloured by class.

    Args:
        counts: ``[num_clients, num_classes]`` samples of each class at each client
            (``fedrcl.data.partition.label_counts``).
        ax: axes to draw into; a new figure when None.
        scale: ``dataset``: a segment's height is its share of the whole (split) data set, as in the
            supplement, so bar heights show client sizes; ``client``: its share of the client's data (every
            bar sums to 1).
        title: the axes' title.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 2 or counts.size == 0:
        raise ValueError(f"counts must be a non-empty [num_clients, num_classes] array, got {counts.shape}")
    if scale not in ("dataset", "client"):
        raise ValueError(f"scale must be 'dataset' or 'client', got {scale!r}")
    num_clients, num_classes = counts.shape
    sizes = counts.sum(1)
    order = np.argsort(-sizes, kind="stable")
    denom = counts.sum() if scale == "dataset" else np.maximum(sizes, 1)[order, None]
    shares = counts[order] / denom
    fig, ax = _axes(ax, (8, 3))
    colours = distinct_colours(num_classes)
    x, bottom = np.arange(num_clients), np.zeros(num_clients)
    for c in range(num_classes):
        ax.bar(x, shares[:, c], bottom=bottom, width=1.0, color=colours[c], linewidth=0,
               label=str(c) if num_classes <= 20 else None)
        bottom += shares[:, c]
    ax.set_xlim(-0.5, num_clients - 0.5)
    ax.xaxis.get_major_locator().set_params(integer=True)  # clients are whole numbers
    ax.set_xlabel("client (sorted by size)")
    ax.set_ylabel("share of the data set" if scale == "dataset" else "share of the client's data")
    if num_classes <= 20:
        ax.legend(title="class", fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(title)
    return fig


def plot_runs(runs: Mapping[str, Mapping[str, Curve]], tag: str, ax: Any = None,
              ylabel: Optional[str] = None) -> Any:
    """One curve per run of the scalar ``tag`` against the round; runs without it are skipped.

    Args:
        runs: ``{run name: load_scalars(run)}``.
        tag: e.g. ``val/acc``, ``val/acc_ema``, ``repr/deviation_below_1``.
        ax: axes to draw into; a new figure when None.
        ylabel: the y label (default: the tag).
    """
    fig, ax = _axes(ax, (5, 3.5))
    for name, curves in runs.items():
        if tag in curves:
            ax.plot(*curves[tag], label=name)
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel or tag)
    if ax.lines:
        ax.legend(fontsize="small")
    return fig


def plot_levels(runs: Mapping[str, Mapping[str, Curve]], metric: str, local: bool = False,
                levels: Optional[Sequence[int]] = None) -> Any:
    """A row of panels, one per feature level, of ``repr/level{l}/<metric>``, one curve per run.

    Args:
        runs: ``{run name: load_scalars(run)}``.
        metric: one of ``LEVEL_METRICS``.
        local: the round's last local model (``repr/local/...``) instead of the global model.
        levels: the levels to draw; default every level some run logged.
    """
    import matplotlib.pyplot as plt

    if metric not in LEVEL_METRICS:
        raise ValueError(f"metric must be one of {', '.join(LEVEL_METRICS)}, got {metric!r}")
    prefix = "repr/local/level" if local else "repr/level"
    if levels is None:
        levels = sorted({int(tag[len(prefix):].split("/")[0]) for curves in runs.values() for tag in curves
                         if tag.startswith(prefix) and tag.endswith("/" + metric)})
    if not levels:
        raise ValueError(f"no run logged {prefix}*/{metric}: add fedrcl.analysis.RepresentationMonitor to "
                         "trainer.callbacks")
    fig, axes = plt.subplots(1, len(levels), figsize=(3.2 * len(levels), 3), squeeze=False,
                             layout="constrained")
    for i, (ax, level) in enumerate(zip(axes[0], levels)):
        plot_runs(runs, f"{prefix}{level}/{metric}", ax=ax, ylabel=metric if i == 0 else None)
        ax.set_title(f"level {level}" + (" (local)" if local else ""))
        if i > 0:
            ax.set_ylabel("")
            if ax.get_legend() is not None:
                ax.get_legend().remove()
    return fig


TAG_LABELS = {"test/acc": "test accuracy (%)", "test/acc_ema": "EMA(0.9) test accuracy (%)",
              "val/acc": "val/acc (%)", "val/acc_ema": "val/acc_ema (%)"}
"""The y label of a panel per tag (others are labelled by their tag): ``test/acc*`` is every run's test accuracy
(``fedrcl.analysis.tags.with_test_tags``); ``val/acc*`` as logged, the test accuracy of a run without a validation
split, the validation accuracy of a run with one."""


def plot_seed_groups(groups: Mapping[str, Sequence[Mapping[str, Curve]]],
                     tags: Sequence[str] = ("val/acc", "val/acc_ema"), band: str = "ci") -> Any:
    """One panel per tag; per group the mean curve over its runs (seeds) with a shaded band.

    Each group's runs are aligned on the rounds all of them logged (``seed_stats.align``); the band is the 95%
    Student-t interval of the mean (``band="ci"``) or one sample std (``"std"``, ``seed_stats.mean_band``),
    drawn where a group has two runs or more. Accuracies (a tag ending in ``acc...``) are drawn in %, their band
    cut to [0, 100] (with two seeds the t interval is 12.7 std / sqrt(2) wide and leaves the possible range).

    Args:
        groups: ``{label: [load_scalars(run) for each seed]}``; a label's runs without a tag are an error.
        tags: the scalars to draw, one panel each.
        band: ``"ci"`` or ``"std"``.
    """
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tags), figsize=(5.5 * len(tags), 4), squeeze=False, layout="constrained")
    seeded = any(len(runs) > 1 for runs in groups.values())
    colours = distinct_colours(len(groups))
    for ax, tag in zip(axes[0], tags):
        scale = 100.0 if tag.rsplit("/", 1)[-1].startswith("acc") else 1.0
        for index, (label, runs) in enumerate(groups.items()):
            missing = [i for i, scalars in enumerate(runs) if tag not in scalars]
            if missing:
                raise ValueError(f"{label}: {len(missing)} of its {len(runs)} runs logged no {tag!r}")
            rounds, values = align([scalars[tag] for scalars in runs])
            with np.errstate(invalid="ignore"):  # a NaN or infinite point leaves a gap (fedrcl plot notes it)
                mean, half = mean_band(scale * values, band)
            line, = ax.plot(rounds, mean, lw=1.3, label=f"{label} (n={len(runs)})", color=colours[index])
            if len(runs) > 1:
                low, high = mean - half, mean + half
                if scale == 100.0:
                    low, high = np.clip(low, 0.0, 100.0), np.clip(high, 0.0, 100.0)
                ax.fill_between(rounds, low, high, color=line.get_color(), alpha=0.2, lw=0)
        ax.set_xlabel("round")
        ax.set_ylabel(TAG_LABELS.get(tag, tag))
        ax.grid(alpha=0.3)
        title = ("band: 95% interval of the mean over seeds" if band == "ci" else "band: ± 1 std over seeds") \
            if seeded else None
        ax.legend(title=title, fontsize="small", title_fontsize="small")
    return fig
