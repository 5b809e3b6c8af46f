"""Progress of a federated run: a bar per round on a terminal, one line per round in a log file or pipe, and
a closing summary.

``round_progress()`` picks the one that fits ``sys.stdout`` (where Lightning's tqdm draws the bar; the lines go to
``sys.stderr``): a redrawn bar is what a terminal wants, but in a log file every redraw is a new line (498 KB for the 60-round quickstart). With
``--trainer.enable_progress_bar false`` a run still prints its line per round (``RoundLog``), unless its
logger is off too (``--trainer.logger false``). Each shows the rounds done of the run's total, the time this
fit has run and an estimate of the time left (``RunClock``: the mean round of this fit so far, read once per
round from the host clock, never from the device). The fit ends in a summary (``run_summary``): why it
stopped early if it did (EarlyStopping, ``trainer.max_time``, another callback), the rounds done, the final
``val/acc`` and ``val/acc_ema``, the run folder and the last checkpoint. A run stopped by a signal adds the
line that says how to resume (``fedrcl.federated.preemption``); a diverged run ends in its error instead.

A round can take minutes (a GPU-sized config on a CPU: 23 minutes for round 1), so the first round of a fit
is timed from its first steps: without a terminal, one line (``first_steps_line``) comes once the round has
run ``FIRST_LINE_SECONDS``, with the pace and the round's and the run's estimated time; and a run estimated
at more than ``LONG_RUN_SECONDS`` on this accelerator says so once (``long_run_warning``), with the CPU-scale
configs of its data set (``configs/cpu/``) when it runs on a CPU.

``quiet_lightning()`` silences what Lightning prints that says nothing about a federated run: the tip to
install another logging product, the ``LeafSpec`` deprecation raised inside Lightning itself (torch 2.10+),
the advice to lower ``log_every_n_steps`` (a round's metrics are logged once per round, whatever the step
count), and ``Trainer.fit stopped: max_epochs=N reached`` (the summary says it in rounds). Lightning's other
lines stay: the seed, the devices, the checkpoint a run restores from. ``WeightsSummary`` is Lightning's
model summary without the columns that are wrong for a federated run (see there).
"""
from __future__ import annotations

import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import yaml
from lightning.pytorch.callbacks import EarlyStopping, ModelSummary, ProgressBar, Timer, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.utilities.model_summary import get_human_readable_count, summarize
from torchmetrics import Metric

from fedrcl.data.validation import ACCURACIES

__all__ = ["RoundProgressBar", "RoundLines", "RoundLog", "RoundReport", "RunClock", "WeightsSummary",
           "cpu_scale_configs", "first_steps_line", "long_run_warning", "round_progress", "run_seconds",
           "run_summary", "stop_reason", "quiet_lightning"]
summary_log = logging.getLogger("lightning.pytorch.callbacks.model_summary")  # where Lightning's summary goes


def duration(seconds: float) -> str:
    """``75`` -> ``1:15``, ``3725`` -> ``1:02:05``."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def days_or_duration(seconds: float) -> str:
    """``duration`` up to two days, then in days: ``700000`` -> ``8.1 days``."""
    return f"{seconds / 86400:.1f} days" if seconds >= 2 * 86400 else duration(seconds)


LONG_RUN_SECONDS = 24 * 3600  # a run estimated longer than a day here is worth a warning
FIRST_LINE_SECONDS = 5.0  # without a terminal, the first round says how it goes after this long


def run_seconds(step_seconds: float, steps_per_round: int, rounds: int, steps_done: int = 0) -> float:
    """The training time of ``rounds`` rounds of ``steps_per_round`` steps at ``step_seconds`` a step, less
    the ``steps_done`` already trained (evaluation comes on top)."""
    return step_seconds * max(steps_per_round * rounds - steps_done, 0)


def cpu_scale_configs(dataset: str, folder: Optional[Path] = None) -> list[str]:
    """The configs under ``configs/cpu/`` (``folder``) that train ``dataset``: the CPU-scale settings of the
    paper's protocol (docs/results.md), as paths from the working folder where it holds them."""
    folder = folder if folder is not None else Path(__file__).resolve().parents[2] / "configs" / "cpu"
    found = []
    for path in sorted(folder.glob("*.yaml")):
        try:
            config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):
            continue
        if (config.get("data") or {}).get("dataset") == dataset:
            try:
                found.append(str(path.resolve().relative_to(Path.cwd().resolve())))
            except ValueError:
                found.append(str(path))
    return found


