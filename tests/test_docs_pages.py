"""The pages a new user reads first: the figures of the README and of Getting started come from ``fedrcl plot``
with the command beside them, Getting started ends in the compare-two-methods recipe, the install pages give the
CPU-only line and the notebooks extra, and no page points outside the repository."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import REPO

DOCS = REPO / "docs"
# Screenshots in the pages -> the commands that made what they show.
SCREENSHOTS = {"tensorboard_accuracy_first.png": ("fedrcl fit --config configs/quickstart.yaml",
                                                  "tensorboard --logdir runs")}


def _figure_commands(text: str) -> dict[str, str]:
    """``{--out value: the fedrcl plot command}`` for every ``fedrcl plot`` command of a page (lines joined)."""
    flat = " ".join(text.replace("\\\n", " ").split())
    commands = (c.rstrip("`).,") for c in re.findall(r"fedrcl plot [^`]*?--out \S+", flat))
    return {c.split("--out ")[1].split()[0]: c for c in commands}


def test_readme_and_getting_started_figures_are_drawn_by_fedrcl_plot_with_its_command(tmp_path, capsys, monkeypatch):
    """Every figure of the README and of Getting started has the ``fedrcl plot`` command that drew it beside it;
    the README's, on the committed runs, draws again and prints the EMA the README quotes."""
    from fedrcl.plot import main

    for page, base in ((REPO / "README.md", REPO), (DOCS / "getting-started.md", DOCS)):
        text = page.read_text(encoding="utf-8")
        commands = _figure_commands(text)
        images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
        assert images, page
        for image in images:
            if image in SCREENSHOTS:  # not a plot: the commands that showed it, just above it
                above = " ".join(text[:text.index(f"]({image})")].rsplit("\n\n", 2)[-2].split())
                assert all(c in above for c in SCREENSHOTS[image]), (page.name, image)
                continue
            out = str((base / image).relative_to(REPO).with_suffix(""))
            assert out in commands, (page.name, image, list(commands))
    command = _figure_commands((REPO / "README.md").read_text(encoding="utf-8"))["docs/results_cnn_seeds"]
    args = command.split()[2:]
    args[args.index("--out") + 1] = str(tmp_path / "seeds")
    monkeypatch.chdir(REPO)
    main(args + ["--rounds", "200"])
    table = capsys.readouterr().out
    for row in ("| FedAvg | 3 | 56.45 ± 0.53 | 200 |", "| FedLC | 3 | 61.18 ± 0.35 | 200 |",
                "| FedRCL | 3 | 48.97 ± 3.48 | 200 |"):
        assert row in table
        assert row.split(" | ")[2] in (REPO / "README.md").read_text(encoding="utf-8")
    assert (tmp_path / "seeds.png").is_file() and (tmp_path / "seeds.svg").is_file()


def test_getting_started_ends_with_the_compare_recipe():
    text = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    last = text[text.rindex("\n## "):]
    assert "Compare two methods" in last.splitlines()[1]
    order = [last.index(c) for c in ("fedrcl seeds", "fedrcl report", "fedrcl plot", "![")]
    assert order == sorted(order)
    assert last.rstrip().endswith(")")  # ends in the figure (or its caption's link)


def test_install_pages_give_the_cpu_only_line_and_the_notebooks_extra():
    import tomllib

    cpu = "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu"
    for page in (REPO / "README.md", DOCS / "getting-started.md"):
        text = page.read_text(encoding="utf-8").replace("\n", " ")
        assert cpu in text, page
    started = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    assert started.index(cpu) < started.index('pip install -e ".[dev]"', started.index(cpu))
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"jupyterlab>=4", "fedrcl[notebooks-headless]"} <= set(extras["notebooks"])
    assert "nbconvert>=7" in extras["notebooks-headless"]
    own = next(e for e in extras["dev"] if e.startswith("fedrcl["))  # dev installs the package's other extras
    assert {"docs", "flower", "notebooks-headless"} <= set(own.removeprefix("fedrcl[").removesuffix("]").split(","))
    analysis = (DOCS / "analysis.md").read_text(encoding="utf-8")
    assert "jupyter lab notebooks/" in analysis and "jupyter nbconvert --to notebook --execute" in analysis
    assert '.[dev,notebooks]' in analysis  # JupyterLab is not in dev (pyproject.toml says why)


def test_docs_point_inside_the_repository():
    for page in [REPO / "README.md", *DOCS.glob("*.md")]:
        assert "shared/data/README.md" not in page.read_text(encoding="utf-8"), page
    assert "width 8" in (DOCS / "index.md").read_text(encoding="utf-8")


@pytest.mark.slow
def test_the_headless_notebook_command_of_the_analysis_page_runs(tmp_path):
    """docs/analysis.md's ``jupyter nbconvert`` line, as written, on the notebook that needs no run (the
    other is executed by tests/test_notebooks.py), from a folder laid out as a clone: it runs offline, draws
    the quickstart's split and builds ``../data/digits.npz`` if absent."""
    line = next(line for line in (DOCS / "analysis.md").read_text(encoding="utf-8").splitlines()
                if line.startswith("jupyter nbconvert"))
    command = line.split("#")[0].split()
    command[command.index("notebooks/*.ipynb")] = "notebooks/partitions.ipynb"
    (tmp_path / "notebooks").mkdir()
    shutil.copy(REPO / "notebooks" / "partitions.ipynb", tmp_path / "notebooks")
    jupyter = Path(sys.executable).with_name("jupyter")
    result = subprocess.run([str(jupyter), *command[1:]], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    executed = nbformat.read(tmp_path / "out" / "notebooks" / "partitions.ipynb", as_version=4)
    assert any("image/png" in out.get("data", {}) for cell in executed.cells if cell.cell_type == "code"
               for out in cell.outputs)
    assert (tmp_path / "data" / "digits.npz").is_file()  # ../data from notebooks/: the clone's data/


def test_readme_and_landing_page_give_both_width_8_headlines():
    """The README and the docs' landing page say the same two things about width 8: the three seeds at round
    500 and the one seed run on to round 1000."""
    for page in (REPO / "README.md", DOCS / "index.md"):
        text = " ".join(page.read_text(encoding="utf-8").split())
        for fact in ("143", "118", "116", "+6.63", "[4.02, 9.23]", "56.19 against 49.56", "round 1000",
                     "+0.86 (64.43 against 63.56)"):
            assert fact in text, (page.name, fact)


def test_first_contact_pages_say_what_a_new_user_meets():
    """Ctrl-C, the torch/torchvision line, the GPU-sized warning, ``fedrcl methods`` and the TensorBoard
    screenshot are where a new user reads."""
    started = " ".join((DOCS / "getting-started.md").read_text(encoding="utf-8").split())
    for said in ("are builds that do not work together", "fedrcl: warning: this run would train for about",
                 "configs/cpu/cifar10_a01_resnet8.yaml", "a second Ctrl-C stops it at once", "fedrcl methods",
                 "--data.root", "cifar10.npz"):
        assert said in started, said
    assert (DOCS / "tensorboard_accuracy_first.png").is_file()
    reliability = (DOCS / "reliability.md").read_text(encoding="utf-8")
    row = next(line for line in reliability.splitlines() if line.startswith("| Ctrl-C (SIGINT)"))
    assert "status 130" in row and "stopped by a second SIGINT" in row and "bitwise" in row
