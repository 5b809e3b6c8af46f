"""Paper tables (``fedrcl report --format markdown|latex|csv``): cells over seeds with their 95% interval, the best
in bold, the paper's number beside, LaTeX escaped and held against golden files built from synthetic runs.

No TeX engine is installed here or on CI (``pdflatex``, ``tectonic``: neither on PyPI as a working binary), so
the LaTeX is not compiled: it is compared with ``tests/golden/*.tex`` (reviewed by hand) and checked for what
would stop a compile (unbalanced braces and environments, a row with the wrong number of cells).
"""
from __future__ import annotations

import csv
import io
import math
import os
import re
from pathlib import Path

import pytest

from fedrcl.analysis.catalogue import collect_runs
from fedrcl.analysis.paper_table import paper_number, selected_table, settings_table
from fedrcl.analysis.seed_stats import summarize_seeds
from fedrcl.analysis.selection import select_on_validation
from fedrcl.analysis.tables import Cell, Table, best_rows, latex_escape, render_csv, render_latex, render_markdown
from fedrcl.cli import main
from fedrcl.report import load_paper_results
from test_selection import SWEEP, sweep_config, write_run, write_sweep

GOLDEN = Path(__file__).parent / "golden"
PAPER = load_paper_results()


def write_methods(root: Path) -> Path:
    """FedAvg, FedRCL and a user's ``My_Method`` on CIFAR-10 alpha 0.1 and 0.3, two seeds each, without a
    validation split (``val/acc*`` are the test accuracy), three rounds."""
    finals = {"FedAvg": (0.40, 0.44), "FedRCL": (0.46, 0.47), "My_Method": (0.30, 0.50)}
    for alpha in (0.1, 0.3):
        for method, values in finals.items():
            for seed, final in enumerate(values):
                config = sweep_config(method, seed, val=0, lr=0.1)
                config["data"]["alpha"] = alpha
                if method == "My_Method":
                    config["model"]["class_path"] = "my_pkg.My_Method"
                write_run(root / f"a{alpha}" / method / f"seed{seed}", config,
                          {"val/acc": [final - 0.1, final - 0.05, final],
                           "val/acc_ema": [final - 0.1, final - 0.05, final + alpha / 10]})
    return root


