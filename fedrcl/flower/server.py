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

import contextlib
import logging
import signal
import sys
import threading
import time
from logging import INFO, WARNING
from collections.abc import Sequence
from typing import Optional

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.app.exception import AppExitException
from flwr.serverapp import Grid, ServerApp
from flwr.common import log
from flwr.common.logger import FLOWER_LOGGER, update_console_handler
from flwr.supercore.exit import ExitCode

from fedrcl.cli import split_ckpt_path
from fedrcl.contract.exchange import check_method
from fedrcl.contract.weights import load_state_
from fedrcl.federated.checkpoint import resume_path
from fedrcl.federated.driven import DrivenRun, evaluate, not_run, open_run
from fedrcl.flower.config import Args, as_args, build, run_args
from fedrcl.flower.nodes import ClientFailure
from fedrcl.flower.secure_aggregation import SecureAggregation
from fedrcl.flower.strategy import FedrclStrategy
from fedrcl.federated.preemption import StopSignal


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


class ServerAppStopped(AppExitException):
    """A deployment's ServerApp (``flwr-serverapp``) stopped by SIGTERM or Ctrl-C after a round, checkpointed:
    raised so that Flower's own exit runs (the run's last log lines, the stop's among them, uploaded and its
    status pushed); a bare ``SystemExit`` skipped it, and ``flwr run --stream`` never showed where the run stopped."""

    exit_code = ExitCode.GRACEFUL_EXIT_SIGTERM


class RunStopped(Exception):
    """The run stops after a round: ``trainer.max_time``, the privacy budget, or a stop signal (``signum``)."""

    def __init__(self, signum: Optional[int] = None):
        super().__init__(signum)
        self.signum = signum


def run_federation(grid: Grid, args: Args, timeout: float = 3600.0, node_wait: float = 600.0,
                   restart_wait: float = 300.0, stop: Optional[StopSignal] = None,
                   secure: Optional[SecureAggregation] = None):
    """Run fedrcl's federation ``args`` over ``grid``; returns the CLI objects (``cli.model`` holds the final
    global model) and the strategy. ``node_wait``: seconds to wait for nodes serving every client before
    the first round; ``restart_wait``: seconds a round waits for a lost node to come back (``Fleet``). A round
    that stops (a node not back in time, a client's error) stops the run with the last round's checkpoint
    written, and says so with the way to resume. The round's end is ``DrivenRun``'s, as for seeds together:
    ``trainer.max_time``, ``max_epsilon`` and a stop signal recorded by ``stop`` (SIGTERM, Ctrl-C) end the run
    after a round, checkpointed, saying how to resume; the caller then stops (``make_server_app``).
    ``secure``: each round's sum through Flower's SecAgg+ (``fedrcl.flower.secure_aggregation``; a method it cannot
    serve is refused here, before anything is written)."""
    args, ckpt_path = split_ckpt_path(as_args(args))
    cli = build(args)
    module, dm, trainer = cli.model, cli.datamodule, cli.trainer
    check_method(module, trainer.federation.server)  # before anything is written
    if secure is not None:
        secure.check_method(module, trainer.federation.privacy)
        secure.check_run(trainer.federation.clients_per_round)
    quiet_flower_log()
    ignored = not_run(trainer)
    if ignored:
        log(WARNING, "fedrcl.flower does not run these trainer.callbacks: %s", ", ".join(ignored))
    path = resume_path(trainer, module, dm, ckpt_path) if ckpt_path is not None else None  # before any write
    first_round, steps = open_run(trainer, module, dm, path)
    federation = trainer.federation
    run = DrivenRun(trainer, module, dm, say=lambda line: log(INFO, "%s", line), next_round=first_round,
                    steps=steps)
    run.open()
    clients = range(dm.num_clients)
    strategy = FedrclStrategy(federation.server, [dm.client_num_samples(k) for k in clients],
                              federation.clients_per_round, federation.seed,
                              steps_per_epoch=[dm.client_steps_per_epoch(k) for k in clients],
                              local_epochs=federation.local_epochs, first_round=first_round,
                              node_wait=node_wait, algorithm=module, run_args=args, ledger=federation.ledger,
                              restart_wait=restart_wait, privacy=federation.privacy, round_started=run.begin_round,
                              secure=secure)
    strategy.steps = steps
    strategy.kept = strategy.manifest()  # a resumed run's checkpoint refers to these files
    started = [time.perf_counter()]
    privacy, rounds = federation.privacy, trainer.max_epochs - first_round
    if privacy is not None:  # trainer.privacy.init_args.max_epsilon: the rounds within the budget
        rounds = privacy.rounds_left(rounds)

    def end_of_round(server_round: int, arrays: ArrayRecord) -> Optional[MetricRecord]:
        if server_round == 0:  # fedrcl does not evaluate the initial model
            return None
        round_idx = strategy.round_idx(server_round)
        load_state_(module.backbone, arrays.to_torch_state_dict())
        accuracies = None
        if (round_idx + 1) % trainer.check_val_every_n_epoch == 0:
            with strategy.ledger.timed("evaluation"):
                accuracies = evaluate(module, dm)
        payload = {f"flower/{d}_bytes": float(n) for d, n in strategy.payload.items()}
        metrics = run.end_round(strategy.steps - run.steps, dict(strategy.train_metrics),
                                time.perf_counter() - started[0], accuracies, payload)
        if run.saved:
            strategy.kept = strategy.manifest()
        started[0] = time.perf_counter()
        signum = stop.signum if stop is not None else None
        if run.stopped is not None or (signum is not None and not run.done):
            raise RunStopped(signum)
        return MetricRecord({k: float(v) for k, v in metrics.items()})

    try:
        strategy.start(grid, ArrayRecord.from_torch_state_dict(module.backbone.state_dict()),
                       num_rounds=rounds, timeout=timeout, evaluate_fn=end_of_round)
    except ClientFailure as failure:
        raise ClientFailure(f"{failure}\n{stopped(run)}") from None
    except RunStopped as stopping:
        run.close(stopping=stopping.signum is not None)
        if stopping.signum is not None:
            log(WARNING, "%s: %s", signal.Signals(stopping.signum).name, stopped(run))
        return cli, strategy
    run.close()
    return cli, strategy


