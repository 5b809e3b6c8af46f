"""The ``fedrcl`` command: LightningCLI over (client algorithm, federated dataset, FederatedTrainer).

    fedrcl fit --config configs/quickstart.yaml
    fedrcl fit --config configs/cifar100_a005.yaml --model fedrcl.algorithms.FedAvg
    fedrcl fit --config configs/cifar100_a005.yaml --ckpt_path last
    fedrcl validate --config configs/quickstart.yaml \
        --ckpt_path runs/quickstart/version_0/checkpoints/last.ckpt
    fedrcl report runs          # our runs beside the paper's tables (fedrcl.report)
    fedrcl seeds --seeds 0 1 2 --config configs/quickstart.yaml     # one fit per seed (fedrcl.seeds)

Keys are never abbreviated (``--trainer.round`` is an error, not ``--trainer.rounds``). ``validate`` and
``test`` log to ``<save_dir>/<name>/<subcommand>_k``, beside the fit run's ``version_k`` folders, so they
never join its training curves (``fedrcl.analysis.load_scalars``, the notebooks, ``fedrcl report``).
``torch_threads`` sets torch's CPU thread count (``configs/quickstart.yaml``: 1).
"""
from __future__ import annotations

import sys
from importlib import import_module
from pathlib import Path
from typing import Any, Optional

import lightning
import torch
import yaml
from jsonargparse import ActionConfigFile, ActionSubCommands, ArgumentParser, Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from fedrcl.algorithms import FedAvg
from fedrcl.data.datamodule import FederatedDataModule
from fedrcl.data.datasets import DataUnavailableError, dataset_info
from fedrcl.federated.checkpoint import check_readable
from fedrcl.federated.trainer import FederatedTrainer

# Subcommands that are not Trainer methods: name -> (module whose ``main(argv)`` runs it, one-line help).
OTHER_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "report": ("fedrcl.report", "Markdown tables of our runs beside the FedRCL paper's numbers."),
    "seeds": ("fedrcl.seeds", "One fit per seed of a config; fedrcl report groups them (mean, std, 95% CI)."),
}
EVALUATIONS = ("validate", "test")


def _num_classes(dataset: str) -> int:
    return dataset_info(dataset).num_classes


def _in_channels(dataset: str) -> int:
    return dataset_info(dataset).in_channels


def _image_size(dataset: str) -> int:
    return dataset_info(dataset).image_size


class ConfigFile(ActionConfigFile):
    """``--config``: a YAML syntax error names the file, line and column (jsonargparse names neither)."""

    def __call__(self, parser, cfg, values, option_string=None):
        path = Path(str(values))
        if path.is_file():
            try:
                yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
            except yaml.MarkedYAMLError as e:
                mark = e.problem_mark or e.context_mark
                where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
                raise TypeError(f"{path}: not valid YAML ({where}{e.problem or e.context})") from None
            except (UnicodeDecodeError, yaml.YAMLError) as e:
                raise TypeError(f"{path}: not valid YAML ({e})") from None
        super().__call__(parser, cfg, values, option_string)


class FedRCLParser(LightningArgumentParser):
    """Lightning's parser whose subcommand list also shows ``OTHER_SUBCOMMANDS`` (run by ``main``)."""

    def add_subcommands(self, *args: Any, **kwargs: Any) -> ActionSubCommands:
        self.subcommands_action = super().add_subcommands(*args, **kwargs)
        return self.subcommands_action