def golden(name: str, text: str) -> None:
    """``text`` equals ``tests/golden/<name>`` (``FEDRCL_WRITE_GOLDEN=1`` writes it instead, to review by hand)."""
    path = GOLDEN / name
    if os.environ.get("FEDRCL_WRITE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert text == path.read_text(encoding="utf-8")


def compiles_by_structure(latex: str, columns: int) -> None:
    r"""What would stop a LaTeX compile: braces and ``\begin``/``\end`` balanced, each body row with ``columns``
    + 1 cells (an unescaped ``&`` adds one), no unescaped ``%``, ``_`` or ``#`` outside the comment line."""
    body = [line for line in latex.splitlines() if not line.startswith("%")]
    text = "\n".join(body).replace(r"\{", "").replace(r"\}", "")
    assert text.count("{") == text.count("}")
    assert re.findall(r"\\begin\{(\w+)\}", text) == list(reversed(re.findall(r"\\end\{(\w+)\}", text)))
    assert not re.search(r"(?<!\\)[%_#]", text)
    rows = [line for line in body if line.rstrip().endswith(r"\\")]
    for row in rows:
        assert len(re.split(r"(?<!\\)&", row)) == columns + 1, row


def test_a_cell_is_the_mean_and_the_half_width_of_the_95_percent_interval():
    cell = Cell(summarize_seeds([50.0, 52.0]), 48.5, 1000)
    # mean 51, std sqrt(2), half-width t(0.975, 1) * sqrt(2) / sqrt(2) = 12.706
    assert cell.text() == "51.00 ± 12.71" and cell.paper_text() == "paper 48.50, round 1000"
    three = Cell(summarize_seeds([60.0, 61.0, 65.0]))  # mean 62, std sqrt(7), t(2) = 4.303: 4.303 * sqrt(7 / 3)
    assert three.text() == f"62.00 ± {4.302652730 * math.sqrt(7 / 3):.2f}" == "62.00 ± 6.57"
    assert Cell(summarize_seeds([70.0])).text() == "70.00" and Cell(summarize_seeds([70.0])).paper_text() == ""


def hand_table() -> Table:
    return Table("Caption 5% of_it.", "Method", ("A", "B"), (
        ("FedAvg", (Cell(summarize_seeds([49.0, 51.0]), 48.5, 1000), Cell(summarize_seeds([30.0])))),
        ("Fed_X & Co", (Cell(summarize_seeds([51.0, 51.0])), None)),
        ("Tie", (Cell(summarize_seeds([50.999, 51.001])), Cell(summarize_seeds([10.0])))),
    ))


def test_best_per_column_is_bold_ties_at_the_digits_shown_included():
    table = hand_table()
    assert best_rows(table) == [{1, 2}, {0}]
    assert render_markdown(table) == (
        "Caption 5% of_it.\n\n| Method | A | B |\n|:--|--:|--:|\n"
        "| FedAvg | 50.00 ± 12.71 (paper 48.50, round 1000) | **30.00** |\n"
        "| Fed_X & Co | **51.00 ± 0.00** | - |\n"
        "| Tie | **51.00 ± 0.01** | 10.00 |\n")


def test_latex_escapes_names_and_uses_booktabs_and_pm():
    assert latex_escape("My_Method 50% & #1 {x} α=0.1 ± 2") == \
        r"My\_Method 50\% \& \#1 \{x\} $\alpha$=0.1 $\pm$ 2"
    latex = render_latex(hand_table())
    assert latex.splitlines()[:5] == ["% needs \\usepackage{booktabs}", "\\begin{table}[t]", "  \\centering",
                                      "  \\caption{Caption 5\\% of\\_it.}", "  \\label{tab:fedrcl}"]
    assert "    Fed\\_X \\& Co & \\textbf{51.00 $\\pm$ 0.00} & -- \\\\" in latex.splitlines()
    assert [line.strip() for line in latex.splitlines() if "rule" in line] == ["\\toprule", "\\midrule",
                                                                               "\\bottomrule"]
    compiles_by_structure(latex, 2)


def test_csv_has_a_line_per_cell_with_its_numbers():
    rows = list(csv.DictReader(io.StringIO(render_csv(hand_table()))))
    assert [(r["method"], r["column"], r["best"]) for r in rows] == [
        ("FedAvg", "A", "0"), ("FedAvg", "B", "1"), ("Fed_X & Co", "A", "1"), ("Tie", "A", "1"), ("Tie", "B", "0")]
    first = rows[0]
    assert float(first["mean"]) == 50.0 and float(first["ci95_half_width"]) == pytest.approx(12.7062, abs=1e-4)
    assert float(first["std"]) == pytest.approx(math.sqrt(2), abs=1e-5) and first["n"] == "2"
    assert (first["paper"], first["paper_round"]) == ("48.5", "1000")
    assert rows[1]["ci95_half_width"] == "" and rows[1]["paper"] == ""  # one seed: no interval


def test_the_papers_number_is_at_our_round_where_it_reports_it_else_at_its_last():
    fedavg = {"dataset": "cifar10", "partition": "dirichlet", "alpha": 0.1, "shards_per_client": None,
              "num_clients": 100, "clients_per_round": 5, "local_epochs": 5, "batch_size": 50,
              "local_iters_per_epoch": 10, "server": "FedAvg", "method": "FedAvg", "beta": None, "levels": None,
              "backbone": "ResNet18", "width": 64, "partition_file": None}
    assert paper_number(PAPER, fedavg, 500) == (58.8, 500)
    assert paper_number(PAPER, fedavg, 3) == (70.82, 1000)
    assert paper_number(PAPER, {**fedavg, "width": 8}, 500) is None


def test_settings_table_matches_its_golden_file(tmp_path):
    table = settings_table(collect_runs(write_methods(tmp_path / "runs")), PAPER)
    assert table.columns == ("cifar10 dirichlet α=0.1, round 3", "cifar10 dirichlet α=0.3, round 3")
    assert [name for name, _ in table.rows] == ["FedAvg", "FedRCL", "My_Method"]
    fedavg = table.rows[0][1][0]
    assert (fedavg.summary.mean, fedavg.summary.n, fedavg.paper) == (pytest.approx(43.0), 2, 70.82)
    latex = render_latex(table)
    golden("settings_table.tex", latex)
    compiles_by_structure(latex, 2)
    golden("settings_table.md", render_markdown(table))


def test_selected_table_matches_its_golden_file(tmp_path):
    table = selected_table(select_on_validation(collect_runs(write_sweep(tmp_path / "runs"))), PAPER)
    latex = render_latex(table)
    golden("selected_table.tex", latex)
    compiles_by_structure(latex, 3)


def test_a_method_swept_in_its_own_arguments_has_a_row_per_setting(tmp_path):
    table = settings_table(collect_runs(write_sweep(tmp_path / "runs", SWEEP)), PAPER)
    assert [name for name, _ in table.rows] == ["FedAvg (lr=0.01)", "FedAvg (lr=0.1)", "FedProx (lr=0.01, mu=0.1)",
                                                "FedProx (lr=0.01, mu=1.0)", "FedProx (lr=0.1, mu=0.1)"]
    # test/acc_ema (the runs have a validation split): FedAvg lr 0.01 at round 3: 46 and 48
    assert table.rows[0][1][0].summary.mean == pytest.approx(47.0)


def test_fedrcl_report_format_prints_the_table_alone(tmp_path, capsys):
    root = write_methods(tmp_path / "runs")
    out = tmp_path / "table.tex"
    main(["report", str(root), "--format", "latex", "--out", str(out)])
    assert out.read_text(encoding="utf-8") == render_latex(settings_table(collect_runs(root), PAPER))
    main(["report", str(root), "--format", "csv"])
    assert capsys.readouterr().out.splitlines()[0] == "method,column,mean,ci95_half_width,std,n,best,paper,paper_round"
    main(["report", str(root), "--format", "markdown", "--rounds", "2", "3"])
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| Method"))
    assert header.count("round 2") == 2 and header.count("round 3") == 2
    sweep = write_sweep(tmp_path / "sweep")
    main(["report", str(sweep), "--select", "val", "--format", "latex"])
    latex = capsys.readouterr().out
    assert latex.startswith("% Selection on validation") and "\\begin{table}" in latex
    main(["report", str(sweep), "--select", "val", "--format", "csv"])
    captured = capsys.readouterr()
    assert captured.out.startswith("method,column,") and "Warning: unequal tuning budgets" in captured.err


@pytest.mark.parametrize("args", [["--select", "val"], ["--format", "markdown"], ["--format", "latex"]])
def test_the_tuning_page_shows_what_fedrcl_report_prints_of_its_runs(args, capsys, monkeypatch):
    """docs/tuning.md's tables are the command's output on the committed sweep (docs/tuning_runs)."""
    monkeypatch.chdir(Path(__file__).parents[1])
    page = Path("docs/tuning.md").read_text(encoding="utf-8")
    assert f"fedrcl report docs/tuning_runs {' '.join(args)}\n" in page
    main(["report", "docs/tuning_runs", *args])
    lines = [line for line in capsys.readouterr().out.splitlines() if line and not line.startswith("#")]
    assert len(lines) > 5 and all(line in page for line in lines)
