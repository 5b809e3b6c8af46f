"""``fedrcl report RUNS_DIR``: your runs, their seed groups and where they stand against the paper, in markdown.

    fedrcl report runs                      # markdown to stdout
    fedrcl report runs --out report.md
    fedrcl report runs --paper              # also every table of the paper, our rows beneath its rows
    fedrcl report runs --rounds 100 300 500 # seeds and paired differences at these rounds

The report starts with your runs (a table: setting, rounds, last EMA; a run that logged fewer rounds than
its ``trainer.rounds`` is marked as not finished), then the seed groups and the methods paired by seed
(below), then what was left out and why (a version folder without ``config.yaml`` or without logs, a repeat
of a run with the same seeds), then the cells of the paper's tables that your runs fill (all the tables with
``--paper``).

A run is a run folder (``<save_dir>/<name>``) anywhere under ``RUNS_DIR`` whose ``version_k`` folders hold
the ``config.yaml`` LightningCLI saved and the curves of Lightning's TensorBoardLogger (event files) or
CSVLogger (``metrics.csv``). What it ran is read from the ``config.yaml`` (data set, partition with alpha or
shards per client, clients, local epochs, method and server class, backbone, FedRCL's beta and levels),
never from its name: a method config applied on top of a base config keeps the base's run name. Versions of
one run folder with the same setting are one run (a resume continues in a new version; a later version's
point replaces an earlier one at the same round); versions with another setting are separate runs.

The paper's numbers live in ``fedrcl/paper_results.json``: per table its fixed setting, its blocks (e.g. data
sets), columns (e.g. alpha; a block may list its own) and rows (methods), each with the setting keys (those
of ``run_setting``) a run must match, and the values at the table's rounds, with an optional note. A run
fills a cell when its setting matches the table's, the block's, the column's and the row's; one run can
fill cells of several tables. Our value is the ``val/acc_ema`` curve (the accuracy EMA the paper reports)
at the round, or at the last round logged, marked ``*``, when the run stopped earlier; where the run has
siblings under other seeds (below), the cell shows their mean ± sample std and n.

Seeds: runs whose saved configs are equal except for the seeds (``seed_everything``, ``trainer.seed``,
``data.seed``) and for keys that do not change what is trained (``EXPERIMENT_IGNORES``: where and how it is
logged, callbacks, checkpoint frequency, the data folder, the round budget, devices, batched or compiled
clients, evaluation batch size; and the trainer arguments the round loop owns at their only allowed value,
``ROUND_LOOP_VALUES``, which older fedrcl wrote into ``config.yaml``) are one experiment under several seeds,
as ``fedrcl seeds`` makes them. The "Seeds" section gives, per experiment and per tag (``--tags``, default
``val/acc_ema val/acc``), the mean ± sample std over its runs, n and the 95% Student-t interval, at the last
round all its runs logged (``fedrcl.analysis.seed_stats``), and with ``--rounds`` also at each of those
rounds, over the runs that logged it. Versions of one run folder with other seeds are separate runs.

Paired by seed: seed groups that differ only in the method (``method_key``: the same data, split, clients,
rounds schedule and network) are compared, each against its family's FedAvg group (the paper's baseline),
else the first group, run by run under the same seeds (the same split, client sampling and batches;
``comparisons``, ``pair_by_seed``). Per run, raw / EMA test accuracy at the rounds (``--rounds``; default the
last round all paired runs logged); per seed the challenger minus the reference, and over seeds its mean ±
std, 95% interval and n (``fedrcl.analysis.seed_stats.paired_differences``); per seed the round from which
the challenger's EMA stays above the reference's (``fedrcl.analysis.crossing``, curves cut at the last of
those rounds).

Reading runs needs neither Lightning nor torch (``fedrcl report`` starts in well under a second of imports).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import yaml

from fedrcl.analysis.compare import Crossing, crossing
from fedrcl.analysis.runs import Curve, has_logs, load_scalars
from fedrcl.analysis.seed_stats import align, paired_differences, summarize_seeds, value_at
from fedrcl.errors import command_error

__all__ = ["RunResult", "load_paper_results", "run_setting", "collect_runs", "unread_versions", "experiment_key",
           "seed_groups", "method_key", "comparisons", "pair_by_seed", "comparison_rounds", "paired_crossings",
           "render_seed_table", "render_paired", "render_report", "main"]

EMA_TAG = "val/acc_ema"
SEED_KEYS = ("seed_everything", "trainer.seed", "data.seed")
# Keys that say where and how a run executes, is logged, checkpointed or stopped, not what it trains: the
# resume fingerprint's ignored keys (``fedrcl.federated.fingerprint.IGNORED``, written out here because that
# module loads Lightning; a test keeps the two lists in step), and the trainer's execution switches (batched
# or compiled clients, devices, processes, evaluation cadence; they change rounding at most).
EXPERIMENT_IGNORES = (
    "data.root", "data.download", "data.eval_batch_size", "data.channels_last", "model.init_args.state_dir",
    "model.init_args.max_states_in_memory", "trainer.logger", "trainer.callbacks", "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.enable_checkpointing", "trainer.default_root_dir", "trainer.checkpoint_every",
    "trainer.log_every_n_steps", "trainer.eval_every", "trainer.rounds", "trainer.resume_allow_changes",
    "trainer.client_batching", "trainer.compile_clients", "trainer.accelerator", "trainer.strategy",
    "trainer.devices", "trainer.num_nodes", "torch_threads", "weights_only", "ckpt_path", "config")
# The trainer arguments fedrcl's round loop owns, each with the only value it allows
# (``fedrcl.federated.trainer.OWNED_BY_ROUNDS``, written out here because that module loads Lightning; a test
# keeps the two in step). Older fedrcl wrote them into config.yaml, newer leaves them out: at that value they
# say nothing about what was trained.
ROUND_LOOP_VALUES = {"max_epochs": None, "min_epochs": None, "max_steps": -1, "check_val_every_n_epoch": 1,
                     "reload_dataloaders_every_n_epochs": 0, "num_sanity_val_steps": None,
                     "gradient_clip_val": None, "gradient_clip_algorithm": None}
DEFAULT_SEED_TAGS = ("val/acc_ema", "val/acc")
PAIRED_TAGS = {"EMA": EMA_TAG, "raw": "val/acc"}
"""The accuracies the "Paired by seed" section compares, by the name it shows them under."""


@dataclass
class RunResult:
    """One run: its folder, the version folders merged into it, its setting and its EMA curve in percent."""

    path: Path
    versions: tuple[str, ...]
    setting: dict[str, Any]
    rounds: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ema: np.ndarray = field(default_factory=lambda: np.zeros(0))
    config: dict[str, Any] = field(default_factory=dict)
    curves: dict[str, Curve] = field(default_factory=dict)

    @property
    def seeds(self) -> dict[str, Any]:
        """``{"seed_everything": ..., "trainer.seed": ..., "data.seed": ...}`` from the saved config."""
        return {key: _lookup(self.config, key) for key in SEED_KEYS}

    @property
    def last_round(self) -> int:
        """The last round with a ``val/acc_ema`` point (0 before any)."""
        return int(self.rounds[-1]) if len(self.rounds) else 0

    @property
    def rounds_logged(self) -> int:
        """The last round a ``train/`` or ``val/`` scalar was logged at (training logs every round, evaluation
        maybe not; old runs logged ``comm/`` and ``time/`` one step late)."""
        return max((int(rounds[-1]) for tag, (rounds, _) in self.curves.items()
                    if tag.startswith(("train/", "val/")) and len(rounds)), default=0)

    @property
    def rounds_planned(self) -> Optional[int]:
        """``trainer.rounds`` of the saved config (``None`` when it has none)."""
        return _lookup(self.config, "trainer.rounds")

    @property
    def unfinished(self) -> bool:
        """Whether the run logged fewer rounds than it was configured for (killed, stopped early, running)."""
        return isinstance(self.rounds_planned, int) and self.rounds_logged < self.rounds_planned

    def ema_at(self, round_idx: int) -> Optional[tuple[float, bool]]:
        """``(EMA accuracy in %, reached)`` at ``round_idx`` (its last evaluation at or before it), or at
        the last round logged with ``reached=False`` when the run stopped earlier; ``None`` before any."""
        if not len(self.rounds):
            return None
        if self.last_round < round_idx:
            return float(self.ema[-1]), False
        return float(self.ema[np.searchsorted(self.rounds, round_idx, side="right") - 1]), True


PAPER = 'Seo et al., "Relaxed Contrastive Learning for Federated Learning", CVPR 2024'
"""How the report cites the paper: by title and venue, which a reader can find."""


def load_paper_results(path: Optional[str | Path] = None) -> dict[str, Any]:
    """The paper's tables (``fedrcl/paper_results.json`` unless ``path`` is given)."""
    if path is not None:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    return json.loads(resources.files("fedrcl").joinpath("paper_results.json").read_text(encoding="utf-8"))


