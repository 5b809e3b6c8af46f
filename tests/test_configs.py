"""Every shipped config parses through the CLI (``--print_config``) and names what it says it names."""
from __future__ import annotations

import pytest
import yaml

from conftest import REPO
from fedrcl.cli import main

CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml") if not {"methods", "server", "backbones"} & set(p.parts))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_config_parses(path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    source = yaml.safe_load(path.read_text())
    assert printed["data"]["dataset"] == source["data"]["dataset"]
    assert printed["model"]["class_path"] == source["model"]["class_path"]
    assert printed["trainer"]["rounds"] == source["trainer"]["rounds"]


def test_paper_grid_is_complete():
    names = {p.stem for p in CONFIGS}
    for dataset in ("cifar10", "cifar100", "tinyimagenet"):
        for split in ("a005", "a01", "a03", "a06", "iid"):
            assert f"{dataset}_{split}" in names
    cfg = yaml.safe_load((REPO / "configs" / "cifar100_a005.yaml").read_text())
    assert cfg["data"]["alpha"] == 0.05 and cfg["data"]["num_clients"] == 100
    assert cfg["trainer"]["clients_per_round"] == 5 and cfg["trainer"]["local_epochs"] == 5
