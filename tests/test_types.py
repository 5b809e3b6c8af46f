"""The package type-checks: ``python -m mypy`` with the project's configuration (pyproject.toml's
``[tool.mypy]``: the whole package, strict for the extension API and the round, and the tutorial's
``docs/tutorial/my_method.py``, the worked example of that API) exits 0.

A fresh clone checks from scratch (about a minute on two cores, most of it reading torch's and Lightning's
types); later runs reuse ``.mypy_cache`` and take seconds.
"""
from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_mypy_passes():
    check = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True,
                           timeout=600)
    assert check.returncode == 0, check.stdout + check.stderr