def _class_name(spec: Any) -> Optional[str]:
    """``Foo`` from ``"a.b.Foo"`` or ``{"class_path": "a.b.Foo", ...}``; ``None`` from ``None``."""
    if isinstance(spec, dict):
        spec = spec.get("class_path")
    return spec.rsplit(".", 1)[-1] if isinstance(spec, str) else None


def _init_args(spec: Any) -> dict[str, Any]:
    return (spec.get("init_args") or {}) if isinstance(spec, dict) else {}


def run_setting(config: dict[str, Any]) -> dict[str, Any]:
    """The facts of a run that the paper's tables are keyed by, from its saved LightningCLI config.

    Keys: ``dataset``, ``partition``, ``alpha`` (``None`` unless a Dirichlet partition), ``shards_per_client``
    (``None`` unless a ``shards`` partition), ``num_clients``, ``clients_per_round`` (also from
    ``participation``), ``local_epochs``, ``batch_size``, ``local_iters_per_epoch``, ``server`` (class name;
    ``FedAvg`` when none), ``method`` (the client algorithm's class name), ``beta`` and ``levels`` (the
    method's, when it has them; ``levels`` a tuple, ``None`` for all levels), ``backbone`` (class name),
    ``width`` (the backbone's, when it has one), ``partition_file``.
    """
    data = config.get("data") or {}
    if "class_path" in data:
        data = _init_args(data)
    trainer, model = config.get("trainer") or {}, config.get("model") or {}
    partition, num_clients = data.get("partition"), data.get("num_clients")
    clients_per_round = trainer.get("clients_per_round")
    if clients_per_round is None and trainer.get("participation") is not None and num_clients is not None:
        clients_per_round = max(1, round(trainer["participation"] * num_clients))
    method_args = _init_args(model)
    backbone, levels = method_args.get("backbone"), method_args.get("levels")
    return {
        "dataset": data.get("dataset"),
        "partition": partition,
        "alpha": data.get("alpha") if str(partition).startswith("dirichlet") else None,
        "shards_per_client": data.get("shards_per_client") if partition == "shards" else None,
        "num_clients": num_clients,
        "clients_per_round": clients_per_round,
        "local_epochs": trainer.get("local_epochs"),
        "batch_size": data.get("batch_size"),
        "local_iters_per_epoch": data.get("local_iters_per_epoch"),
        "server": _class_name(trainer.get("server")) or "FedAvg",
        "method": _class_name(model),
        "beta": method_args.get("beta"),
        "levels": tuple(levels) if levels is not None else None,
        "backbone": _class_name(backbone),
        "width": _init_args(backbone).get("width"),
        "partition_file": data.get("partition_file"),
    }


