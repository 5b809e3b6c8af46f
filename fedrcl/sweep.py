"""``fedrcl sweep``: a grid or random search over config keys, each (setting, seed) a run folder of its own.

    fedrcl sweep --grid model.init_args.lr=0.03,0.1 model.init_args.mu=0.001,0.01 --seeds 0 1 --rounds 100 \
        --together --config configs/cpu/cifar10_a01_cnn.yaml --model fedrcl.algorithms.FedProx
    fedrcl sweep --random 4 --space model.init_args.lr=0.01,0.03,0.1 data.alpha=0.1,0.3 --sample_seed 0 \
        --seeds 0 --config configs/quickstart.yaml
    fedrcl report runs          # one experiment per setting: mean, std and 95% interval over its seeds

A KEY is any config key as ``fedrcl fit`` takes it (``model.init_args.lr``, ``model.lr``, ``data.alpha``); its
values are split at commas and passed on as typed. ``--grid`` trains every combination, ``--random N`` N of
them drawn without replacement (``--sample_seed``). Each setting is named by its values, the keys' last parts
in alphabetical order (``lr=0.03,mu=0.01``; characters a file name should not hold become ``_``), so the same
grid names the same folders in every invocation; run ``(setting, k)`` is ``fedrcl fit FIT_ARGS --KEY VALUE
... --trainer.rounds R`` with seed k as ``fedrcl seeds`` sets it, logged under ``<name>/<setting>/seed<k>``
(``runs/quickstart/lr=0.03,mu=0.01/seed0/version_0``), which ``fedrcl report``, ``fedrcl plot`` and
``--ckpt_path last`` read as any run. Every setting's configuration is built before anything trains: a key the
config does not have, a key given twice, one without values and a value the config refuses (``mu=-1``) are
refused in one line naming it.

``--together`` trains the settings that differ only in what one stacked step can map as one cohort
(``fedrcl.federated.together``: every (setting, seed) run's clients on one axis): the client learning rate
and its decays (``StepInputs.lr`` is each run's own schedule) and the loss weights the method declares
``SWEEPABLE`` (FedProx's ``mu``, FedRCL's ``beta``, ...: each run's value set on the algorithm per slice,
``StepInputs.weights``). Settings that differ in any other key (another method, partition, momentum) train as
one cohort per value of those keys, one after another, said in one line naming the keys. Without
``--together`` every run is its own ``fedrcl fit``, one after another in this process. SIGTERM and Ctrl-C
finish the round, checkpoint the runs in progress and start no other (exit status 128 + the signal, with the
resume command); ``--ckpt_path last`` resumes each run from its own newest checkpoint, starts the runs that
have none and leaves out the runs whose logs reach the last round (done, their checkpoints kept or not).
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import random
import re
import shlex
import signal
import sys
import warnings
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any, Optional

from fedrcl.seeds import SEED_LIMIT, Outcome, fit_args_for_seed, resolved_config, run_name

__all__ = ["Setting", "canonical_key", "main", "parse_axes", "settings_of", "short_names"]

# The keys of the client lr's schedule: each run's own ``client_lr`` fills the stacked step's ``lr``.
LR_KEYS = ("lr", "lr_decay", "local_lr_decay")
NAME_LIMIT = 200  # longest setting folder name; longer ones end in a hash of the whole name


class SweepError(ValueError):
    """A grid the sweep refuses, said in one line naming the key."""


def parse_axes(items: list[str], option: str) -> dict[str, list[str]]:
    """``["model.lr=0.01,0.1", "data.alpha=0.3"]`` -> ``{"model.lr": ["0.01", "0.1"], "data.alpha": ["0.3"]}``;
    a key without ``=``, without values, with an empty or a repeated value, or given twice is refused."""
    axes: dict[str, list[str]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not key:
            raise SweepError(f"{option} {item}: write KEY=V1,V2,... (e.g. model.init_args.lr=0.01,0.1)")
        values = [v.strip() for v in text.split(",")]
        if not text.strip() or any(not v for v in values):
            raise SweepError(f"{option} {key}: no value (or an empty one) in {text!r}: write {key}=V1,V2,...")
        if len(set(values)) != len(values):
            raise SweepError(f"{option} {key}: repeated values in {text!r}")
        if key in axes:
            raise SweepError(f"{option} {key}: the key is given twice")
        axes[key] = values
    return axes


def canonical_key(config: dict[str, Any], key: str) -> str:
    """The key's full path in ``config`` (``fedrcl fit --print_config``'s tree): ``model.lr`` ->
    ``model.init_args.lr`` (a class's arguments may be named without ``init_args``); ``SweepError`` when the
    config has no such key."""
    node: Any = config
    path: list[str] = []
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node, path = node[part], [*path, part]
        elif isinstance(node, dict) and isinstance(node.get("init_args"), dict) and part in node["init_args"]:
            node, path = node["init_args"][part], [*path, "init_args", part]
        else:
            raise SweepError(f"{key}: not a key of this run's config (`fedrcl fit ... --print_config` lists them)")
    return ".".join(path)


def short_names(keys: list[str]) -> dict[str, str]:
    """Each key's name in a setting's folder: its last part (``init_args`` left out), longer where two keys
    would share one (``model.init_args.lr`` and ``trainer.server.init_args.lr``: ``model.lr``, ``server.lr``)."""
    parts = {key: [p for p in key.split(".") if p != "init_args"] for key in keys}
    depth = {key: 1 for key in keys}
    while True:
        names = {key: ".".join(parts[key][-depth[key]:]) for key in keys}
        clashing = [key for key in keys if list(names.values()).count(names[key]) > 1]
        if not clashing:
            return names
        for key in clashing:
            depth[key] = min(depth[key] + 1, len(parts[key]))


def safe(text: str) -> str:
    """``text`` with every character a folder name should not hold (anything but letters, digits and ``.+-_``)
    replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


@dataclass(frozen=True)
class Setting:
    """One point of the grid: its values by (full) key, and its folder name."""

    values: tuple[tuple[str, str], ...]
    name: str

    def overrides(self) -> list[str]:
        """The ``fedrcl fit`` arguments that set it."""
        return [arg for key, value in self.values for arg in (f"--{key}", value)]


def settings_of(axes: dict[str, list[str]], names: dict[str, str], sample: Optional[int] = None,
                sample_seed: int = 0) -> list[Setting]:
    """The grid's settings in its order (the first key slowest), or ``sample`` of them drawn without
    replacement with ``random.Random(sample_seed)``, kept in the grid's order."""
    keys = list(axes)
    points = list(itertools.product(*(axes[k] for k in keys)))
    if sample is not None:
        if not 1 <= sample <= len(points):
            raise SweepError(f"--random {sample}: the space has {len(points)} settings; draw 1 to {len(points)}")
        points = [points[i] for i in sorted(random.Random(sample_seed).sample(range(len(points)), sample))]
    settings = []
    for point in points:
        name = ",".join(f"{names[k]}={safe(v)}" for k, v in sorted(zip(keys, point), key=lambda kv: names[kv[0]]))
        if len(name) > NAME_LIMIT:
            name = f"{name[:NAME_LIMIT - 9]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
        settings.append(Setting(tuple(zip(keys, point)), name))
    same = [s.name for s in settings if [t.name for t in settings].count(s.name) > 1]
    if same:
        raise SweepError(f"two settings would share the folder {same[0]} (values that differ only in characters "
                         "a folder name cannot hold)")
    return settings


def mappable(key: str, config: dict[str, Any]) -> bool:
    """Whether runs that differ in ``key`` can share one stacked step: the client lr's schedule, or a loss weight
    the configured method declares ``SWEEPABLE``."""
    parts = key.split(".")
    if len(parts) != 3 or parts[:2] != ["model", "init_args"]:
        return False
    module, _, name = str(config["model"]["class_path"]).rpartition(".")
    method = getattr(import_module(module), name)
    return parts[2] in LR_KEYS or parts[2] in getattr(method, "SWEEPABLE", ())


def cohorts(settings: list[Setting], config: dict[str, Any]) -> tuple[list[list[Setting]], list[str]]:
    """The settings grouped by the values of the keys one stacked step cannot map (each group one cohort),
    and those keys."""
    keys = [key for key, _ in settings[0].values]
    fixed = [key for key in keys if "model" in keys or not mappable(key, config)]
    groups: dict[tuple[str, ...], list[Setting]] = {}
    for setting in settings:
        values = dict(setting.values)
        groups.setdefault(tuple(values[k] for k in fixed), []).append(setting)
    return list(groups.values()), fixed


def check_settings(runs: dict[tuple[str, int], list[str]], settings: list[Setting]) -> None:
    """Build every setting's first run as its ``fedrcl fit`` would (model, data module, trainer; nothing
    written), so that a value the config refuses stops the sweep before anything trains, naming the setting
    and the key (``fedrcl.cli.report_user_error``); exit status 2."""
    import contextlib
    import io
    import logging

    from fedrcl.cli import report_user_error, split_ckpt_path
    from fedrcl.lightning_cli import build_cli

    for setting in settings:
        args = split_ckpt_path(next(a for (name, _), a in runs.items() if name == setting.name))[0]
        logging.disable(logging.INFO)  # Lightning's "Seed set", "GPU available" once per setting
        try:
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                build_cli(args, run=False)
        except SystemExit:  # the parser's refusal, printed to stderr
            print(f"fedrcl sweep: setting {setting.name} ({shlex.join(setting.overrides())}) refused (above); "
                  "nothing trained", file=sys.stderr)
            raise SystemExit(2) from None
        except Exception as error:  # noqa: BLE001 (a constructor's refusal of a value)
            if not report_user_error(error, prog=f"fedrcl sweep: setting {setting.name}", argv=args):
                raise
            raise SystemExit(2) from None
        finally:
            logging.disable(logging.NOTSET)


def resumable(runs: dict[tuple[str, int], list[str]], labels: dict[tuple[str, int], str], where: Path,
              rounds: int) -> dict[tuple[str, int], list[str]]:
    """With ``--ckpt_path last``: a run whose folder already logged round ``rounds`` (every run's budget) is done
    and left out (said), checkpoint or not, so a finished run kept without its checkpoints (its event files
    committed, say) is not trained again; a run whose folder holds no checkpoint starts anew (said), as
    ``fedrcl seeds --together`` starts it, also where the runs train one after another (``fedrcl fit`` would
    refuse)."""
    from fedrcl.analysis.catalogue import collect_runs
    from fedrcl.cli import split_ckpt_path

    out = {}
    for key, args in runs.items():
        rest, ckpt_path = split_ckpt_path(args)
        folder = where / key[0] / f"seed{key[1]}"
        if ckpt_path == "last" and rounds and folder.is_dir():
            logged = max((run.rounds_logged for run in collect_runs(folder)), default=0)
            if logged >= rounds:
                print(f"fedrcl sweep: {labels[key]}: done (round {logged} logged in {folder}); left out",
                      flush=True)
                continue
        if ckpt_path == "last" and not any(folder.glob("version_*/checkpoints/*.ckpt")):
            print(f"fedrcl sweep: {labels[key]}: no checkpoint in {folder}; it starts at round 1", flush=True)
            args = rest
        out[key] = args
    return out


def run_sweep(groups: list[list[Setting]], runs: dict[tuple[str, int], list[str]],
              labels: dict[tuple[str, int], str], together: bool, stop: Any) -> Outcome:
    """Each group's runs (together: as one cohort; else one after another); a stop signal ends the runs in
    progress after their round and starts no other group."""
    from fedrcl.seeds import _run_in_process, _run_together

    outcome = Outcome()
    for group in groups:
        names = {s.name for s in group}
        mine = {key: args for key, args in runs.items() if key[0] in names}
        if not mine:  # every run of the group done (--ckpt_path last)
            continue
        if outcome.signum is None and stop.signum is not None:  # came between two groups
            outcome.signum = stop.signum
        if outcome.signum is not None:  # a fit in this process may have taken the signal itself (Preempted)
            outcome.not_started += list(mine)
            continue
        done = (_run_together if together else _run_in_process)(mine, stop, labels, "fedrcl sweep")
        outcome.failed += done.failed
        outcome.stopped += done.stopped
        outcome.not_started += done.not_started
        if done.signum is not None:
            outcome.signum, outcome.where = done.signum, done.where
    return outcome


def main(argv: Optional[list[str]] = None) -> None:
    """``fedrcl sweep (--grid KEY=V1,V2 ... | --random N --space KEY=V1,V2 ...) --seeds K ... [--rounds R]
    [--together] FIT_ARGS...``."""
    usage = ("fedrcl sweep (--grid KEY=V1,V2[,...] [KEY=...] | --random N --space KEY=V1,V2,... [--sample_seed S]) "
             "--seeds K [K ...] [--rounds R] [--together] FIT_ARGS...")
    parser = argparse.ArgumentParser(
        prog="fedrcl sweep", usage=usage,
        description="A grid or random search over config keys: one run per (setting, seed), each in its own run "
                    "folder <name>/<setting>/seed<k>; with --together, the settings that differ only in the "
                    "client lr or a sweepable loss weight train as one program.",
        epilog="Any other argument goes to every `fedrcl fit` (see `fedrcl fit --help`).")
    parser.add_argument("--grid", nargs="+", metavar="KEY=V1,V2", help="every combination of these values")
    parser.add_argument("--random", type=int, metavar="N", help="N settings drawn from --space")
    parser.add_argument("--space", nargs="+", metavar="KEY=V1,V2", help="the values --random draws from")
    parser.add_argument("--sample_seed", type=int, default=0, help="the seed of --random's draw (default 0)")
    parser.add_argument("--seeds", type=int, nargs="+", required=True, help="the seeds of every setting, e.g. 0 1")
    parser.add_argument("--rounds", type=int, help="rounds of every run (default: the config's trainer.rounds)")
    parser.add_argument("--together", action="store_true",
                        help="train the runs of settings that differ only in the client lr or a loss weight "
                             "the method declares sweepable as one program, all their clients in one step")
    args, fit_args = parser.parse_known_args(argv)
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
    if (args.grid is None) == (args.random is None):
        parser.error("give --grid KEY=V1,V2 ... or --random N --space KEY=V1,V2 ...")
    if (args.random is None) != (args.space is None):
        parser.error("--random N and --space KEY=V1,V2 ... go together")
    outside = [seed for seed in args.seeds if not 0 <= seed < SEED_LIMIT]
    if outside:
        parser.error(f"--seeds {outside[0]}: a seed must be 0 <= seed < 2**32")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds has repeated seeds: {args.seeds}")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if "--print_config" in fit_args or any(a.startswith("--print_config=") for a in fit_args):
        parser.error("--print_config: use `fedrcl fit ... --print_config` for one run")
    option = "--grid" if args.grid is not None else "--space"
    config = resolved_config(fit_args)
    try:
        save_dir, name, _ = run_name(config)
        given = parse_axes(args.grid or args.space, option)
        axes: dict[str, list[str]] = {}
        for key, values in given.items():
            try:
                full = canonical_key(config, key)
            except SweepError as error:
                raise SweepError(f"{option} {error}") from None
            if full in axes:
                raise SweepError(f"{option} {key}: the key is given twice ({full})")
            axes[full] = values
        settings = settings_of(axes, short_names(list(axes)), args.random, args.sample_seed)
    except ValueError as error:  # a SweepError, or run_name's logger without a name
        parser.error(str(error))
    rounds = [] if args.rounds is None else ["--trainer.rounds", str(args.rounds)]
    runs = {(s.name, seed): fit_args_for_seed([*fit_args, *s.overrides(), *rounds], config, seed, folder=s.name)
            for s in settings for seed in args.seeds}
    labels = {key: f"{key[0]} seed {key[1]}" for key in runs}
    check_settings(runs, settings)
    where = Path(save_dir) / name
    per_run = int(args.rounds or (config.get("trainer") or {}).get("rounds") or 0)  # FederatedTrainer's own
    print(f"fedrcl sweep: {len(settings)} settings x {len(args.seeds)} seeds = {len(runs)} runs of {per_run} rounds "
          f"({len(runs) * per_run} run-rounds) in {where}/<setting>/seed<k>: {', '.join(s.name for s in settings)}",
          flush=True)
    groups: list[list[Setting]] = [[s] for s in settings]
    if args.together:
        groups, fixed = cohorts(settings, config)
        if fixed:
            print(f"fedrcl sweep: --together: {', '.join(fixed)} cannot differ between runs of one stacked step "
                  "(only the client lr, its decays and the method's sweepable loss weights can): the settings of "
                  f"each of its {len(groups)} values train together, one value after another", flush=True)
    runs = resumable(runs, labels, where, per_run)
    from fedrcl.federated.preemption import StopSignal

    with StopSignal() as stop:
        outcome = run_sweep(groups, runs, labels, args.together, stop)
    if outcome.failed:
        print(f"fedrcl sweep: runs {[labels[k] for k in outcome.failed]} failed; the others are in "
              f"{where}/<setting>/seed<k>", file=sys.stderr)
    if outcome.signum is not None:
        from fedrcl.cli import split_ckpt_path

        own = [*(["--grid", *args.grid] if args.grid else ["--random", str(args.random), "--space", *args.space,
                                                           "--sample_seed", str(args.sample_seed)]),
               "--seeds", *map(str, args.seeds), *(["--rounds", str(args.rounds)] if args.rounds else []),
               *(["--together"] if args.together else [])]
        resume = shlex.join(["fedrcl", "sweep", *own, *split_ckpt_path(fit_args)[0], "--ckpt_path", "last"])
        print(f"fedrcl sweep: stopped by {signal.Signals(outcome.signum).name}{outcome.where}; stopped after a "
              f"round: {[labels[k] for k in outcome.stopped] or 'none'}, not started: "
              f"{[labels[k] for k in outcome.not_started] or 'none'}; resume: {resume}", file=sys.stderr, flush=True)
        raise SystemExit(128 + outcome.signum)
    if outcome.failed:
        raise SystemExit(1)
    print(f"fedrcl sweep: {len(runs)} runs in {where}/<setting>/seed<k>; summary: fedrcl report {where}", flush=True)
