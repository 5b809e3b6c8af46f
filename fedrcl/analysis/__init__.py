"""Representation analysis: the paper's metrics, a monitoring callback, run and partition pictures.

- ``metrics``: ``effective_rank``, ``class_covariances``, ``variability_collapse_index``,
  ``deviation_bound`` (pure functions, float64 inside).
- ``monitor``: ``RepresentationMonitor``, a Lightning callback logging them to TensorBoard every N rounds.
- ``runs``: ``load_scalars``, ``read_scalars`` read a run's curves back from its TensorBoard or CSV logs (and
  name a log that cannot be read whole).
- ``catalogue``: ``find_runs``, ``collect_runs``, ``named_runs``, ``RunResult``: which folders are runs, which
  versions make one run, its setting, backend and curves: the one idea of a run of ``fedrcl report``,
  ``fedrcl plot`` and the notebooks. ``settings``: ``run_setting``, ``experiment_key``, ``method_key`` from a saved config.
- ``grouping``: ``seed_groups``, ``comparisons``, ``pair_by_seed``: runs as seeds of one experiment, methods
  paired by seed.
- ``client_evaluation``: ``ClientEvaluation``, a callback measuring the global model on every client's label
  mix and the round's local models (``label_mix_accuracy``, ``spread_summary``: pure functions).
- ``compare``: ``crossing``: the rounds where one method's curve passes another's (the paper's headline).
- ``seed_stats``: ``summarize_seeds``, ``t_quantile``, ``seed_curves``, ``align``, ``mean_band``: mean, std
  and 95% interval over seeds; ``value_at``, ``paired_differences``: two methods' runs compared seed by seed.
- ``tags``: ``tag_of_test``, ``validation_curve``, ``with_test_tags``: which logged curve is a run's test accuracy
  (``test/acc*`` of a run with a validation split, else ``val/acc*``) and which its validation accuracy.
- ``selection``: ``select_on_validation``, ``choose_setting``: each method's setting chosen on validation curves.
- ``tables``, ``paper_table``: ``settings_table``, ``selected_table``, ``render_latex`` / ``render_markdown`` /
  ``render_csv``: paper tables over seeds (95% interval, best in bold, the paper's number beside).
- ``layout``: ``ScalarLayout``, the TensorBoard Custom Scalars layout every run writes (accuracy first).
- ``clients``: ``partition_counts``; ``python -m fedrcl.analysis.partitions`` writes a partition PNG.
- ``plots``: ``plot_partition``, ``plot_runs``, ``plot_levels``, ``plot_seed_groups`` (matplotlib, imported on
  first use).

Each name is imported from its module on first use, so reading runs (``fedrcl report``, ``fedrcl plot``)
loads neither Lightning nor torch.
"""
from importlib import import_module
from typing import Any

_MODULES = {
    "client_evaluation": ("ClientEvaluation", "label_mix_accuracy", "spread_summary"),
    "clients": ("partition_counts",),
    "compare": ("Crossing", "crossing"),
    "layout": ("SCALAR_LAYOUT", "ScalarLayout"),
    "metrics": ("class_covariances", "deviation_bound", "effective_rank", "variability_collapse_index"),
    "monitor": ("RepresentationMonitor",),
    "plots": ("LEVEL_METRICS", "plot_levels", "plot_partition", "plot_runs", "plot_seed_groups"),
    "catalogue": ("RunResult", "collect_runs", "find_runs", "named_runs", "seed_runs", "unread_versions"),
    "runs": ("load_scalars", "read_scalars"),
    "grouping": ("comparisons", "pair_by_seed", "seed_groups"),
    "seed_stats": ("SeedSummary", "align", "mean_band", "paired_differences", "seed_curves", "summarize_seeds",
                   "t_quantile", "value_at"),
    "settings": ("experiment_key", "method_key", "run_setting"),
    "tags": ("tag_of_test", "validation_curve", "with_test_tags"),
    "selection": ("choose_setting", "select_on_validation"),
    "tables": ("Cell", "Table", "render_csv", "render_latex", "render_markdown"),
    "paper_table": ("protocol", "selected_table", "settings_table"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