def _lookup(config: dict[str, Any], key: str) -> Any:
    """The value at a dotted ``key`` (``trainer.seed``) of a nested config; ``None`` where it is absent."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def experiment_key(config: dict[str, Any]) -> str:
    """What a run trains, from its saved config: everything but the seeds and ``EXPERIMENT_IGNORES`` (each
    dropped with what lies under it) and the ``trainer`` keys of ``ROUND_LOOP_VALUES`` at their value, as
    canonical JSON."""
    kept = copy.deepcopy(config)
    for key in SEED_KEYS + EXPERIMENT_IGNORES:
        *parents, leaf = key.split(".")
        node: Any = kept
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    trainer = kept.get("trainer")
    if isinstance(trainer, dict):
        for key, value in ROUND_LOOP_VALUES.items():
            if key in trainer and trainer[key] == value:
                del trainer[key]
    return json.dumps(kept, sort_keys=True, default=str)


def method_key(config: dict[str, Any]) -> str:
    """``experiment_key`` with everything under ``model`` set aside but its backbone: what runs of two methods
    compared on equal terms share (data, split, clients, rounds schedule, network)."""
    model = config.get("model")
    return experiment_key({**config, "model": {"backbone": _init_args(model).get("backbone")}})


def _version_number(path: Path) -> int:
    suffix = path.name.removeprefix("version_")
    return int(suffix) if suffix.isdigit() else -1


def collect_runs(root: str | Path) -> list[RunResult]:
    """Every run under ``root`` (see the module docstring), sorted by folder, then first version."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root} is not a folder")
    run_dirs = sorted({v.parent for v in root.rglob("version_*")
                       if (v / "config.yaml").is_file() and has_logs(v)})
    runs = []
    for run_dir in run_dirs:
        groups: dict[tuple, list[Path]] = {}
        settings: dict[tuple, dict[str, Any]] = {}
        configs: dict[tuple, dict[str, Any]] = {}
        for version in sorted(run_dir.glob("version_*"), key=_version_number):
            if not (version / "config.yaml").is_file() or not has_logs(version):  # see unread_versions
                continue
            config = yaml.safe_load((version / "config.yaml").read_text()) or {}
            setting = run_setting(config)
            key = (tuple(sorted(setting.items())), tuple(repr(_lookup(config, k)) for k in SEED_KEYS))
            groups.setdefault(key, []).append(version)
            settings[key], configs[key] = setting, config
        for key, versions in groups.items():
            points: dict[str, dict[int, float]] = {}
            for version in versions:
                for tag, (rounds, values) in load_scalars(version).items():
                    points.setdefault(tag, {}).update(zip(rounds.tolist(), values.tolist()))
            curves = {tag: (np.array(sorted(p), dtype=np.int64), np.array([p[r] for r in sorted(p)]))
                      for tag, p in points.items()}
            rounds, ema = curves.get(EMA_TAG, (np.zeros(0, np.int64), np.zeros(0)))
            runs.append(RunResult(run_dir, tuple(v.name for v in versions), settings[key], rounds,
                                  100.0 * ema, configs[key], curves))
    return runs


def unread_versions(root: str | Path) -> list[tuple[Path, str]]:
    """The ``version_*`` folders under ``root`` that ``collect_runs`` reads no curve from, each with why."""
    unread = []
    for version in sorted(Path(root).rglob("version_*")):
        if not version.is_dir():
            continue
        if not (version / "config.yaml").is_file():
            unread.append((version, "no config.yaml (not written by `fedrcl fit`, or stopped before it saved "
                                    "its config), so its setting is unknown"))
        elif not has_logs(version):
            unread.append((version, "no TensorBoard event file and no CSVLogger metrics.csv (only these two "
                                    "loggers are read)"))
    return unread


def _seed_tuple(run: RunResult) -> tuple:
    return tuple(repr(v) for v in run.seeds.values())