def long_run_warning(seconds: float, pace: str, accelerator: str, dataset: Optional[str],
                     configs: Optional[list[str]] = None) -> Optional[str]:
    """``fedrcl: warning: ...`` for a run estimated at ``seconds`` (``pace``: how the estimate was made) when
    that is more than ``LONG_RUN_SECONDS``, else ``None``. On a CPU it names the CPU-scale configs of
    ``dataset`` (``cpu_scale_configs`` unless ``configs`` is given)."""
    if seconds <= LONG_RUN_SECONDS:
        return None
    line = (f"fedrcl: warning: this run would train for about {days_or_duration(seconds)} on this {accelerator} "
            f"({pace}; evaluation comes on top): a GPU-sized config?")
    if accelerator != "cpu":
        return line
    configs = cpu_scale_configs(dataset) if configs is None and dataset else configs or []
    if configs:
        return f"{line} The CPU-scale setting of {dataset}: {', '.join(configs)}"
    return (f"{line} configs/cpu/ has no CPU-scale config of {dataset}; fewer rounds (--trainer.rounds) or a "
            "narrower backbone (fedrcl.models.ResNet18 with width 8) shorten it")


class RunClock:
    """The wall time of this fit and of its current round, and the time its remaining rounds will take at the
    mean pace of the rounds it has trained (a resumed run counts from its resume). Read from the host clock
    once per round: nothing here waits for the device."""

    def __init__(self) -> None:
        self._fit_start = self._round_start = time.perf_counter()
        self._first_round = 0

    def fit_started(self, trainer: L.Trainer) -> None:
        self._fit_start, self._first_round = time.perf_counter(), trainer.current_epoch

    def round_started(self) -> None:
        self._round_start = time.perf_counter()

    def round_seconds(self) -> float:
        return time.perf_counter() - self._round_start

    def elapsed(self) -> float:
        return time.perf_counter() - self._fit_start

    def timing(self, trainer: L.Trainer, done: int) -> str:
        """``elapsed 1:15, left 6:20`` after ``done`` rounds of ``trainer.max_epochs`` (``left ?`` before the
        first round of this fit has ended)."""
        trained, elapsed = done - self._first_round, self.elapsed()
        total = trainer.max_epochs
        assert total is not None  # trainer.rounds (Lightning's fit sets a default otherwise)
        left = duration(elapsed / trained * (total - done)) if trained > 0 else "?"
        return f"elapsed {duration(elapsed)}, left {left}"


def round_line(trainer: L.Trainer, metrics: dict[str, Any], clock: RunClock) -> str:
    """``Round 12/60  val/acc 0.9306  val/acc_ema 0.8812  (0.41 s; elapsed 0:05, left 0:20)``."""
    shown = {k: v for k, v in metrics.items() if k != "v_num"}
    text = "".join(f"  {k} {v:.4f}" if isinstance(v, float) else f"  {k} {v}" for k, v in shown.items())
    done = trainer.current_epoch + 1
    return (f"Round {done}/{trainer.max_epochs}{text}  ({clock.round_seconds():.2f} s; "
            f"{clock.timing(trainer, done)})")


