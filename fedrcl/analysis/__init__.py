"""Representation analysis: the paper's metrics, a monitoring callback, run and partition pictures.

- ``metrics``: ``effective_rank``, ``class_covariances``, ``variability_collapse_index``,
  ``deviation_bound`` (pure functions, float64 inside).
- ``monitor``: ``RepresentationMonitor``, a Lightning callback logging them to TensorBoard every N rounds.
- ``runs``: ``find_runs``, ``load_scalars`` read runs back from their TensorBoard logs.
- ``client_evaluation``: ``ClientEvaluation``, a callback measuring the global model on every client's label
  mix and the round's local models (``label_mix_accuracy``, ``spread_summary``: pure functions).
- ``compare``: ``crossing``: the rounds where one method's curve passes another's (the paper's headline).
- ``seed_stats``: ``summarize_seeds``, ``t_quantile``, ``seed_curves``: mean, std and 95% interval over seeds.
- ``clients``: ``partition_counts``; ``python -m fedrcl.analysis.partitions`` writes a partition PNG.
- ``plots``: ``plot_partition``, ``plot_runs``, ``plot_levels`` (matplotlib, imported on first use).
"""
from fedrcl.analysis.client_evaluation import ClientEvaluation, label_mix_accuracy, spread_summary
from fedrcl.analysis.clients import partition_counts
from fedrcl.analysis.compare import Crossing, crossing
from fedrcl.analysis.metrics import (
    class_covariances,
    deviation_bound,
    effective_rank,
    variability_collapse_index,
)
from fedrcl.analysis.monitor import RepresentationMonitor
from fedrcl.analysis.plots import LEVEL_METRICS, plot_levels, plot_partition, plot_runs
from fedrcl.analysis.runs import find_runs, load_scalars
from fedrcl.analysis.seed_stats import SeedSummary, seed_curves, summarize_seeds, t_quantile

__all__ = [
    "ClientEvaluation",
    "Crossing",
    "LEVEL_METRICS",
    "RepresentationMonitor",
    "SeedSummary",
    "class_covariances",
    "crossing",
    "deviation_bound",
    "effective_rank",
    "find_runs",
    "label_mix_accuracy",
    "load_scalars",
    "partition_counts",
    "plot_levels",
    "plot_partition",
    "plot_runs",
    "seed_curves",
    "spread_summary",
    "summarize_seeds",
    "t_quantile",
    "variability_collapse_index",
]
