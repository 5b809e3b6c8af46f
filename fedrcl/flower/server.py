"""The fedrcl ServerApp: the strategy's rounds, central evaluation, and the run folder of ``fedrcl fit``.

``run_federation(grid, args)`` builds the run from fedrcl's arguments exactly as ``fedrcl fit`` does (same
initial weights, split, server optimizer, logger), then runs ``FedrclStrategy.start``. After each round,
on the server: the global model is evaluated on the whole test set every ``trainer.eval_every`` rounds
(``val/acc`` and the accuracy EMA ``val/acc_ema``, the algorithm's own ``validation_step``); the round's
scalars go to the config's logger with the round as the step (``train/loss*``, ``train/lr``,
``time/round_seconds``, fedrcl's ``comm/*`` and ``time/*`` ledger, and ``flower/down_bytes`` /
``flower/up_bytes``, the bytes Flower's ArrayRecords carried); checkpoints are written every
``trainer.checkpoint_every`` rounds and after the last one. The run folder holds ``config.yaml`` and
``split.json`` as ``fedrcl fit`` writes them. ``--ckpt_path PATH`` (or ``last``) among the arguments resumes a
run from a checkpoint of a Flower run or of ``fedrcl fit`` (``resume``): the checks of ``fedrcl fit``,
then global weights, server memory, accuracy EMA, byte ledger and the client-state manifest are restored,
the rounds go on from the next one, and the scalars go to a new version folder of the run.
"""
from __future__ import annotations

import logging
import sys
import time
from logging import INFO, WARNING
from collections.abc import Sequence
from typing import Any, Optional

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.common import log
from flwr.common.logger import FLOWER_LOGGER, update_console_handler
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from fedrcl.analysis.layout import ACCURACY_FIRST, ScalarLayout
from fedrcl.cli import split_ckpt_path
from fedrcl.contract.exchange import check_method
from fedrcl.contract.weights import load_state_
from fedrcl.data.datamodule import EvalBatches
from fedrcl.federated.checkpoint import RoundCheckpoint, read_checkpoint, resume_path
from fedrcl.federated.federation import Federation
from fedrcl.federated.local_update import attach
from fedrcl.federated.preemption import Preemption
from fedrcl.federated.progress import RoundLines, RoundLog, RunClock, round_line, run_summary
from fedrcl.flower.config import Args, as_args, build, run_args
from fedrcl.flower.nodes import ClientFailure
from fedrcl.flower.strategy import FedrclStrategy


class MetricDumps(logging.Filter):
    """Drops Flower's dumps of every metric (a 40-line dict per round on the quickstart, and every round's
    again at the end, one line each): fedrcl logs one line per round instead (``round_line``), the numbers
    being in the run folder's scalars."""

    DUMPS = ("\t└──> Aggregated MetricRecord", "\t└──> MetricRecord", "Global evaluation",
             "Initial global evaluation results", "Final results:")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "\t%s" and not str(record.msg).startswith(self.DUMPS)


def quiet_flower_log() -> None:
    """Flower's log without its metric dumps (``MetricDumps``), once per process."""
    if not any(isinstance(f, MetricDumps) for f in FLOWER_LOGGER.filters):
        FLOWER_LOGGER.addFilter(MetricDumps())


def not_run(trainer) -> list[str]:
    """The config's callbacks that a Flower run does not call (its rounds are Flower's, not Lightning's),
    among them every ``RoundCallback``: their ``on_client_end`` would need the clients' local models, which
    stay on the nodes. The run says so, naming them, before it starts. fedrcl's own defaults are not named:
    the round's line and the TensorBoard layout are written here, and a signal to a Flower run is Flower's
    to handle (``Preemption`` is ``fedrcl fit``'s)."""
    kept = (SaveConfigCallback, ModelCheckpoint, ProgressBar, Federation, Preemption, ScalarLayout, RoundLog,
            RoundLines)
    return [type(c).__name__ for c in trainer.callbacks if not isinstance(c, kept)]


def evaluate(module, datamodule) -> float:
    """Top-1 accuracy of ``module``'s global model on the test set (its ``validation_step``), and the EMA."""
    module.eval()
    precision = module.trainer.precision_plugin  # the run's precision, as fit's evaluation loop applies it
    with torch.no_grad(), precision.val_step_context():
        for batch_idx, batch in enumerate(EvalBatches(datamodule)):
            module.validation_step(precision.convert_input(batch), batch_idx)
    module.train()
    acc = module.val_acc.compute().item()
    module.val_acc.reset()
    module.update_acc_ema(acc)
    return acc