def stop_reason(trainer: L.Trainer) -> Optional[str]:
    """Why a fit trained fewer rounds than ``trainer.rounds`` (``None`` if it did not): EarlyStopping (its own
    words), ``trainer.max_time``, or another callback that set ``trainer.should_stop``. A signal and a
    divergence have their own line (``Preempted``, ``DivergenceError``)."""
    done, total = trainer.current_epoch, trainer.max_epochs
    assert total is not None  # trainer.rounds (Lightning's fit sets a default otherwise)
    if done >= total or not trainer.should_stop:
        return None
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector
        if isinstance(callback, EarlyStopping) and callback.stopped_epoch == done - 1 \
                and callback.stopping_reason_message:
            return f"EarlyStopping: {' '.join(callback.stopping_reason_message.split())}"
        left = callback.time_remaining() if isinstance(callback, Timer) else None
        if left is not None and left <= 0:
            return f"trainer.max_time reached ({duration(callback.time_elapsed())} of training)"
    privacy = getattr(getattr(trainer, "federation", None), "privacy", None)  # trainer.privacy's budget
    if privacy is not None and privacy.budget_spent():
        return f"trainer.privacy.init_args.max_epsilon {privacy.max_epsilon}: epsilon {privacy.epsilon:.4g} spent"
    signal = getattr(trainer._signal_connector, "signum", None)
    return None if signal else "a callback set trainer.should_stop"


def run_summary(trainer: L.Trainer, clock: RunClock) -> str:
    """The lines a fit ends with, for example::

        fedrcl: stopped early after round 3/60: EarlyStopping: Monitored metric val/acc did not improve ...
        fedrcl: 3/60 rounds in 0:04; val/acc 0.9306, val/acc_ema 0.8812
          run folder: runs/quickstart/version_0
          checkpoint: runs/quickstart/version_0/checkpoints/last.ckpt

    The first only when the fit trained fewer rounds than ``trainer.rounds`` (``stop_reason``).
    """
    done, lines = trainer.current_epoch, []
    reason = stop_reason(trainer)
    if reason:
        lines.append(f"fedrcl: stopped early after round {done}/{trainer.max_epochs}: {reason}")
    values = trainer.callback_metrics
    metrics = [f"{k} {float(values[k]):.4f}" for k in (*ACCURACIES, "privacy/epsilon") if k in values]
    lines.append(f"fedrcl: {done}/{trainer.max_epochs} rounds in {duration(clock.elapsed())}"
                 + (f"; {', '.join(metrics)}" if metrics else ""))
    from fedrcl.federated.run_folder import logger_folder  # where its checkpoints are, for any logger

    folder = logger_folder(trainer, trainer.logger) if trainer.logger is not None else None
    lines.append(f"  run folder: {folder or trainer.default_root_dir}")
    checkpoints = [path for c in trainer.checkpoint_callbacks if (path := getattr(c, "last_model_path", ""))]
    if checkpoints:
        lines.append(f"  checkpoint: {checkpoints[0]}")
    return "\n".join(lines)


def first_steps_line(trainer: L.Trainer, steps: int, step_seconds: float, elapsed: float) -> str:
    """``Round 1/1000  step 6/250 in 0:06  (1.04 s a step; round about 4:20, run about 3.0 days)``."""
    total, rounds = trainer.num_training_batches, trainer.max_epochs
    assert isinstance(total, int) and rounds is not None  # a round's steps and trainer.rounds, during fit
    left = run_seconds(step_seconds, total, rounds - trainer.current_epoch, steps)
    return (f"Round {trainer.current_epoch + 1}/{rounds}  step {steps}/{total} in {duration(elapsed)}  "
            f"({step_seconds:.3g} s a step; round about {duration(step_seconds * total)}, run about "
            f"{days_or_duration(left)})")


