"""Sphinx configuration of fedrcl's documentation site (``docs/build.md`` says how to build it).

Sphinx + MyST Markdown + autodoc (napoleon reads the Google-style ``Args:`` docstrings) + the Furo theme.
The API reference (``api.md``) lists every module of the package, found at build time, so a new module
appears in it without editing this file.
"""
from __future__ import annotations

import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "tutorial"))  # the tutorial's own module, for its API entries

project = "fedrcl"
author = "fedrcl contributors"
copyright = "fedrcl contributors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
# Run folders, split and seed files and notebooks are data, not pages; no notebook is executed by the build.
exclude_patterns = ["_build", "cpu_runs", "gpu_runs", "seed_runs", "data_runs", "privacy_runs", "baseline_runs", "unbalanced_runs", "sweep_runs", "splits", "**.ipynb", "results_cnn_seeds.md"]

myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
# Optional extras are mocked, so the site builds without them (the Flower adapter needs ``flower``).
autodoc_mock_imports = ["flwr"]
# Lightning's hook docstrings (and their cross-references into Lightning's own site) stay out of this one.
autodoc_inherit_docstrings = False
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # a dataclass's "Attributes:" and its fields are one entry, not two
# Type hints name classes of other libraries (torch, Lightning) that this site has no inventory for.
nitpick_ignore_regex = [(r"py:.*", r"(torch|lightning|torchmetrics|numpy|np|nn|L|jsonargparse|yaml|"
                                   r"matplotlib|safetensors|collections|typing|pathlib|argparse|datetime|F|flwr|"
                                   r"logging|multiprocessing|socket)\..*"),
                        (r"py:.*", r"(Tensor|Path|Namespace|Any|Optional|Callable|Mapping|Sequence|Iterable|"
                                   r"Iterator|Counter|Union|Module|Figure|Axes|ndarray|State|Backbone|Partition|Mode|Tensors|Reduce|"
                                   r"RecordDict|Grid|Message|Run|NodeInfo|Connection)")]

html_theme = "furo"
html_title = "fedrcl"
html_static_path: list[str] = []


def _api_reference() -> str:
    """One section per subpackage, one ``automodule`` per module of the package (found by import path)."""
    import fedrcl

    names = sorted(m.name for m in pkgutil.walk_packages(fedrcl.__path__, "fedrcl.")
                   if not m.name.endswith(".__main__"))  # ``python -m`` entry points run on import
    lines = []
    for package in ["fedrcl", *sorted(n for n in names if "." not in n.removeprefix("fedrcl.")
                                          and (ROOT / n.replace(".", "/")).is_dir())]:
        members = [n for n in names if n.rsplit(".", 1)[0] == package and not (ROOT / n.replace(".", "/")).is_dir()]
        if not members:
            continue
        lines += [f"## `{package}`", "", "```{eval-rst}", f".. automodule:: {package}", "   :no-members:", "```", ""]
        for name in members:
            lines += [f"### `{name}`", "", "```{eval-rst}", f".. automodule:: {name}", "```", ""]
    return "\n".join(lines)


def _fill_api(app, docname: str, source: list[str]) -> None:
    if docname == "api":
        source[0] = source[0].replace("<!-- modules -->", _api_reference())


def setup(app):
    app.connect("source-read", _fill_api)