def stopped(run: DrivenRun) -> str:
    """Checkpoint the last round done if its checkpoint was not due, flush the logs; say how to resume."""
    run.checkpoint_now()
    for logger in run.trainer.loggers:
        logger.finalize("failed")
    if not run.metrics:  # no round ended in this run
        return "No round was done in this run."
    trainer = run.trainer
    path = trainer.checkpoint_callback.last_model_path if trainer.checkpoint_callback is not None else ""
    return (f"The run stopped after round {run.next_round}, checkpoint {path}; resume with --ckpt_path last "
            "among fedrcl's arguments (python -m fedrcl.flower, or flwr run's fedrcl-args).")


def make_server_app(args: Optional[Args] = None, timeout: float = 3600.0, more: Sequence[Args] = (),
                    restart_wait: float = 300.0, stop: Optional[StopSignal] = None) -> ServerApp:
    """The ServerApp for fedrcl's arguments ``args`` (``None``: the run config's ``fedrcl-args``); ``more``:
    further runs, one after another on the same nodes (e.g. seeds, or methods compared). ``timeout``: seconds
    a round waits for its clients (the run config's ``round-timeout`` overrides it); a client that has not
    replied by then stops the run, named. ``restart_wait``: seconds a round waits for a lost node to come
    back (the run config's ``node-restart-wait`` overrides it). ``stop``: where SIGTERM and Ctrl-C are recorded
    (``fedrcl.flower.simulation`` passes its own); ``None``: the ServerApp's own, where it runs in the main thread
    (a deployment's ``flwr-serverapp``), which then raises ``ServerAppStopped``: Flower's exit uploads the run's
    last log lines and reports the run ``finished:failed`` with the stop in its details."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        # Colour codes only on a terminal: under flwr run the ServerApp's output is streamed to flwr's log, a
        # file when redirected (Flower's handler colours by default).
        update_console_handler(colored=sys.stderr.isatty())
        wait = float(context.run_config.get("round-timeout", timeout))
        back = float(context.run_config.get("node-restart-wait", restart_wait))
        secure = SecureAggregation.from_run_config(context.run_config)  # secure-aggregation.*: checked first
        own = stop is None and threading.current_thread() is threading.main_thread()
        signals = StopSignal() if own else stop
        with signals if own and signals is not None else contextlib.nullcontext():
            for run in (run_args(context.run_config, args), *more):
                run_federation(grid, run, timeout=wait, restart_wait=back, stop=signals, secure=secure)
                if signals is not None and signals.signum is not None:
                    break
        if own and signals is not None and signals.signum is not None:
            raise ServerAppStopped(f"stopped by {signal.Signals(signals.signum).name} after a round, checkpointed "
                                   "(the log says which, and how to resume)")

    return app
