"""The fedrcl ServerApp: ``fedrcl fit`` with the round's clients on Flower's nodes.

``run_federation(grid, args)`` builds the run from fedrcl's arguments exactly as ``fedrcl fit`` does (same
initial weights, split, server optimizer, logger, callbacks) and runs ``trainer.fit``: Lightning's fit loop, whose
rounds are ``fedrcl fit``'s (``fedrcl.federated.federation``), with the round's clients trained on the nodes by
``NodeRounds``, the federation's remote engine: each round it begins and configures ``FedrclStrategy``'s round, sends
its messages and folds the replies in (``configure_train``, ``send_and_receive``, ``aggregate_train``, as Flower's
``Strategy.start`` does), and the new global weights come back into the fit loop. Everything after is the round's
end of every backend: evaluation on the server (``val/acc`` and its EMA), the round's scalars (``train/loss*``,
``train/lr``, ``time/round_seconds``, fedrcl's ``comm/*`` and ``time/*`` ledger, and ``flower/down_bytes`` /
``flower/up_bytes``, the bytes Flower's ArrayRecords carried), the round's line, the callbacks' hooks, checkpoints
(``last.ckpt`` every round here: a lost node stops the run, which resumes from the last round done), Lightning's
``trainer.max_time``, SIGTERM and Ctrl-C (after the round, checkpointed), the privacy budget. ``--ckpt_path PATH``
(or ``last``) among the arguments resumes a run of Flower or of ``fedrcl fit`` as ``fedrcl fit`` does.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import warnings
from logging import INFO, WARNING
from collections.abc import Sequence
from typing import Any, Optional

import lightning as L
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.app.exception import AppExitException
from flwr.serverapp import Grid, ServerApp
from flwr.common import log
from flwr.common.logger import FLOWER_LOGGER, update_console_handler
from flwr.supercore.exit import ExitCode
from torch import Tensor

from fedrcl.cli import split_ckpt_path
from fedrcl.contract.exchange import check_method
from fedrcl.federated.federation import RemoteRound, client_callbacks
from fedrcl.federated.preemption import Preempted, StopSignal, last_checkpoint
from fedrcl.federated.progress import quiet_lightning
from fedrcl.flower.config import Args, as_args, build, run_args
from fedrcl.flower.nodes import ClientFailure, FleetGrid
from fedrcl.flower.secure_aggregation import SecureAggregation
from fedrcl.flower.strategy import FedrclStrategy

# Lightning's per-step hooks: on Flower's server they run once per round (the round's one step; the clients'
# steps are on the nodes), named before the run starts
STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
              "on_before_optimizer_step", "on_before_zero_grad")


def not_run(trainer: L.Trainer) -> list[str]:
    """What of the config's callbacks does not run as in ``fedrcl fit``, named before the run starts: each
    ``RoundCallback``'s ``on_client_end`` (the clients' local models stay on the nodes; ``round_metrics``, on the
    global model, runs) and a user callback's per-step hooks (``STEP_HOOKS``: once per round here)."""
    named = [f"{type(c).__name__}.on_client_end" for c in client_callbacks(trainer)]
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if type(callback).__module__.startswith(("fedrcl.", "lightning.")):
            continue
        named += [f"{type(callback).__name__}.{hook}" for hook in STEP_HOOKS
                  if getattr(type(callback), hook) is not getattr(L.Callback, hook)]
    return named


