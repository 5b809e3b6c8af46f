"""One command, one machine: a fedrcl config through Flower's simulation runtime (Ray).

    python -m fedrcl.flower --config configs/quickstart.yaml [any fedrcl fit flag ...]

Runs ``make_server_app(args)`` and ``make_client_app()`` with ``flwr.simulation.run_simulation`` (Ray's
metrics agent off, ``RAY_enable_metrics_collection=0``, so that Ray starts on a busy machine; the log says
how long the nodes took to answer), one virtual SuperNode per fedrcl client (``--num-supernodes N`` groups the clients into N nodes), each Ray
actor with ``--cpus-per-client`` CPUs (default: all of them, so one actor trains the round's clients one
after another, as ``fedrcl fit`` does). Writes the run folder ``fedrcl fit`` would write; ``--ckpt_path
last`` (or a file) resumes a run from its checkpoint, as ``fedrcl fit --ckpt_path`` does.

SIGTERM and Ctrl-C to this process stop the run after the round in progress, checkpointed, as ``fedrcl fit``
does: the command says how to resume and exits with 128 + the signal's number (143 for SIGTERM). Ray's driver
takes SIGTERM over when it connects (the simulation then aborted, nothing checkpointed), so Ray is started here
(``start_ray``) and fedrcl's ``StopSignal`` installed after it. A signal sent to Ray's worker processes too (a
whole process group) ends the clients of the round in progress: that round is lost, the last checkpoint stays.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from fedrcl.cli import report_user_error, split_ckpt_path
from fedrcl.federated.checkpoint import check_usable, local_checkpoint
from fedrcl.federated.preemption import StopSignal
from fedrcl.flower.config import Args, as_args, build
from fedrcl.output import quiet_when_closed

if TYPE_CHECKING:  # Flower is imported where a simulation starts
    from flwr.common import ConfigRecordValues


def simulate(args: Args, num_supernodes: Optional[int] = None, cpus_per_client: Optional[float] = None,
             verbose: bool = False, more: Sequence[Args] = (), round_timeout: float = 3600.0) -> None:
    """Run fedrcl's arguments ``args`` through Flower's simulation (see the module docstring); ``more``:
    further runs with the same number of clients, one after another in the same simulation (Ray and its
    actors start once); ``round_timeout``: seconds a round waits for its clients."""
    from flwr.common.logger import FLOWER_LOGGER, update_console_handler
    from flwr.simulation import run_simulation

    from fedrcl.flower.client import make_client_app
    from fedrcl.flower.server import make_server_app, quiet_flower_log

    args = as_args(args)
    # A checkpoint the run cannot read is refused here, in one line, not inside the ServerApp (Flower's traceback).
    for run in (args, *map(as_args, more)):
        check_usable(local_checkpoint(split_ckpt_path(run)[1]))
    if num_supernodes is None:
        num_supernodes = build([*split_ckpt_path(args)[0], "--trainer.logger", "false"]).datamodule.num_clients
    resources: dict[str, ConfigRecordValues] = {"num_cpus": cpus_per_client or os.cpu_count() or 1,
                                                "num_gpus": 0.0}
    update_console_handler(colored=sys.stderr.isatty())  # no colour codes in a redirected log
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # Ray's "(ClientAppActor pid=...)" prefix, uncoloured
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray's own FutureWarning's advice
    # Ray's metrics agent, which a local simulation does not use, was slow to start on a loaded machine: Ray
    # waited minutes for it, then failed with a misleading "GCS overloaded". Off unless the user sets it.
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    quiet_flower_log()
    deprecation = DeprecatedOnPurpose()
    FLOWER_LOGGER.addFilter(deprecation)
    in_main_thread = threading.current_thread() is threading.main_thread()  # where signals can be handled
    if in_main_thread:
        start_ray()
    try:
        with StopSignal() if in_main_thread else contextlib.nullcontext() as stop:
            server_app = make_server_app(args, timeout=round_timeout, more=[as_args(m) for m in more], stop=stop)
            run_simulation(server_app, make_client_app(), num_supernodes=num_supernodes,
                           backend_config={"client_resources": resources}, verbose_logging=verbose)
    finally:
        FLOWER_LOGGER.removeFilter(deprecation)
    if stop is not None and stop.signum is not None:  # the ServerApp said where the run stopped and how to resume
        raise SystemExit(128 + stop.signum)


def start_ray() -> None:
    """Start Ray as Flower's Ray backend would (no dashboard; every actor sees this process's ``sys.path``, as
    ``PYTHONPATH``), which then finds it started. Ray's driver installs its own SIGTERM handling when it connects;
    starting it before fedrcl's ``StopSignal`` lets fedrcl's handler take SIGTERM."""
    import ray

    if ray.is_initialized():
        return
    pythonpath = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ["PYTHONPATH"] = pythonpath
    ray.init(runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, include_dashboard=False)


class DeprecatedOnPurpose(logging.Filter):
    """Drops Flower's notice that ``run_simulation`` is deprecated: it is this command's way to a simulation
    without a SuperLink; ``flwr run`` (docs/flower.md) is Flower's own way in."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "`run_simulation` function is deprecated" not in record.getMessage()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedrcl.flower", description=__doc__.split("\n")[0],
                                     epilog="Every other argument is fedrcl fit's (--config, --trainer.*, ...).")
    parser.add_argument("--num-supernodes", type=int, default=None, help="virtual nodes (default: one per client)")
    parser.add_argument("--cpus-per-client", type=float, default=None, help="CPUs of each Ray actor (default: all)")
    parser.add_argument("--round-timeout", type=float, default=3600.0,
                        help="seconds a round waits for its clients; a client still silent stops the run, named")
    parser.add_argument("--verbose", action="store_true", help="Flower's DEBUG log")
    known, rest = parser.parse_known_args(argv)
    quiet_when_closed()  # ``python -m fedrcl.flower ... | head``: a closed pipe silences the run, never stops it
    try:
        simulate(rest, known.num_supernodes, known.cpus_per_client, known.verbose, round_timeout=known.round_timeout)
    except Exception as error:
        if not report_user_error(error, prog=parser.prog, argv=rest):
            raise
        raise SystemExit(1) from None