def save_round(trainer, module, round_idx: int, steps: int, now: bool = False) -> bool:
    """Mark round ``round_idx`` done in the trainer's loop state (``global_step``: the clients' local steps so
    far), then let ``RoundCheckpoint`` write its files as at the end of a ``fedrcl fit`` round (while
    ``trainer.current_epoch`` is the round's index), so ``--ckpt_path last`` reads them; ``now``: write them
    whether due or not (a run that stops). Returns whether a round checkpoint was written."""
    loop = trainer.fit_loop
    loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = steps
    progresses = (loop.epoch_progress.current, loop.epoch_progress.total)
    for progress in progresses:
        progress.ready = progress.started = progress.processed = round_idx + 1
        progress.completed = round_idx
    written = any(isinstance(c, RoundCheckpoint) and (now or c.due(trainer)) for c in trainer.checkpoint_callbacks)
    for callback in trainer.checkpoint_callbacks:
        if now and isinstance(callback, RoundCheckpoint):
            callback.save(trainer)
        else:
            callback.on_train_epoch_end(trainer, module)
    for progress in progresses:
        progress.completed = round_idx + 1
    return written


def resume(trainer, module, path: str) -> tuple[int, int]:
    """Load checkpoint ``path`` into the server's objects as ``fedrcl fit`` resumes: the module (global
    weights, accuracy EMA, client-state manifest) and the federation (server memory, ledger, resume
    segments). Returns the next round's index and the local steps so far. Read with ``weights_only``, never
    executed."""
    checkpoint = read_checkpoint(path)
    module.load_state_dict(checkpoint["state_dict"])
    module.on_load_checkpoint(checkpoint)
    federation = trainer.federation
    federation.load_state_dict(checkpoint["callbacks"][federation.state_key])
    federation.on_train_start(trainer, module)  # a new segment if resume_allow_changes changed keys
    first_round = int(checkpoint["epoch"]) + 1
    loop = trainer.fit_loop
    for progress in (loop.epoch_progress.current, loop.epoch_progress.total):  # rounds done, as fit restores them
        progress.ready = progress.started = progress.processed = progress.completed = first_round
    return first_round, int(checkpoint["global_step"])


