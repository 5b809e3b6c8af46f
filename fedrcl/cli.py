"""The ``fedrcl`` command: LightningCLI over (client algorithm, federated dataset, FederatedTrainer).

    fedrcl fit --config configs/quickstart.yaml
    fedrcl fit --config configs/cifar100_a005.yaml --model fedrcl.algorithms.FedAvg
    fedrcl fit --config configs/cifar100_a005.yaml --ckpt_path last
    fedrcl report runs          # our runs beside the paper's tables (fedrcl.report)
    fedrcl seeds --seeds 0 1 2 --config configs/quickstart.yaml     # one fit per seed (fedrcl.seeds)
"""
from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

from fedrcl.algorithms import FedAvg
from fedrcl.data.datamodule import FederatedDataModule
from fedrcl.data.datasets import dataset_info
from fedrcl.federated.trainer import FederatedTrainer


def _num_classes(dataset: str) -> int:
    return dataset_info(dataset).num_classes


def _in_channels(dataset: str) -> int:
    return dataset_info(dataset).in_channels


def _image_size(dataset: str) -> int:
    return dataset_info(dataset).image_size


class FedRCLCLI(LightningCLI):
    """LightningCLI with the dataset's shape linked into the model, so it is never typed twice."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.dataset", "model.init_args.num_classes", compute_fn=_num_classes)
        parser.link_arguments("data.dataset", "model.init_args.in_channels", compute_fn=_in_channels)
        parser.link_arguments("data.dataset", "model.init_args.image_size", compute_fn=_image_size)


def build_cli(args: list[str] | None = None) -> FedRCLCLI:
    """Parse ``args`` (default: the command line), then run the subcommand; returns the CLI object."""
    return FedRCLCLI(FedAvg, FederatedDataModule, trainer_class=FederatedTrainer, subclass_mode_model=True,
                     seed_everything_default=0, save_config_kwargs={"overwrite": True}, args=args)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``fedrcl`` console script (exit status 0 on success).

    ``fedrcl report ...`` goes to ``fedrcl.report`` (not a Trainer subcommand); the rest to LightningCLI.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["report"]:
        from fedrcl.report import main as report_main

        report_main(argv[1:])
        return
    if argv[:1] == ["seeds"]:
        from fedrcl.seeds import main as seeds_main

        seeds_main(argv[1:])
        return
    build_cli(args)


if __name__ == "__main__":
    main()