class NodeRounds(L.Callback):
    """The federation's remote engine (``fedrcl.federated.federation.RemoteClients``): the round's clients trained
    on Flower's nodes through ``FedrclStrategy``. At the fit's start the strategy is built from the run's objects and
    the nodes mapped to their partitions; after each checkpoint the strategy keeps the client-state files it names
    (``kept``), so that nodes never delete what a resume needs."""

    def __init__(self, grid: Grid, args: Sequence[str], timeout: float, node_wait: float, restart_wait: float,
                 secure: Optional[SecureAggregation]):
        self.grid, self.args, self.timeout = grid, list(args), timeout
        self.node_wait, self.restart_wait, self.secure = node_wait, restart_wait, secure
        self.strategy: Optional[FedrclStrategy] = None
        self._fleet: Optional[FleetGrid] = None
        self._round: tuple[int, list[Any]] = (0, [])  # the round in progress: Flower's round number and its messages

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Once the run is set up (the algorithm's client-state store too): the strategy; the nodes mapped."""
        federation, dm = trainer.federation, trainer.datamodule  # type: ignore[attr-defined]  # a FederatedTrainer's
        clients = range(dm.num_clients)
        self.strategy = FedrclStrategy(
            federation.server, [dm.client_num_samples(k) for k in clients], federation.clients_per_round,
            federation.seed, steps_per_epoch=[dm.client_steps_per_epoch(k) for k in clients],
            local_epochs=federation.local_epochs, node_wait=self.node_wait, algorithm=pl_module, run_args=self.args,
            ledger=federation.ledger, restart_wait=self.restart_wait, privacy=federation.privacy, secure=self.secure)
        self._fleet = self.strategy.connect(self.grid, self.timeout)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.strategy is not None
        self.strategy.kept = self.strategy.manifest()  # a resumed run's checkpoint refers to these files

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        assert self.strategy is not None
        self.strategy.kept = self.strategy.manifest()

    def begin(self, round_idx: int, global_weights: dict[str, Tensor]) -> None:
        assert self.strategy is not None
        server_round = round_idx + 1
        messages = self.strategy.configure_train(server_round, ArrayRecord.from_torch_state_dict(global_weights),
                                                 ConfigRecord(), self.grid)
        self._round = (server_round, list(messages))

    def train(self) -> RemoteRound:
        assert self.strategy is not None and self._fleet is not None
        server_round, messages = self._round
        replies = self._fleet.send_and_receive(messages, timeout=self.timeout)
        arrays, _ = self.strategy.aggregate_train(server_round, replies)
        assert arrays is not None
        payload = {f"flower/{d}_bytes": float(n) for d, n in self.strategy.payload.items()}
        return RemoteRound(arrays.to_torch_state_dict(), dict(self.strategy.loss_sums), self.strategy.round_steps,
                           payload)


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


def run_federation(grid: Grid, args: Args, timeout: float = 3600.0, node_wait: float = 600.0,
                   restart_wait: float = 300.0, stop: Optional[StopSignal] = None,
                   secure: Optional[SecureAggregation] = None):
    """Run fedrcl's federation ``args`` over ``grid`` (``fedrcl fit``'s loop, its clients on the nodes: the module
    docstring); returns the CLI objects (``cli.model`` holds the final global model) and the strategy.
    ``node_wait``: seconds to wait for nodes serving every client before the first round; ``restart_wait``:
    seconds a round waits for a lost node to come back (``Fleet``). A round that stops (a node not back in time,
    a client's error) stops the run, whose last round done is checkpointed, and says so with the way to resume.
    ``stop``: where the process records SIGTERM and Ctrl-C when this runs outside its main thread (a simulation):
    the run then ends after the round, checkpointed, as ``fedrcl fit`` does on a signal; a stop is recorded there
    for the caller (``make_server_app``). ``secure``: each round's sum through Flower's SecAgg+
    (``fedrcl.flower.secure_aggregation``; a method it cannot serve is refused here, before anything is written)."""
    args, ckpt_path = split_ckpt_path(as_args(args))
    cli = build(args)
    module, dm, trainer = cli.model, cli.datamodule, cli.trainer
    check_method(module, trainer.federation.server)  # before anything is written
    if trainer.world_size > 1:
        raise ValueError(f"trainer.devices x trainer.num_nodes is {trainer.world_size} on Flower's server: it "
                         "aggregates and evaluates in one process, and its clients train on the nodes; set "
                         "trainer.devices 1 (a node's device is its own: docs/flower.md)")
    if secure is not None:
        secure.check_method(module, trainer.federation.privacy)
        secure.check_run(trainer.federation.clients_per_round)
    quiet_flower_log()
    ignored = not_run(trainer)
    if ignored:
        log(WARNING, "on Flower these trainer.callbacks hooks do not run as in fedrcl fit (the clients are on the "
            "nodes; per-step hooks run once per round): %s", ", ".join(ignored))
    engine = NodeRounds(grid, args, timeout, node_wait, restart_wait, secure)
    trainer.federation.remote, trainer.federation.stop_signal = engine, stop
    trainer.callbacks.append(engine)  # Lightning's list of the fit's callbacks
    try:
        with warnings.catch_warnings():  # the round's one step trains nothing here, on purpose
            warnings.filterwarnings("ignore", message="`training_step` returned `None`")
            quiet_lightning()  # again: a simulation's other threads may have reset the process's filters
            trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)  # checked there before anything is written
    except Preempted as stopping:
        log(WARNING, "%s: %s", stopping.signal_name, stopped(trainer))
        if stop is not None:
            stop.signum = stop.signum or int(stopping.code) - 128  # type: ignore[arg-type]  # 128 + the signal
        else:
            raise
    except ClientFailure as failure:
        raise ClientFailure(f"{failure}\n{stopped(trainer)}") from None
    return cli, engine.strategy


def stopped(trainer: L.Trainer) -> str:
    """Where a run that stopped can resume from, and how."""
    done, path = trainer.current_epoch, last_checkpoint(trainer)
    if not path:
        return f"The run stopped after round {done}, with no checkpoint."
    return (f"The run stopped after round {done}, checkpoint {path}; resume with --ckpt_path last among fedrcl's "
            "arguments (python -m fedrcl.flower, or flwr run's fedrcl-args).")


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
