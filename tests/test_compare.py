"""``crossing`` on hand-made curves, and the long-horizon script on the committed CPU runs."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from fedrcl.analysis import crossing


def curve(rounds, values):
    return np.asarray(rounds, dtype=np.int64), np.asarray(values, dtype=np.float64)


def test_below_then_above_for_good():
    ref = curve([1, 2, 3, 4, 5], [10, 20, 30, 40, 50])
    ch = curve([1, 2, 3, 4, 5], [5, 15, 35, 45, 55])
    c = crossing(ref, ch)
    assert (c.first_above, c.above_from, c.last_common) == (3, 3, 5)
    assert c.gap_at_last == pytest.approx(5.0)
    assert crossing(ref, curve([1, 2, 3, 4, 5], [11, 21, 31, 41, 51])).above_from == 1


def test_a_passing_blip_is_not_a_crossing_for_good():
    ref = curve([1, 2, 3, 4, 5, 6], [10, 10, 10, 10, 10, 10])
    ch = curve([1, 2, 3, 4, 5, 6], [5, 11, 9, 10, 12, 13])   # above at 2, below at 3, equal at 4
    c = crossing(ref, ch)
    assert (c.first_above, c.above_from) == (2, 5)


def test_never_above_and_above_only_once_at_the_end():
    ref = curve([1, 2, 3], [10, 20, 30])
    assert crossing(ref, curve([1, 2, 3], [1, 2, 30])).first_above is None   # a tie is not above
    assert crossing(ref, curve([1, 2, 3], [1, 2, 30])).above_from is None
    c = crossing(ref, curve([1, 2, 3], [1, 21, 3]))
    assert (c.first_above, c.above_from, c.gap_at_last) == (2, None, -27.0)


def test_only_common_rounds_count():
    ref = curve([1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 0, 0, 0, 0, 0])
    ch = curve([2, 4, 6, 9], [-1, 1, 1, 5])   # round 9: the reference has not logged it
    c = crossing(ref, ch)
    assert (c.first_above, c.above_from, c.last_common) == (4, 4, 6)
    with pytest.raises(ValueError, match="no round in common"):
        crossing(ref, curve([20], [1]))


@pytest.mark.parametrize("network, columns", [
    ("cnn", [50, *range(100, 1001, 100)]),           # section "Long horizon ... (small CNN, CPU)"
    ("r8", [50, 100, 200, 300, 500, 700, 1000]),     # section "Long horizon: ResNet-18-GN width 8"
])
def test_long_horizon_table_in_the_docs_is_what_the_committed_runs_say(tmp_path, network, columns):
    """bench/long_horizon.py on docs/cpu_runs prints the rows of docs/results.md's long-horizon tables."""
    runs = REPO / "docs" / "cpu_runs"
    cmd = [sys.executable, str(REPO / "bench" / "long_horizon.py"), f"FedAvg={runs / f'{network}_fedavg'}",
           f"FedRCL={runs / f'{network}_fedrcl'}", "--out", str(tmp_path / "long.png"),
           "--rounds", *map(str, columns)]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| FedAvg |", "| FedRCL |"))]
    assert len(rows) == 2
    docs = (REPO / "docs" / "results.md").read_text(encoding="utf-8")
    for row in rows:
        assert row in docs, row
    assert (tmp_path / "long.png").stat().st_size > 10_000


def test_width8_seed_progress_in_cpu_runs_readme_is_what_the_committed_runs_say():
    """bench/seed_pairs.py on the committed width-8 runs (seed 0 and issue 34's seeds) prints the per-run rows and
    the paired EMA differences of docs/cpu_runs/README.md's progress table."""
    runs = REPO / "docs" / "cpu_runs"
    readme = (runs / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("# Long CPU runs: ResNet-18-GN width 8, seeds 1 and 2"):]
    header = next(line for line in section.splitlines() if line.startswith("| method | seed | round "))
    rounds = [cell.removeprefix("round ") for cell in header.strip("|").split(" | ")[2:-1]]
    cmd = [sys.executable, str(REPO / "bench" / "seed_pairs.py"),
           f"FedAvg={runs / 'r8_fedavg'},{runs / 'r8_seeds' / 'fedavg'}",
           f"FedRCL={runs / 'r8_fedrcl'},{runs / 'r8_seeds' / 'fedrcl'}", "--rounds", *rounds]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    rows = [line for line in lines if line.startswith(("| FedAvg | 0", "| FedAvg | 1", "| FedAvg | 2",
                                                        "| FedRCL | 0", "| FedRCL | 1", "| FedRCL | 2"))]
    assert len(rows) >= 4
    rows += [line for line in lines if line.startswith("| EMA, per seed |")]
    for row in rows:
        assert row in section, row