def _group_seeds(runs: Sequence[RunResult]) -> tuple[list[list[RunResult]], list[tuple[RunResult, RunResult]]]:
    """``seed_groups`` and the repeats it leaves out: ``(left out, kept)`` pairs."""
    groups: dict[Any, dict[tuple, RunResult]] = {}
    repeats = []
    for run in runs:
        key = experiment_key(run.config) if run.config else ("run", id(run))
        by_seeds = groups.setdefault(key, {})
        other = by_seeds.get(_seed_tuple(run))
        if other is not None:
            kept, dropped = (run, other) if run.last_round > other.last_round else (other, run)
            repeats.append((dropped, kept))
            run = kept
        by_seeds[_seed_tuple(run)] = run
    return [list(by_seeds.values()) for by_seeds in groups.values()], repeats


def seed_groups(runs: Sequence[RunResult]) -> list[list[RunResult]]:
    """Runs that differ only in seeds (same ``experiment_key``), in the order of their first run; of runs
    with the same seeds too (a repeat), the one that got furthest. A run without a saved config is alone."""
    return _group_seeds(runs)[0]


def comparisons(groups: Sequence[Sequence[RunResult]]) -> list[tuple[Sequence[RunResult], Sequence[RunResult]]]:
    """``(reference, challenger)`` seed groups of ``seed_groups`` that differ only in the method (the same
    ``method_key``): in each such family the reference is its FedAvg group (the paper's baseline; the first
    one when several), else its first group, and every other group is a challenger, in the order of
    ``groups``. A run without a saved config is in no family."""
    families: dict[str, list[Sequence[RunResult]]] = {}
    for group in groups:
        if group[0].config:
            families.setdefault(method_key(group[0].config), []).append(group)
    compared = []
    for family in families.values():
        reference = next((g for g in family if g[0].setting["method"] == "FedAvg"), family[0])
        compared += [(reference, group) for group in family if group is not reference]
    return compared


def _seed_order(seeds: tuple) -> tuple:
    """Seeds in numeric order (seed 10 after seed 2), ``None`` or text after numbers."""
    return tuple((0, v, "") if isinstance(v, int) else (1, 0, str(v)) for v in seeds)


def pair_by_seed(reference: Sequence[RunResult],
                 challenger: Sequence[RunResult]) -> dict[tuple, tuple[RunResult, RunResult]]:
    """``{seeds: (reference run, challenger run)}`` for the seeds (``seed_everything``, ``trainer.seed``,
    ``data.seed``, all three equal) both groups ran, in seed order: each pair shares its split, client
    sampling and batches."""
    by_seeds = {tuple(r.seeds.values()): r for r in reference}
    pairs = {seeds: (by_seeds[seeds], run) for run in challenger
             if (seeds := tuple(run.seeds.values())) in by_seeds}
    return dict(sorted(pairs.items(), key=lambda item: _seed_order(item[0])))


def comparison_rounds(pairs: dict[tuple, tuple[RunResult, RunResult]], rounds: Sequence[int] = ()) -> list[int]:
    """``rounds`` when given, else the last round all paired runs logged ``val/acc_ema`` at (none when they
    share no round)."""
    if rounds:
        return list(rounds)
    curves = [run.curves[EMA_TAG] for pair in pairs.values() for run in pair if EMA_TAG in run.curves]
    if not pairs or len(curves) < 2 * len(pairs):
        return []
    common, _ = align(curves)
    return [int(common[-1])] if len(common) else []


def _through(curve: Curve, last: int) -> Curve:
    """``curve`` up to round ``last``."""
    rounds, values = curve
    return rounds[rounds <= last], values[rounds <= last]


def paired_crossings(pairs: dict[tuple, tuple[RunResult, RunResult]], through: int) -> dict[tuple, Crossing]:
    """Per seed pair, where the challenger's ``val/acc_ema`` passes the reference's (``crossing``) on their
    common rounds up to ``through``: a run that went further is cut there, so every seed is read over the same
    rounds. Pairs without such a common round are left out."""
    out = {}
    for seeds, (reference, challenger) in pairs.items():
        ref_curve, ch_curve = reference.curves.get(EMA_TAG), challenger.curves.get(EMA_TAG)
        if ref_curve is None or ch_curve is None:
            continue
        ref_curve, ch_curve = _through(ref_curve, through), _through(ch_curve, through)
        if len(np.intersect1d(ref_curve[0], ch_curve[0])):
            out[seeds] = crossing(ref_curve, ch_curve)
    return out


def _seed_label(runs: Sequence[RunResult], key: str) -> str:
    values = sorted({str(r.seeds[key]) for r in runs})
    return ",".join(values)


