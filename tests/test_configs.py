"""Every shipped config parses through the CLI (``--print_config``) and names what it says it names."""
from __future__ import annotations

import pytest
import yaml

from conftest import REPO
from fedrcl.cli import main

CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml") if not {"methods", "server", "backbones", "settings"} & set(p.parts))


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


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


OVERLAYS = sorted(p for d in ("methods", "server", "backbones", "settings") for p in (REPO / "configs" / d).glob("*.yaml"))


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_overlay_composes_with_a_paper_config(overlay, capsys):
    """Each overlay applies on top of a Table 1 config and every key it sets reaches the parsed config."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "cifar100_a03.yaml"), "--config", str(overlay),
              "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = _leaves(yaml.safe_load(capsys.readouterr().out))
    for key, value in _leaves(yaml.safe_load(overlay.read_text())).items():
        assert printed.get(key, printed.get(f"{key}.class_path")) == value, key  # class shorthand
