"""Command line: the picture of how a data set is split among clients, as a PNG.

    python -m fedrcl.analysis.partitions --config configs/cifar10_a01.yaml --out partition.png
    python -m fedrcl.analysis.partitions --dataset digits --num_clients 20 --alpha 0.05 --out digits.png

The split is the one training uses: ``FederatedDataModule.split`` with the run's ``data`` settings. A
``--config`` is a ``fedrcl fit`` config (only its ``data`` section is read); the other options override it.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

import yaml

from fedrcl.analysis.clients import partition_counts

__all__ = ["main"]


def main(argv: Optional[list[str]] = None) -> Path:
    """Write the partition picture of a ``data`` configuration to a PNG; returns its path."""
    parser = argparse.ArgumentParser(prog="python -m fedrcl.analysis.partitions", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a fedrcl fit config; its data section gives the defaults")
    parser.add_argument("--dataset", help="cifar10, cifar100, tinyimagenet or digits")
    parser.add_argument("--root", help="folder holding <dataset>.npz")
    parser.add_argument("--download", action="store_true", default=None, help="download CIFAR if missing")
    parser.add_argument("--num_clients", type=int)
    parser.add_argument("--partition", help="dirichlet, dirichlet_unbalanced, shards or iid")
    parser.add_argument("--alpha", type=float, help="Dirichlet concentration")
    parser.add_argument("--shards_per_client", type=int)
    parser.add_argument("--seed", type=int, help="seed of the split (data.seed)")
    parser.add_argument("--scale", choices=("dataset", "client"), default="dataset",
                        help="segments as shares of the data set (bar height = client size) or of the client")
    parser.add_argument("--out", default="partition.png", help="PNG to write")
    args = vars(parser.parse_args(argv))
    data: dict[str, Any] = {}
    config_path = args.pop("config")
    if config_path:
        config = yaml.safe_load(Path(config_path).read_text()) or {}
        if not isinstance(config.get("data"), dict):
            parser.error(f"{config_path} has no data section")
        data.update(config["data"])
    out, scale = Path(args.pop("out")), args.pop("scale")
    data.update({k: v for k, v in args.items() if v is not None})
    if "dataset" not in data:
        parser.error("give --dataset or a --config with data.dataset")
    try:
        counts = partition_counts(**data)
    except (TypeError, ValueError) as err:
        parser.error(str(err))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedrcl.analysis.plots import plot_partition

    title = f"{data['dataset']}, {data.get('partition', 'dirichlet')}"
    if data.get("partition", "dirichlet").startswith("dirichlet"):
        title += f", alpha = {data.get('alpha', 0.3)}"
    fig = plot_partition(counts, scale=scale, title=title + f", {len(counts)} clients")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