def render_seed_table(runs: Sequence[RunResult], tags: Sequence[str] = DEFAULT_SEED_TAGS,
                      root: Optional[Path] = None, rounds: Sequence[int] = ()) -> list[str]:
    """The "Seeds" section: per experiment, per tag, mean ± std over its runs, n and the 95% interval.

    Values are in % for tags of accuracies (``.../acc...``), as logged otherwise; each at the last round
    every run of the experiment logged the tag (``@`` that round), and in a second table at each of
    ``rounds``, over the runs that logged it. Paths are shown relative to ``root``.
    """
    out = ["## Seeds", "",
           "Runs that differ only in seeds, grouped: mean ± sample std over the runs, n, and the 95% "
           "interval of the mean (Student t), each at the last round all the runs logged (@). Accuracies "
           "in %.", ""]
    groups = [g for g in seed_groups(runs) if any(r.curves for r in g)]
    if not groups:
        return out + ["No runs with logged scalars.", ""]
    header = ["Experiment", "Method", "Server", "n", "seeds (init / sampling / split)"]
    for tag in tags:
        header += [f"{tag} mean ± std", f"{tag} 95% CI"]
    out += ["| " + " | ".join(header) + " |", "|:--|:--|:--|--:|:--|" + "--:|--:|" * len(tags)]
    for group in groups:
        s = group[0].setting
        seeds = " / ".join(_seed_label(group, k) for k in SEED_KEYS)
        cells = [_md(_group_where(group, root)), _md(s["method"]), _md(s["server"]), str(len(group)), seeds]
        for tag in tags:
            cells += _seed_cells(group, tag)
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    if not rounds:
        return out
    out += ["The same at the rounds asked for (`--rounds`), each over the runs that logged that round: mean ± "
            "sample std [95% interval] (n); \"-\" where none did.", "",
            "| Experiment | Method | Tag | " + " | ".join(f"round {r}" for r in rounds) + " |",
            "|:--|:--|:--|" + "--:|" * len(rounds)]
    for group in groups:
        for tag in tags:
            values = [[v for run in group if tag in run.curves and (v := value_at(run.curves[tag], r)) is not None]
                      for r in rounds]
            cells = [_summary_cell([_scale(tag) * v for v in at_round]) for at_round in values]
            out.append(f"| {_md(_group_where(group, root))} | {_md(group[0].setting['method'])} | {_md(tag)} | "
                       + " | ".join(cells) + " |")
    return out + [""]


def _group_where(group: Sequence[RunResult], root: Optional[Path]) -> str:
    """The folders of a seed group's runs (``<name>`` for ``<name>/seed<k>`` runs), relative to ``root``."""
    return ", ".join(sorted({_where(r.path.parent if r.path.name.startswith("seed") else r.path, root)
                             for r in group}))


def _scale(tag: str) -> float:
    """100 for accuracies (``.../acc...``, shown in %), else 1."""
    return 100.0 if "acc" in tag.rsplit("/", 1)[-1] else 1.0


def _summary_cell(values: Sequence[float]) -> str:
    """``mean ± std [low, high] (n=k)``; ``mean (n=1)`` for one value; "-" for none."""
    if not values:
        return "-"
    s = summarize_seeds(values)
    if s.n < 2:
        return f"{s.mean:.2f} (n=1)"
    return f"{s.format()} {s.interval()} (n={s.n})"


def _seed_cells(group: Sequence[RunResult], tag: str) -> list[str]:
    curves: list[Curve] = []
    for r in group:
        curve = r.curves.get(tag)
        if curve is None or not len(curve[0]):
            return ["", ""]
        curves.append(curve)
    common, values = align(curves)
    if not len(common):
        return ["", ""]
    at = int(common[-1])
    summary = summarize_seeds(values[:, -1])
    scale = _scale(tag)
    return [f"{summary.format(scale)} @{at}", summary.interval(scale)]


def render_paired(runs: Sequence[RunResult], rounds: Sequence[int] = (), root: Optional[Path] = None) -> list[str]:
    """The "Paired by seed" section: per challenger of ``comparisons``, its runs and the reference's (raw /
    EMA accuracy at each of ``comparison_rounds`` and the rounds run), the paired differences per seed and
    over seeds (``PAIRED_TAGS``), and per seed where the challenger's EMA passes the reference's for good."""
    out = ["## Paired by seed", "",
           "Seed groups that differ only in the method (the same data, split, clients, rounds schedule and "
           "network) are compared with the FedAvg group among them (else the first), run by run under the same "
           "seeds (init, sampling and split: the same split, client sampling and batches). Per run, test "
           "accuracy raw / EMA (%) at the rounds asked for (`--rounds`; default: the last round all paired runs "
           "logged), \"-\" where not logged; then the challenger minus the reference in points, per seed "
           "(s<seed>) and over the seeds where both logged the round: mean ± sample std [95% Student-t "
           "interval] (n); last, per seed, where the challenger's EMA passes the reference's for good, on their "
           "common rounds up to the last of those rounds.", ""]
    compared = comparisons(seed_groups(runs))
    if not compared:
        return out + ["No seed groups that differ only in the method.", ""]
    for reference, challenger in compared:
        ref_name, ch_name = reference[0].setting["method"], challenger[0].setting["method"]
        ref_where, ch_where = _group_where(reference, root), _group_where(challenger, root)
        if ref_name == ch_name:  # the same method under other arguments: the folders tell them apart
            ref_name, ch_name = ref_where, ch_where
        out += [f"### {_md(ch_name)} ({_md(ch_where)}) against {_md(ref_name)} ({_md(ref_where)})", ""]
        pairs = pair_by_seed(reference, challenger)
        at = comparison_rounds(pairs, rounds)
        if not pairs or not at:
            out += ["No seeds in common." if not pairs else "No round all the paired runs logged.", ""]
            continue
        header = " | ".join(f"round {r}" for r in at)
        out += [f"| method | seed | run | {header} | rounds run |", "|:--|--:|:--|" + "--:|" * (len(at) + 1)]
        for name, group in ((ref_name, reference), (ch_name, challenger)):
            for run in sorted(group, key=lambda r: _seed_order(tuple(r.seeds.values()))):
                cells = [_raw_ema(run, r) for r in at]
                out.append(f"| {_md(name)} | {run.seeds['seed_everything']} | {_md(_where(run.path, root))} | "
                           + " | ".join(cells) + f" | {run.rounds_logged} |")
        out += ["", f"| {_md(ch_name)} minus {_md(ref_name)} | {header} |", "|:--|" + "--:|" * len(at)]
        for label, tag in PAIRED_TAGS.items():
            curves = {seeds: (ref.curves[tag], ch.curves[tag]) for seeds, (ref, ch) in pairs.items()
                      if tag in ref.curves and tag in ch.curves}
            diffs = [{seeds: 100 * d for seeds, d in paired_differences(curves, r).items()} for r in at]
            per_seed = [", ".join(f"s{seeds[0]} {d:+.2f}" for seeds, d in by_seeds.items()) or "-"
                        for by_seeds in diffs]
            out.append(f"| {label}, per seed | " + " | ".join(per_seed) + " |")
            out.append(f"| {label}, mean | " + " | ".join(_summary_cell(list(d.values())) for d in diffs) + " |")
        out.append("")
        for seeds, c in paired_crossings(pairs, at[-1]).items():
            first = "never above" if c.first_above is None else f"first above at round {c.first_above}"
            stays = "not above" if c.above_from is None else f"above for good from round {c.above_from}"
            out.append(f"- seed {seeds[0]}, {ch_name} vs {ref_name} EMA: {first}; {stays} through round "
                       f"{c.last_common} (last common round, gap {100 * c.gap_at_last:+.2f})")
        out.append("")
    return out


