"""Both notebooks execute exactly as shipped, top to bottom, against what the README's commands produce.

Each notebook is copied unchanged into ``<tmp>/notebooks/`` and run there, so its ``../runs`` and
``../data`` are ``<tmp>/runs`` and ``<tmp>/data``: the folders that ``fedrcl fit --config
configs/quickstart.yaml`` writes when run from a clone's root (here shrunk to 5 rounds).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest
import yaml
from nbclient import NotebookClient

from conftest import REPO, run_cli

pytestmark = pytest.mark.slow


def execute(name: str, clone: Path) -> nbformat.NotebookNode:
    """Run ``notebooks/<name>``, unchanged, from ``<clone>/notebooks``."""
    folder = clone / "notebooks"
    folder.mkdir(exist_ok=True)
    shutil.copy(REPO / "notebooks" / name, folder / name)
    nb = nbformat.read(folder / name, as_version=4)
    for cell in nb.cells:
        assert cell.cell_type == "markdown" or (not cell.outputs and cell.execution_count is None), \
            f"{name}: outputs are not stripped"
    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(folder)}})
    client.execute()
    return nb


def images(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
               for out in cell.outputs)


def test_analysis_notebook_reads_the_quickstart_and_seeds_runs(data_root, tmp_path):
    """The quickstart config carries the RepresentationMonitor (every 5 rounds), so 5 rounds suffice. Beside
    it, two runs as ``fedrcl seeds`` lays them out (``<name>/seed<k>/version_0``, here copies of the quickstart
    under seeds 1 and 2), which the notebook finds as ``fedrcl report`` does (it found ``<name>/version_*``
    only)."""
    run_cli(data_root, tmp_path / "runs", "--trainer.enable_checkpointing", "false", rounds=5)
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["quickstart"]
    for seed in (1, 2):
        version = tmp_path / "runs" / "seeded" / f"seed{seed}" / "version_0"
        shutil.copytree(tmp_path / "runs" / "quickstart" / "version_0", version)
        config = yaml.safe_load((version / "config.yaml").read_text())
        config["seed_everything"] = config["trainer"]["seed"] = seed
        (version / "config.yaml").write_text(yaml.safe_dump(config))
    nb = execute("analysis.ipynb", tmp_path)
    assert "3 runs: quickstart, seeded/seed1, seeded/seed2" in "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert images(nb) >= 1 + 4 + 4 + 1  # accuracy, 4 global and 4 local metrics, deviation