def run_federation(grid: Grid, args: Args, timeout: float = 3600.0, node_wait: float = 600.0,
                   restart_wait: float = 300.0):
    """Run fedrcl's federation ``args`` over ``grid``; returns the CLI objects (``cli.model`` holds the final
    global model) and the strategy. ``node_wait``: seconds to wait for nodes serving every client before
    the first round; ``restart_wait``: seconds a round waits for a lost node to come back (``Fleet``). A round
    that stops (a node not back in time, a client's error) stops the run with the last round's checkpoint
    written, and says so with the way to resume."""
    args, ckpt_path = split_ckpt_path(as_args(args))
    cli = build(args)
    module, dm, trainer = cli.model, cli.datamodule, cli.trainer
    check_method(module, trainer.federation.server)  # before anything is written
    quiet_flower_log()
    ignored = not_run(trainer)
    if ignored:
        log(WARNING, "fedrcl.flower does not run these trainer.callbacks: %s", ", ".join(ignored))
    path = resume_path(trainer, module, dm, ckpt_path) if ckpt_path is not None else None  # before any write
    attach(trainer, module, dm)
    trainer.state.fn, trainer.state.stage = TrainerFn.FITTING, RunningStage.TRAINING
    federation = trainer.federation
    federation.setup(trainer, module, "fit")  # the resume fingerprint kept in checkpoints
    first_round, steps = resume(trainer, module, path) if path is not None else (0, 0)
    for callback in trainer.callbacks:
        if isinstance(callback, SaveConfigCallback):
            callback.setup(trainer, module, "fit")  # config.yaml, as fedrcl fit writes it
    dm.export_split()  # split.json
    for callback in trainer.checkpoint_callbacks:
        callback.setup(trainer, module, "fit")
    for callback in trainer.callbacks:
        if isinstance(callback, ScalarLayout):
            callback.on_fit_start(trainer, module)  # TensorBoard's layout, val/acc first
    clients = range(dm.num_clients)
    strategy = FedrclStrategy(federation.server, [dm.client_num_samples(k) for k in clients],
                              federation.clients_per_round, federation.seed,
                              steps_per_epoch=[dm.client_steps_per_epoch(k) for k in clients],
                              local_epochs=federation.local_epochs, first_round=first_round,
                              node_wait=node_wait, algorithm=module, run_args=args, ledger=federation.ledger,
                              restart_wait=restart_wait)
    strategy.steps = steps
    strategy.kept = strategy.manifest()  # a resumed run's checkpoint refers to these files
    loggers = [(lg, getattr(lg.log_metrics, "__wrapped__", lg.log_metrics)) for lg in trainer.loggers]
    started = [time.perf_counter()]
    clock = RunClock()
    clock.fit_started(trainer)
    # the last round done, whether it was checkpointed, and its metrics
    last: dict[str, Any] = {"round": first_round - 1, "saved": True, "metrics": {}}

    def end_of_round(server_round: int, arrays: ArrayRecord) -> Optional[MetricRecord]:
        if server_round == 0:  # fedrcl does not evaluate the initial model
            return None
        round_idx = strategy.round_idx(server_round)
        load_state_(module.backbone, arrays.to_torch_state_dict())
        metrics = dict(strategy.train_metrics)
        metrics["train/lr"] = module.client_lr(round_idx, 0)
        metrics["time/round_seconds"] = time.perf_counter() - started[0]
        if (round_idx + 1) % trainer.check_val_every_n_epoch == 0:
            with strategy.ledger.timed("evaluation"):
                metrics["val/acc"] = evaluate(module, dm)
            metrics["val/acc_ema"] = module.acc_ema
        _, ledger = strategy.ledger.metrics()
        ledger.update({f"flower/{d}_bytes": float(n) for d, n in strategy.payload.items()})
        accuracy = {copy: metrics[tag] for tag, copy in ACCURACY_FIRST.items() if tag in metrics}
        for logger, log_metrics in loggers:  # before the round's checkpoint, as fedrcl fit does; TensorBoard
            first = accuracy if isinstance(logger, TensorBoardLogger) else {}  # opens on the accuracy copies
            log_metrics({**metrics, **ledger, **first}, step=round_idx + 1)
        shown: dict[str, Any] = {k: metrics[k] for k in ("val/acc", "val/acc_ema", "train/loss") if k in metrics}
        log(INFO, "%s  clients %s", round_line(trainer, shown, clock), strategy.clients)
        clock.round_started()
        last.update(round=round_idx, saved=save_round(trainer, module, round_idx, strategy.steps), metrics=metrics)
        if last["saved"]:
            strategy.kept = strategy.manifest()
        started[0] = time.perf_counter()
        return MetricRecord({k: float(v) for k, v in metrics.items()})

    try:
        strategy.start(grid, ArrayRecord.from_torch_state_dict(module.backbone.state_dict()),
                       num_rounds=trainer.max_epochs - first_round, timeout=timeout, evaluate_fn=end_of_round)
    except ClientFailure as failure:
        raise ClientFailure(f"{failure}\n{stopped(trainer, module, strategy, last)}") from None
    for logger in trainer.loggers:
        logger.finalize("success")
    log(INFO, "%s", run_summary(trainer, clock, last["metrics"]))  # the run folder, as fedrcl fit ends
    return cli, strategy


def stopped(trainer, module, strategy: FedrclStrategy, last: dict) -> str:
    """Checkpoint the last round done if its checkpoint was not due, flush the logs; say how to resume."""
    done = last["round"] >= strategy.first_round
    if done and not last["saved"]:
        save_round(trainer, module, last["round"], strategy.steps, now=True)
    for logger in trainer.loggers:
        logger.finalize("failed")
    if not done:
        return "No round was done in this run."
    path = trainer.checkpoint_callback.last_model_path if trainer.checkpoint_callback is not None else ""
    return (f"The run stopped after round {last['round'] + 1}, checkpoint {path}; resume with --ckpt_path last "
            "among fedrcl's arguments (python -m fedrcl.flower, or flwr run's fedrcl-args).")


def make_server_app(args: Optional[Args] = None, timeout: float = 3600.0, more: Sequence[Args] = (),
                    restart_wait: float = 300.0) -> ServerApp:
    """The ServerApp for fedrcl's arguments ``args`` (``None``: the run config's ``fedrcl-args``); ``more``:
    further runs, one after another on the same nodes (e.g. seeds, or methods compared). ``timeout``: seconds
    a round waits for its clients (the run config's ``round-timeout`` overrides it); a client that has not
    replied by then stops the run, named. ``restart_wait``: seconds a round waits for a lost node to come
    back (the run config's ``node-restart-wait`` overrides it)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        # Colour codes only on a terminal: under flwr run the ServerApp's output is streamed to flwr's log, a
        # file when redirected (Flower's handler colours by default).
        update_console_handler(colored=sys.stderr.isatty())
        wait = float(context.run_config.get("round-timeout", timeout))
        back = float(context.run_config.get("node-restart-wait", restart_wait))
        for run in (run_args(context.run_config, args), *more):
            run_federation(grid, run, timeout=wait, restart_wait=back)

    return app