def _raw_ema(run: RunResult, round_idx: int) -> str:
    """``raw / EMA`` accuracy in % at ``round_idx``, "-" for a value not logged there (alone when neither is)."""
    values = [value_at(run.curves[PAIRED_TAGS[name]], round_idx) if PAIRED_TAGS[name] in run.curves else None
              for name in ("raw", "EMA")]
    if all(v is None for v in values):
        return "-"
    return " / ".join("-" if v is None else f"{100 * v:.2f}" for v in values)


def _matches(setting: dict[str, Any], required: dict[str, Any]) -> bool:
    for key, want in required.items():
        have = setting.get(key)
        if isinstance(want, list):  # JSON has no tuples: levels
            want = tuple(want)
        if isinstance(want, float) and isinstance(have, (int, float)) and not isinstance(have, bool):
            if not math.isclose(have, want, rel_tol=1e-9):
                return False
        elif have != want:
            return False
    return True


def _columns(table: dict[str, Any], block: dict[str, Any]) -> list[dict[str, Any]]:
    """The block's own columns where it lists them (e.g. the shard counts of Table A), else the table's."""
    return block["columns"] if "columns" in block else table["columns"]


def _cells(table: dict[str, Any]):
    """``(block, row, column, required setting)`` for every cell of ``table``."""
    for block in table["blocks"]:
        for row in table["rows"]:
            for column in _columns(table, block):
                yield block["name"], row["name"], column["name"], \
                    {**table["setting"], **block["setting"], **column["setting"], **row["setting"]}


def _assign(tables: list[dict[str, Any]], runs: list[RunResult]) -> dict[tuple, list[RunResult]]:
    """The runs shown in each cell ``(table label, block, row, column)``: of the matching runs, the one
    that got furthest (the later one on a tie), with the runs of its experiment under other seeds."""
    groups = {id(r): group for group in seed_groups(runs) for r in group}
    shown: dict[tuple, list[RunResult]] = {}
    for table in tables:
        for block, row, column, required in _cells(table):
            matching = [r for r in runs if len(r.rounds) and _matches(r.setting, required)]
            if matching:
                best = max(reversed(matching), key=lambda r: r.last_round)
                siblings = [r for r in groups.get(id(best), [best]) if r is not best and len(r.rounds)]
                shown[(table["label"], block, row, column)] = [best, *siblings]
    return shown


def _our_cell(group: Sequence[RunResult], round_idx: int, theirs: Optional[float]) -> str:
    """``value`` (one run) or ``mean ± std (n=k)`` over seeds, ``*`` if a run stopped earlier, and the
    difference to the paper's number."""
    points = [p for p in (run.ema_at(round_idx) for run in group) if p is not None]
    if not points:
        return ""
    summary = summarize_seeds([value for value, _ in points])
    cell = f"{summary.mean:.2f}"
    if summary.n > 1:
        cell += f" ± {summary.std:.2f} (n={summary.n})"
    cell += "" if all(reached for _, reached in points) else "*"
    return cell if theirs is None else f"{cell} ({summary.mean - theirs:+.2f})"


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|")


