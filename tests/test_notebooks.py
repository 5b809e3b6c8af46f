"""Both notebooks execute top to bottom on tiny digits runs, so they cannot rot."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import REPO, run_cli

pytestmark = pytest.mark.slow

MONITOR = """trainer:
  callbacks:
    - class_path: fedrcl.analysis.RepresentationMonitor
      init_args: {every_n_rounds: 1, num_samples: 200}
"""


@pytest.fixture(scope="module")
def runs_dir(data_root, tmp_path_factory) -> Path:
    """Two 2-round runs (FedAvg, FedRCL) with the monitor, under one save_dir as the notebook expects."""
    root = tmp_path_factory.mktemp("runs")
    config = root / "monitor.yaml"
    config.write_text(MONITOR)
    for name, model in (("fedavg", "fedrcl.algorithms.FedAvg"), ("fedrcl", "fedrcl.algorithms.FedRCL")):
        run_cli(data_root, root, "--config", str(config), "--trainer.logger.init_args.name", name,
                "--trainer.enable_checkpointing", "false", model=model)
    return root


def execute(name: str, overrides: str) -> nbformat.NotebookNode:
    """Run ``notebooks/<name>`` in notebooks/ with ``overrides`` appended to its parameters cell."""
    path = REPO / "notebooks" / name
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        assert cell.cell_type == "markdown" or (not cell.outputs and cell.execution_count is None), \
            f"{name}: outputs are not stripped"
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assert nb.cells.index(params) <= 1, "the parameters cell comes first"
    params.source += "\n# test overrides\n" + overrides
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def images(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
               for out in cell.outputs)


def test_analysis_notebook_runs(runs_dir):
    nb = execute("analysis.ipynb", f"RUNS = {str(runs_dir)!r}\nNAMES = ['fedavg', 'fedrcl']\nLOCAL = True\n")
    assert images(nb) >= 1 + 4 + 4 + 1  # accuracy, 4 global and 4 local metrics, deviation


def test_partitions_notebook_runs(data_root):
    nb = execute("partitions.ipynb", f"DATASET = 'digits'\nROOT = {str(data_root)!r}\nNUM_CLIENTS = 10\n")
    assert images(nb) == 1