class RoundReport:
    """What the three progress callbacks share: the run's clock, started with training; the pace of the
    fit's first round, from its first steps (a line without a terminal, ``print_first_steps``; a warning for a
    run of more than a day, ``long_run_warning``); and the summary the fit ends with (on rank 0)."""

    clock: RunClock
    print_first_steps = True  # without a terminal: the progress bar shows the steps itself

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.clock.fit_started(trainer)
        self._pace_said = not trainer.is_global_zero
        self._first_step_end: Optional[float] = None

    def first_steps(self, trainer: L.Trainer, batch_idx: int) -> None:
        """After each step of the fit's first round until its pace is said: the first step ends the warm-up;
        ``FIRST_LINE_SECONDS`` into the round (and at least one step later), the pace of the steps since."""
        if getattr(self, "_pace_said", True):
            return
        now = time.perf_counter()
        if self._first_step_end is None:
            self._first_step_end = now
            return
        elapsed = self.clock.round_seconds()
        if elapsed < FIRST_LINE_SECONDS:
            return
        self._pace_said = True
        step_seconds, total, rounds = (now - self._first_step_end) / batch_idx, trainer.num_training_batches, \
            trainer.max_epochs
        if not isinstance(total, int) or rounds is None:  # a round of unknown length: no estimate
            return
        if self.print_first_steps:
            print(first_steps_line(trainer, batch_idx + 1, step_seconds, elapsed), file=sys.stderr, flush=True)
        seconds = run_seconds(step_seconds, total, rounds - trainer.current_epoch, batch_idx + 1)
        self._warn_if_long(trainer, seconds, f"{step_seconds:.3g} s a step measured, {total} steps a round, "
                                             f"{rounds} rounds")

    def first_round_done(self, trainer: L.Trainer) -> None:
        """At the end of the fit's first round, if it was too short to say its pace: from its duration."""
        if getattr(self, "_pace_said", True):
            return
        self._pace_said = True
        assert trainer.max_epochs is not None  # an int during fit
        seconds = self.clock.round_seconds()
        self._warn_if_long(trainer, seconds * (trainer.max_epochs - trainer.current_epoch - 1),
                           f"{duration(seconds)} for round {trainer.current_epoch + 1}, "
                           f"{trainer.max_epochs} rounds")

    def _warn_if_long(self, trainer: L.Trainer, seconds: float, pace: str) -> None:
        accelerator = type(trainer.accelerator).__name__.removesuffix("Accelerator").lower()
        dataset = getattr(getattr(trainer, "datamodule", None), "dataset", None)
        warning = long_run_warning(seconds, pace, accelerator, dataset if isinstance(dataset, str) else None)
        if warning:
            print(warning, file=sys.stderr, flush=True)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            print(run_summary(trainer, self.clock), file=sys.stderr, flush=True)


