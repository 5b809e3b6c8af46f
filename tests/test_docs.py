"""The documentation site builds strictly (a warning, a broken cross-reference or a missing reference fails),
covers every module and page, and the README stays one screen whose links lead into it."""
from __future__ import annotations

import os
import pkgutil
import re
import subprocess
import sys

import fedrcl
from conftest import REPO

DOCS = REPO / "docs"


def test_site_builds_strictly(tmp_path):
    """The command of docs/development.md, into a temporary folder (a fresh process: autodoc imports
    every module as a reader's build would)."""
    out = tmp_path / "html"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    build = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
                            str(DOCS), str(out), "-d", str(tmp_path / "doctrees")],
                           capture_output=True, text=True, timeout=600, env=env)
    assert build.returncode == 0, build.stdout + build.stderr
    assert "WARNING" not in build.stderr and "ERROR" not in build.stderr, build.stderr
    pages = {p.stem for p in DOCS.glob("*.md")} - {"results_cnn_seeds"}
    assert pages <= {p.stem for p in out.glob("*.html")}, pages  # every page is part of the site
    api = (out / "api.html").read_text(encoding="utf-8")
    modules = [m.name for m in pkgutil.walk_packages(fedrcl.__path__, "fedrcl.") if not m.name.endswith("__main__")]
    assert len(modules) > 50
    for name in modules:  # every module's docstring is on the API page
        assert f'id="module-{name}"' in api, name
    assert 'id="fedrcl.algorithms.fedavg.FedAvg.client_loss"' in api  # members too
    tutorial = (out / "tutorial.html").read_text(encoding="utf-8")
    assert "class MyMethod(FedAvg)" in re.sub(r"<[^>]+>", "", tutorial)  # the literalinclude of the file


def test_readme_is_one_screen_and_links_into_the_site():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 60
    # .ci/run runs the README's install and test commands: they stay its first commands.
    assert readme.index('pip install -e ".[dev]"') < readme.index("pytest -q") < readme.index("fedrcl fit")
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert len(links) >= 8, links
    for link in links:
        assert (REPO / link).exists(), link
    for image in re.findall(r"!\[[^]]*\]\(([^)]+)\)", readme):
        assert (REPO / image).is_file(), image


def test_concepts_package_layout_names_every_folder_and_backbone():
    """docs/concepts.md's layout covers the package: every subpackage, every shipped backbone, every module
    of fedrcl/federated that a new method touches (round, exchange)."""
    import fedrcl.models

    text = (REPO / "docs" / "concepts.md").read_text(encoding="utf-8")
    layout = text[text.index("## Package layout"):text.index("## Seeds, checkpoints, resume")]
    folders = [p.name for p in (REPO / "fedrcl").iterdir() if (p / "__init__.py").is_file()]
    assert len(folders) >= 8
    missing = [f for f in folders if f"fedrcl/{f}/" not in layout]
    assert not missing, f"folders the layout does not name: {missing}"
    backbones = [name for name in fedrcl.models.__all__ if name != "ModelOutput"]
    assert not [b for b in backbones if f"`{b}`" not in layout]
    for module in ("fedrcl/federated/round.py", "fedrcl/contract/exchange.py"):
        assert module in layout
