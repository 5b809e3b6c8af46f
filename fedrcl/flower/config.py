"""A fedrcl run built from the same YAML config and flags that ``fedrcl fit`` takes.

``build(args)`` parses ``args`` (e.g. ``["--config", "configs/quickstart.yaml", "--trainer.rounds", "3"]``)
with fedrcl's own LightningCLI and instantiates, without running anything, the client algorithm, the
federated data module and the ``FederatedTrainer``: the same objects, seeds and initial weights that
``fedrcl fit`` would build. The server side keeps the config's logger (the run folder); a client process
gets ``client_args`` added (no logger, checkpoints, callbacks or progress bar; its own folder for
per-client state files).
"""
from __future__ import annotations

import os
import shlex
import warnings
from collections.abc import Mapping, Sequence
from typing import Optional, Union

from fedrcl.algorithms import FedAvg
from fedrcl.cli import FedRCLCLI, FedRCLParser
from fedrcl.data.datamodule import FederatedDataModule
from fedrcl.federated.trainer import FederatedTrainer

# Lightning's CLI (building the run, saving its config) calls jsonargparse APIs that jsonargparse deprecated;
# Ray's and Flower's processes show such warnings, which Python hides by default (as in ``fedrcl fit``).
# Not the user's to act on: jsonargparse's own switch, read when it warns, unless the user set it.
os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")

Args = Union[str, Sequence[str]]
RUN_ARGS_KEY = "fedrcl-args"  # the Flower run config key holding fedrcl's arguments (``flwr run``)


def as_args(args: Args) -> list[str]:
    """A command-line string (as in a Flower run config) or a list of arguments -> a list of arguments."""
    return shlex.split(args) if isinstance(args, str) else list(args)


def build(args: Args) -> FedRCLCLI:
    """Parse and instantiate ``fedrcl fit``'s objects from ``args``; ``cli.model``, ``cli.datamodule``,
    ``cli.trainer``, ``cli.config`` (the parsed config) and ``cli.parser`` (to dump it)."""
    with warnings.catch_warnings():  # sys.argv is Flower's or Ray's here, not fedrcl's: only ``args`` is read
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        return FedRCLCLI(FedAvg, FederatedDataModule, trainer_class=FederatedTrainer, subclass_mode_model=True,
                         parser_class=FedRCLParser, seed_everything_default=0, run=False,
                         save_config_kwargs={"overwrite": True}, args=as_args(args))


def client_args(state_dir: str) -> list[str]:
    """What a client process adds to the run's args: nothing written but its per-client state files."""
    return ["--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.callbacks", "[]", "--trainer.default_root_dir", state_dir]


def run_args(run_config: Mapping, args: Optional[Args] = None) -> list[str]:
    """fedrcl's arguments: ``args`` if given, else the Flower run config's ``fedrcl-args`` (``flwr run``)."""
    if args is not None:
        return as_args(args)
    if RUN_ARGS_KEY not in run_config:
        raise KeyError(f"the Flower run config has no {RUN_ARGS_KEY!r} (fedrcl's arguments, e.g. "
                       "'--config configs/quickstart.yaml'): set it in [tool.flwr.app.config]")
    return as_args(str(run_config[RUN_ARGS_KEY]))