class RoundProgressBar(RoundReport, TQDMProgressBar):
    """Lightning's progress bar, labelled by round (and never by Lightning's 0-based epoch), with the run's
    elapsed time and time left; redrawn at most every ``REDRAW_SECONDS`` and at each round's last step."""

    REDRAW_SECONDS = 0.1
    print_first_steps = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock = RunClock()
        self._redrawn = float("-inf")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Lightning's redraw, throttled: at every step it formats the bar and its metrics (about 840 Python
        calls a step, where the rest of Lightning's step loop makes about 1,500), faster than anyone reads."""
        self.first_steps(trainer, batch_idx)
        bar, now = self.train_progress_bar, time.perf_counter()
        if bar is not None and batch_idx + 1 < bar.total and now - self._redrawn < self.REDRAW_SECONDS:
            return
        self._redrawn = now
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        TQDMProgressBar.on_train_start(self, trainer, pl_module)
        RoundReport.on_train_start(self, trainer, pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        self.clock.round_started()
        bar = self.train_progress_bar
        # Label first, then reset: reset() draws the bar, which in a log file is a line of its own.
        bar.set_description(f"Round {trainer.current_epoch + 1}/{trainer.max_epochs} "
                            f"({self.clock.timing(trainer, trainer.current_epoch)})", refresh=False)
        bar.reset(total=convert_inf(self.total_train_batches))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self.first_round_done(trainer)


class RoundLines(RoundReport, ProgressBar):
    """One line per round on stderr, after the round's evaluation::

        Round 12/60  val/acc 0.9306  val/acc_ema 0.8812  (0.41 s; elapsed 0:05, left 0:20)

    The metrics are the progress bar's (``prog_bar=True`` logs); evaluation runs print nothing here
    (Lightning prints their result table).
    """

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self.clock = RunClock()

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.clock.round_started()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._enabled:
            self.first_steps(trainer, batch_idx)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._enabled:
            print(round_line(trainer, self.get_metrics(trainer, pl_module), self.clock), file=sys.stderr,
                  flush=True)
            self.first_round_done(trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._enabled:
            super().on_fit_end(trainer, pl_module)


class RoundLog(RoundReport, L.Callback):
    """``RoundLines`` for a run without a progress bar (Lightning refuses a ``ProgressBar`` callback then)."""

    def __init__(self) -> None:
        self.clock = RunClock()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.clock.round_started()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.first_steps(trainer, batch_idx)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = {k: v.item() if hasattr(v, "item") else v for k, v in trainer.progress_bar_metrics.items()}
        if trainer.is_global_zero:
            print(round_line(trainer, metrics, self.clock), file=sys.stderr, flush=True)
        self.first_round_done(trainer)


def round_progress(enable_progress_bar: Optional[bool] = True, logger: Any = None) -> Optional[L.Callback]:
    """A ``RoundProgressBar`` when stdout (where it draws) is a terminal, else ``RoundLines``; without a progress
    bar, ``RoundLog`` (``None`` if the logger is off too)."""
    if enable_progress_bar is False:
        return None if logger is False else RoundLog()
    isatty = getattr(sys.stdout, "isatty", None)
    return RoundProgressBar() if isatty is not None and isatty() else RoundLines()


class WeightsSummary(ModelSummary):
    """Lightning's model summary of the modules that hold the model's weights and their sizes.

    Lightning's own also lists metric objects (``val_acc``, a ``MulticlassAccuracy`` with no weights, shown in
    Mode ``train``) and FLOPs, which it counts only from a LightningModule's ``example_input_array``; fedrcl's
    methods have none, so it printed ``Total FLOPs: 0``. Neither is shown here, nor a module's train/eval mode
    (the round loop sets it per client and per evaluation)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._max_depth or not trainer.is_global_zero:
            return
        summary = summarize(pl_module, max_depth=self._max_depth)
        rows = [(name, type(module).__name__, get_human_readable_count(sum(p.numel() for p in module.parameters())))
                for name, module in summary.named_modules if not isinstance(module, Metric)]
        widths = [max(len(row[i]) for row in [("Name", "Type", "Params"), *rows]) for i in range(3)]
        table = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in [("Name", "Type", "Params"), *rows]]
        table.insert(1, "-" * len(table[0]))
        frozen = summary.total_parameters - summary.trainable_parameters
        table += [f"{get_human_readable_count(summary.trainable_parameters):<10}Trainable params",
                  f"{get_human_readable_count(frozen):<10}Non-trainable params",
                  f"{get_human_readable_count(summary.total_parameters):<10}Total params",
                  f"{summary.model_size:<10,.3f}Total estimated model params size (MB)"]
        summary_log.info("\n" + "\n".join(table))


class _LightningNoise(logging.Filter):
    """Lightning's lines that say nothing about a federated run (``quiet_lightning``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith("\N{ELECTRIC LIGHT BULB} Tip:")
                    or message.startswith("`Trainer.fit` stopped: `max_epochs="))


def quiet_lightning() -> None:
    """Silence Lightning's lines that are noise for a federated run (see the module docstring); idempotent."""
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _LightningNoise) for f in log.filters):
        log.addFilter(_LightningNoise())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings("ignore", message=r".*is smaller than the logging interval Trainer\(log_every_n_steps")
