"""``crossing`` and paired differences on hand-made curves; the long-horizon script and ``fedrcl report``'s
paired comparison on the committed CPU runs."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from fedrcl.analysis import crossing, paired_differences, value_at


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


def test_a_value_is_the_one_logged_at_that_round_only():
    c = curve([1, 2, 4], [0.1, 0.2, 0.4])
    assert value_at(c, 2) == 0.2
    assert value_at(c, 3) is None and value_at(c, 5) is None   # not evaluated then; not reached


def test_paired_differences_are_per_seed_at_one_round_over_the_seeds_that_logged_it():
    pairs = {3: (curve([1, 2, 3], [10, 20, 30]), curve([1, 2, 3], [12, 18, 35])),
             1: (curve([1, 2], [10, 20]), curve([1, 2, 3], [11, 25, 40])),   # the reference stopped at round 2
             2: (curve([2, 4], [1, 2]), curve([1, 3], [5, 6]))}              # evaluated at other rounds
    assert list(paired_differences(pairs, 2).items()) == [(3, -2.0), (1, 5.0)]   # challenger minus reference
    assert paired_differences(pairs, 3) == {3: 5.0}
    assert paired_differences(pairs, 9) == {}


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


def test_width8_three_seeds_in_results_md_is_what_the_committed_runs_say(capsys, monkeypatch):
    """docs/results.md's ``fedrcl report`` command on the committed width-8 runs (seed 0 and issue 34's seeds
    1, 2) prints the section's rows: per method one seed group of three runs, the Seeds table at the rounds
    asked for, and FedRCL's comparison with FedAvg paired by seed (per-run rows with the rounds run, paired
    differences, crossing lines)."""
    from fedrcl.report import main as report

    results = (REPO / "docs" / "results.md").read_text(encoding="utf-8")
    section = results[results.index("## Width 8 over three seeds"):]
    section = section[:section.index("\n## ")]
    command = next(line for line in section.splitlines() if line.startswith("fedrcl report "))
    monkeypatch.chdir(REPO)
    report(command.split()[2:])
    out = capsys.readouterr().out
    seeds = out.split("\n## Seeds\n", 1)[1].split("\n## ", 1)[0]
    last_common, at_rounds = seeds.split("\nThe same at the rounds asked for", 1)
    groups = [line.split(" | ")[:4] for line in last_common.splitlines() if line.startswith("| r8_")]
    assert groups == [["| r8_fedavg, r8_seeds/fedavg", "FedAvg", "FedAvg", "3"],
                      ["| r8_fedrcl, r8_seeds/fedrcl", "FedRCL", "FedAvg", "3"]]   # seed 0 beside seeds 1, 2
    table = at_rounds[at_rounds.index("| Experiment | Method | Tag |"):].splitlines()
    rows = table[:2] + [line for line in table if line.startswith("| r8_")]
    assert len(rows) == 6
    paired = out.split("\n## Paired by seed\n", 1)[1].split("\n## ", 1)[0]
    block = next(b for b in paired.split("\n### ")[1:] if b.startswith("FedRCL (r8_fedrcl, r8_seeds/fedrcl) "
                                                                      "against FedAvg (r8_fedavg, r8_seeds/fedavg)"))
    lines = [line for line in block.splitlines() if line.startswith(("|", "- "))]
    assert sum(line.startswith(("| FedAvg | ", "| FedRCL | ")) for line in lines) == 6   # seeds 0, 1, 2
    assert sum(line.startswith("- seed ") for line in lines) == 3
    for row in rows + lines:
        assert row in section, row
