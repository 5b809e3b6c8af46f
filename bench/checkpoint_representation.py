"""Effective rank and VCI per feature level of saved global models, measured after training.

    python bench/checkpoint_representation.py \
        FedAvg@100=docs/cpu_runs/r8_fedavg_round100.ckpt FedRCL@100=docs/cpu_runs/r8_fedrcl_round100.ckpt \
        --config docs/cpu_runs/r8_fedavg/version_0/config.yaml [--num-samples 1000] [--root ../shared/data]

The long CPU runs train without ``RepresentationMonitor`` (it would cost training time); this measures the
same quantities afterwards, with the monitor's own ``measure`` on the same seeded subset of the test set:
``effective_rank`` and ``vci`` of each level's features (``fedrcl.analysis.metrics``). ``--config`` is
the run's saved ``config.yaml`` (the data set and the backbone; every checkpoint given must come from that
configuration). Prints one markdown table per metric: a row per checkpoint, a column per level.
"""
from __future__ import annotations

import argparse
from importlib import import_module
from pathlib import Path

import torch
import yaml

from fedrcl.analysis import RepresentationMonitor
from fedrcl.data.datamodule import FederatedDataModule
from fedrcl.data.datasets import dataset_info


def build(config: dict, root: str | None) -> tuple[FederatedDataModule, torch.nn.Module]:
    """The run's data module (set up) and an untrained backbone of its architecture."""
    data = dict(config["data"], **({"root": root} if root else {}))
    datamodule = FederatedDataModule(**data)
    datamodule.setup("fit")
    spec = config["model"]["init_args"]["backbone"]
    module, _, name = spec["class_path"].rpartition(".")
    info = dataset_info(data["dataset"])
    backbone = getattr(import_module(module), name)(info.num_classes, info.in_channels, info.image_size,
                                                     **spec.get("init_args", {}))
    return datamodule, backbone


def global_weights(path: Path) -> dict[str, torch.Tensor]:
    """The backbone's weights in a fedrcl checkpoint (read as data, never executed)."""
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", help="LABEL=PATH of a checkpoint")
    parser.add_argument("--config", type=Path, required=True, help="the runs' saved config.yaml")
    parser.add_argument("--root", help="data root, if not the config's")
    parser.add_argument("--num-samples", type=int, default=1000)
    args = parser.parse_args()
    datamodule, backbone = build(yaml.safe_load(args.config.read_text()), args.root)
    monitor = RepresentationMonitor(num_samples=args.num_samples, deviation=False)
    rows = {}
    for label, path in (spec.split("=", 1) for spec in args.checkpoints):
        backbone.load_state_dict(global_weights(Path(path)))
        rows[label] = monitor.measure(backbone, datamodule, client_id=0)
    levels = sorted({k.split("/")[1] for metrics in rows.values() for k in metrics})
    for metric in ("effective_rank", "vci"):
        print(f"\n| {metric} | " + " | ".join(levels) + " |\n" + "|---" * (len(levels) + 1) + "|")
        for label, metrics in rows.items():
            print(f"| {label} | " + " | ".join(f"{metrics[f'repr/{lv}/{metric}']:.3f}" for lv in levels) + " |")


if __name__ == "__main__":
    main()
