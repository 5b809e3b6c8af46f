"""What Flower's SecAgg+ costs on a localhost deployment: bytes and seconds per round, with and without it.

    PATH=.venv/bin:$PATH .venv/bin/python bench/secagg.py [--nodes 4] [--rounds 3] [--clients-per-round 3]

One SuperLink and ``--nodes`` SuperNodes (``fedrcl.flower.localhost``), digits with one client a node, FedRCL,
1 local epoch; the same run plain, then with ``secure-aggregation.enabled`` (clipping range 1, 2**22 levels).
From each run folder's scalars: ``flower/down_bytes`` and ``flower/up_bytes`` (plain: the ArrayRecords of the
train messages and replies; secure: every record of the protocol's four stages, keys and ciphertexts
included) and ``time/round_seconds`` (round 1 left out: it includes the nodes' builds). Prints the per-round
means and the secure / plain ratios.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from fedrcl.analysis.runs import load_scalars
from fedrcl.data.datasets import load_dataset
from fedrcl.flower.localhost import LocalDeployment

REPO = Path(__file__).resolve().parents[1]
SECURE = {"secure-aggregation.enabled": True, "secure-aggregation.clipping-range": 1.0}
ENV = {"OMP_NUM_THREADS": "1"}


def args_for(root: Path, save_dir: Path, nodes: int, rounds: int, per_round: int) -> list[str]:
    return ["--config", str(REPO / "configs" / "quickstart.yaml"), "--model", "fedrcl.algorithms.FedRCL",
            "--data.root", str(root), "--data.num_clients", str(nodes), "--trainer.accelerator", "cpu",
            "--trainer.logger.init_args.save_dir", str(save_dir), "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.rounds", str(rounds),
            "--trainer.local_epochs", "1", "--trainer.clients_per_round", str(per_round)]


def per_round(save_dir: Path) -> dict[str, float]:
    """Means over rounds 2.. of the run's bytes and seconds."""
    scalars = load_scalars(save_dir / "quickstart")
    return {tag: float(np.mean(scalars[tag][1][1:])) for tag in
            ("flower/down_bytes", "flower/up_bytes", "time/round_seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients-per-round", type=int, default=3)
    known = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fedrcl-secagg-bench-"))
    root = work / "data"
    load_dataset("digits", root)
    results = {}
    with LocalDeployment(nodes=known.nodes, workdir=work / "deployment", env=ENV) as deployment:
        for name, config in (("plain", {}), ("secure", SECURE)):
            deployment.run_config = dict(config)
            deployment.run(args_for(root, work / name, known.nodes, known.rounds, known.clients_per_round),
                           timeout=3600)
            results[name] = per_round(work / name)
    print(f"{known.nodes} nodes, {known.clients_per_round} clients a round, means of rounds 2-{known.rounds}:")
    print(f"{'':22}{'plain':>14}{'secure':>14}{'ratio':>9}")
    for tag in ("flower/down_bytes", "flower/up_bytes", "time/round_seconds"):
        plain, secure = results["plain"][tag], results["secure"][tag]
        print(f"{tag:22}{plain:14.4g}{secure:14.4g}{secure / plain:9.2f}")


if __name__ == "__main__":
    main()