class FedRCLCLI(LightningCLI):
    """LightningCLI with the dataset's shape linked into the model, so it is never typed twice.

    Differences from LightningCLI: no abbreviated keys; no ``predict`` (a federated run has nothing to
    predict); ``validate`` / ``test`` report the checkpoint's own accuracy EMA and log apart from the fit
    runs; ``torch_threads``.
    """

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("dump_header", [f"lightning.pytorch=={lightning.__version__}"])
        parser = self.parser_class(allow_abbrev=False, **kwargs)
        parser.add_argument("-c", "--config", action=ConfigFile,
                            help="Path to a configuration file in yaml format (several: later ones win).")
        return parser

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any],
                     subparser_kwargs: dict[str, Any]) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        if add_subcommands:  # listed in --help; main() runs them before LightningCLI is built
            for name, (_, text) in OTHER_SUBCOMMANDS.items():
                self.parser.subcommands_action.add_subcommand(name, ArgumentParser(description=text),
                                                              help=text)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--torch_threads", type=Optional[int], default=None,
                            help="CPU threads of torch (torch.set_num_threads); null: torch's default "
                                 "(OMP_NUM_THREADS, else one per core). 1 is fastest for small models on "
                                 "shared cores.")
        parser.link_arguments("data.dataset", "model.init_args.num_classes", compute_fn=_num_classes)
        parser.link_arguments("data.dataset", "model.init_args.in_channels", compute_fn=_in_channels)
        parser.link_arguments("data.dataset", "model.init_args.image_size", compute_fn=_image_size)

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        # LightningCLI reads ckpt_path next (for hyperparameters): name an empty or truncated file first.
        subcommand = self.config.get("subcommand")
        check_readable((self.config[subcommand] if subcommand else self.config).get("ckpt_path"))

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("torch_threads") is not None:
            if config.torch_threads < 1:
                raise ValueError(f"torch_threads must be >= 1 or null, got {config.torch_threads}")
            torch.set_num_threads(config.torch_threads)
        if self.subcommand in EVALUATIONS:
            _log_apart(config.trainer, self.subcommand)


def _log_apart(trainer: Namespace, subcommand: str) -> None:
    """Point the run's file loggers at ``<save_dir>/<name>/<subcommand>_k`` (``runs/quickstart/validate_0``):
    beside the fit run's ``version_k`` folders, never one of them, so ``--ckpt_path last`` still finds the
    run's checkpoints while its curves, run list and report stay as the fit wrote them."""
    if trainer.logger in (None, True):  # FederatedTrainer's default logger, made explicit
        trainer.logger = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                                   init_args=Namespace(save_dir=trainer.get("default_root_dir") or "runs",
                                                       name="fedrcl", version=None))
    for logger in trainer.logger if isinstance(trainer.logger, list) else [trainer.logger]:
        args = logger.get("init_args") if isinstance(logger, Namespace) else None
        if args is None or not {"save_dir", "name", "version"} <= set(vars(args)) or args.version is not None:
            continue
        run_dir = Path(args.save_dir or ".") / (args.name or "")
        taken = [p.name.removeprefix(f"{subcommand}_") for p in run_dir.glob(f"{subcommand}_*")]
        args.version = f"{subcommand}_{max((int(k) + 1 for k in taken if k.isdigit()), default=0)}"


def build_cli(args: list[str] | None = None) -> FedRCLCLI:
    """Parse ``args`` (default: the command line), then run the subcommand; returns the CLI object."""
    return FedRCLCLI(FedAvg, FederatedDataModule, trainer_class=FederatedTrainer, subclass_mode_model=True,
                     parser_class=FedRCLParser, seed_everything_default=0,
                     parser_kwargs={"description": "FedRCL and its baselines: federated learning runs."},
                     save_config_kwargs={"overwrite": True}, args=args)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``fedrcl`` console script (exit status 0 on success).

    ``OTHER_SUBCOMMANDS`` (``fedrcl report ...``) go to their module's ``main``; the rest to LightningCLI.
    Data that cannot be found or fetched ends in a short message and exit status 1, not a traceback.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] and argv[0] in OTHER_SUBCOMMANDS:
        import_module(OTHER_SUBCOMMANDS[argv[0]][0]).main(argv[1:])
        return
    try:
        build_cli(args)
    except DataUnavailableError as e:
        print(f"fedrcl: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