def _split_name(setting: dict[str, Any]) -> str:
    name = str(setting["partition"])
    if setting["alpha"] is not None:
        name += f" α={setting['alpha']:g}"
    if setting["shards_per_client"] is not None:
        name += f" γ={setting['shards_per_client']}"
    if setting["partition_file"]:
        name += f" (file {Path(setting['partition_file']).name})"
    return name


def _render_table(table: dict[str, Any], shown: dict[tuple, list[RunResult]]) -> list[str]:
    out = [f"## {table['title']} (`{table['label']}`)", "",
           "Setting of every cell: " + ", ".join(f"{k} {v}" for k, v in table["setting"].items()) + ".", ""]
    if "note" in table:
        out += [table["note"], ""]
    for block in table["blocks"]:
        columns = _columns(table, block)
        header = [f"{c['name']} {r}R" for c in columns for r in table["rounds"]]
        out += [f"### {block['name']}", "", "| Method | " + " | ".join(header) + " |",
                "|:--|" + "--:|" * len(header)]
        for row in table["rows"]:
            paper_row = table["values"].get(block["name"], {}).get(row["name"], {})
            paper_cells, our_cells = [], []
            for column in columns:
                paper = paper_row.get(column["name"], [None] * len(table["rounds"]))
                group = shown.get((table["label"], block["name"], row["name"], column["name"]), [])
                for round_idx, theirs in zip(table["rounds"], paper):
                    paper_cells.append("" if theirs is None else f"{theirs:.2f}")
                    our_cells.append(_our_cell(group, round_idx, theirs))
            out.append(f"| {_md(row['name'])} (paper) | " + " | ".join(paper_cells) + " |")
            out.append(f"| {_md(row['name'])} (ours) | " + " | ".join(our_cells) + " |")
        out.append("")
    return out


def _where(path: Path, root: Optional[Path]) -> str:
    """``path`` relative to ``root`` where it lies under it."""
    return str(path.relative_to(root)) if root is not None and path.is_relative_to(root) else str(path)


def _render_runs(runs: Sequence[RunResult], placed: dict[int, list[tuple]], root: Optional[Path]) -> list[str]:
    """The "Runs" section: one row per run, a run that logged fewer rounds than planned marked."""
    out = ["## Your runs", ""]
    if not runs:
        return out + ["No runs found (a run is a folder of `version_*` folders holding `config.yaml` and "
                      "TensorBoard event files or a CSVLogger `metrics.csv`).", ""]
    out += ["Rounds: the last round logged, of `trainer.rounds`; \"not finished\": fewer (killed, stopped early, "
            "or still running). Last EMA: `val/acc_ema` at its last round, in %.", "",
            "| Run | Versions | Dataset | Split | Method | Server | Backbone | Clients/round | Rounds | "
            "Last EMA | Paper cells |", "|:--|:--|:--|:--|:--|:--|:--|--:|--:|--:|:--|"]
    for run in runs:
        s = run.setting
        backbone = f"{s['backbone']}" + (f" (width {s['width']})" if s["width"] is not None else "")
        where = "; ".join(" / ".join(map(str, cell)) for cell in placed.get(id(run), [])) or "—"
        last = f"{run.ema[-1]:.2f}" if len(run.ema) else "no val/acc_ema yet"
        rounds = str(run.rounds_logged)
        if run.rounds_planned is not None:
            rounds += f" of {run.rounds_planned}" + (", not finished" if run.unfinished else "")
        out.append(" | ".join(["", _md(_where(run.path, root)), _md(", ".join(run.versions)), _md(s["dataset"]),
                               _md(_split_name(s)), _md(s["method"]), _md(s["server"]), _md(backbone),
                               f"{s['clients_per_round']}/{s['num_clients']}", rounds, last,
                               _md(where), ""]).strip())
    return out + [""]


def _render_left_out(runs: Sequence[RunResult], unread: Sequence[tuple[Path, str]],
                     root: Optional[Path]) -> list[str]:
    """The "Left out" section: what is not in the tables above, and why."""
    notes = [f"- `{_where(path, root)}`: {why}." for path, why in unread]
    for dropped, kept in _group_seeds(runs)[1]:
        notes.append(f"- `{_where(dropped.path, root)}` ({', '.join(dropped.versions)}): the same experiment and "
                     f"seeds as `{_where(kept.path, root)}` ({', '.join(kept.versions)}), which got further "
                     f"(round {kept.last_round} against {dropped.last_round}); seeds and paper cells use that "
                     "one. Runs that differ only in keys that do not change what is trained (logging, "
                     "callbacks, rounds, devices: `EXPERIMENT_IGNORES`) are repeats.")
    return ["## Left out", "", *(notes or ["Nothing: every version folder found is in the tables above."]), ""]


def _render_paper_cells(tables: list[dict[str, Any]], shown: dict[tuple, list[RunResult]]) -> list[str]:
    """The cells of the paper's tables that the runs fill, one row per cell and round."""
    out = ["## Beside the paper", "",
           f"Paper: {PAPER}; its numbers are in `fedrcl/paper_results.json`. The cells your runs fill: our "
           "`val/acc_ema` (EMA 0.9 of the test accuracy, %) at the table's round, mean ± sample std (n=...) "
           "over seeds, ours minus the paper's in parentheses; `*`: a run stopped earlier, its value is at its "
           "last round. `--paper` prints every table.", ""]
    rows = []
    for table in tables:
        for block in table["blocks"]:
            for row in table["rows"]:
                paper_row = table["values"].get(block["name"], {}).get(row["name"], {})
                for column in _columns(table, block):
                    group = shown.get((table["label"], block["name"], row["name"], column["name"]))
                    if not group:
                        continue
                    paper = paper_row.get(column["name"], [None] * len(table["rounds"]))
                    for round_idx, theirs in zip(table["rounds"], paper):
                        rows.append(" | ".join(["", _md(table["label"]), _md(block["name"]), _md(row["name"]),
                                                _md(column["name"]), str(round_idx),
                                                "" if theirs is None else f"{theirs:.2f}",
                                                _our_cell(group, round_idx, theirs), ""]).strip())
    if not rows:
        return out + ["No run has the setting of a cell of the paper's tables (data set, split, clients, local "
                      "epochs, method, server, backbone).", ""]
    return out + ["| Table | Block | Method | Column | Round | Paper | Ours |", "|:--|:--|:--|:--|--:|--:|--:|",
                  *rows, ""]


def render_report(runs: Sequence[RunResult], paper: Optional[dict[str, Any]] = None, title: str = "",
                  seed_tags: Sequence[str] = DEFAULT_SEED_TAGS, paper_tables: bool = False,
                  unread: Sequence[tuple[Path, str]] = (), root: Optional[str | Path] = None,
                  rounds: Sequence[int] = ()) -> str:
    """The markdown report: the runs, the seeds table, the methods paired by seed, what was left out, then the
    paper's cells they fill (every table of the paper, with our rows, when ``paper_tables``).

    Args:
        runs: ``collect_runs(root)``.
        paper: the paper's tables (``load_paper_results()`` when None).
        title: after "fedrcl report: " in the heading.
        seed_tags: the scalars of the Seeds section.
        paper_tables: print the paper's tables in full.
        unread: ``unread_versions(root)``, listed under "Left out".
        root: paths are shown relative to it.
        rounds: the rounds of the Seeds section's second table and of the paired comparisons.
    """
    paper = load_paper_results() if paper is None else paper
    root = Path(root) if root is not None else None
    tables = paper["tables"]
    shown = _assign(tables, list(runs))
    placed: dict[int, list[tuple]] = {}
    for cell, group in shown.items():
        for run in group:
            placed.setdefault(id(run), []).append(cell)
    out = [f"# fedrcl report{': ' + title if title else ''}", ""]
    out += _render_runs(runs, placed, root)
    out += render_seed_table(runs, seed_tags, root, rounds)
    out += render_paired(runs, rounds, root)
    out += _render_left_out(runs, unread, root)
    if not paper_tables:
        return "\n".join(out + _render_paper_cells(tables, shown))
    out += ["## The paper's tables", "",
            f"Paper: {PAPER}. Its numbers below are in `fedrcl/paper_results.json` (one entry per table).",
            "Each method has the paper's row and ours beneath it: our `val/acc_ema` (EMA 0.9 of the test "
            "accuracy, in %) at the round, with ours minus the paper's in parentheses; over several seeds of "
            "one experiment, mean ± sample std (n=...). `*`: a run stopped earlier; its value is at its last "
            "round (see Your runs). Empty: no finished round for that cell.", ""]
    for table in tables:
        out += _render_table(table, shown)
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> None:
    """``fedrcl report RUNS_DIR [--out FILE] [--tags TAG ...] [--rounds R ...] [--paper]``."""
    parser = argparse.ArgumentParser(
        prog="fedrcl report", description="Markdown tables of your runs, their seeds, their methods paired by "
                                          "seed, and the paper's cells they fill.")
    parser.add_argument("runs_dir", metavar="RUNS_DIR", help="folder holding the runs (a logger's save_dir)")
    parser.add_argument("--out", help="write the markdown here instead of printing it")
    parser.add_argument("--tags", nargs="+", default=list(DEFAULT_SEED_TAGS),
                        help="scalars summarised over seeds in the Seeds section (default: %(default)s)")
    parser.add_argument("--rounds", type=int, nargs="+", default=[], metavar="R",
                        help="also summarise the seed groups at these rounds, and compare the methods paired by "
                             "seed at them (default: the last round all paired runs logged)")
    parser.add_argument("--paper", action="store_true",
                        help="print every table of the paper with our rows beneath its rows, not only the "
                             "cells our runs fill")
    args = parser.parse_args(argv)
    if not Path(args.runs_dir).is_dir():
        command_error("fedrcl report", f"RUNS_DIR {args.runs_dir} is not a folder")
    runs, unread = collect_runs(args.runs_dir), unread_versions(args.runs_dir)
    if not runs:
        found = f"; {len(unread)} version folders without config.yaml" if unread else ""
        command_error("fedrcl report", f"no runs under {args.runs_dir}{found} (a run is a folder of version_* "
                      "folders, each with the config.yaml of `fedrcl fit` and TensorBoard event files or a "
                      "CSVLogger metrics.csv)")
    text = render_report(runs, title=args.runs_dir, seed_tags=args.tags, paper_tables=args.paper,
                         unread=unread, root=Path(args.runs_dir), rounds=args.rounds)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
