"""A paper table (rows x columns of numbers over seeds) and its markdown, LaTeX and CSV forms.

Each cell is a number measured under several seeds: ``mean ± h`` with ``h`` the half-width of the 95%
Student-t interval of the mean (``fedrcl.analysis.seed_stats.summarize_seeds``; one seed: its value alone),
optionally the paper's own number for the same setting beside it. The best mean of each column is in bold
(``**`` in markdown, ``\\textbf{}`` in LaTeX; every row that ties it at the digits shown). LaTeX is a
``table`` float with ``booktabs`` rules (``\\usepackage{booktabs}``), text escaped (``latex_escape``); CSV has
one line per cell with the numbers to 6 significant digits, for a plotting script.
"""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from typing import Optional

from fedrcl.analysis.seed_stats import SeedSummary

__all__ = ["Cell", "Table", "best_rows", "latex_escape", "render_csv", "render_latex", "render_markdown"]


@dataclass(frozen=True)
class Cell:
    """One number over seeds (``summary``, already in the unit shown: % for accuracies), and the paper's number
    for the same setting with the round it is at, where the paper has one."""

    summary: SeedSummary
    paper: Optional[float] = None
    paper_round: Optional[int] = None

    def text(self, digits: int = 2) -> str:
        """``mean ± half-width`` of the 95% interval (``mean`` for one seed)."""
        s = self.summary
        if s.n < 2 or math.isnan(s.ci95):
            return f"{s.mean:.{digits}f}"
        return f"{s.mean:.{digits}f} ± {s.ci95:.{digits}f}"

    def paper_text(self, digits: int = 2) -> str:
        """``paper 57.12, round 1000`` (the paper's number and its round), ``""`` when the paper has none."""
        if self.paper is None:
            return ""
        at = f", round {self.paper_round}" if self.paper_round is not None else ""
        return f"paper {self.paper:.{digits}f}{at}"


@dataclass(frozen=True)
class Table:
    """``rows`` of ``(label, cells)`` under ``columns`` (a cell ``None`` where nothing was measured), a
    ``caption`` saying what the cells are, and the ``label`` LaTeX refers to it by."""

    caption: str
    row_header: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, tuple[Optional[Cell], ...]], ...]
    label: str = "tab:fedrcl"


def best_rows(table: Table, digits: int = 2) -> list[set[int]]:
    """Per column, the rows whose mean is the column's highest at ``digits`` decimals (the bold ones)."""
    best = []
    for j in range(len(table.columns)):
        column = [(i, cell) for i, (_, cells) in enumerate(table.rows) if (cell := cells[j]) is not None]
        means = {i: round(cell.summary.mean, digits) for i, cell in column if not math.isnan(cell.summary.mean)}
        top = max(means.values(), default=None)
        best.append({i for i, m in means.items() if m == top})
    return best


def render_markdown(table: Table, digits: int = 2) -> str:
    """The table in markdown: the caption as a paragraph above it, bold ``**best**``, the paper's number in
    parentheses beside ours."""
    best = best_rows(table, digits)
    lines = [table.caption, "", f"| {table.row_header} | " + " | ".join(table.columns) + " |",
             "|:--|" + "--:|" * len(table.columns)]
    for i, (label, cells) in enumerate(table.rows):
        shown = []
        for j, cell in enumerate(cells):
            if cell is None:
                shown.append("-")
                continue
            text = f"**{cell.text(digits)}**" if i in best[j] else cell.text(digits)
            shown.append(text + (f" ({cell.paper_text(digits)})" if cell.paper is not None else ""))
        lines.append(f"| {label.replace('|', chr(92) + '|')} | " + " | ".join(shown) + " |")
    return "\n".join(lines) + "\n"


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                  "±": r"$\pm$", "α": r"$\alpha$", "γ": r"$\gamma$", "β": r"$\beta$", "μ": r"$\mu$",
                  "Δ": r"$\Delta$", "−": "-"}


def latex_escape(text: str) -> str:
    r"""``text`` as LaTeX text: ``\ & % $ # _ { } ~ ^`` escaped, ``±`` and the Greek letters fedrcl's names use
    as maths."""
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def _latex_cell(cell: Optional[Cell], bold: bool, digits: int) -> str:
    if cell is None:
        return "--"
    text = latex_escape(cell.text(digits))
    text = f"\\textbf{{{text}}}" if bold else text
    if cell.paper is not None:
        text += f" ({latex_escape(cell.paper_text(digits))})"
    return text


def render_latex(table: Table, digits: int = 2) -> str:
    r"""The table as a LaTeX ``table`` float: ``booktabs`` rules, the caption and label, one row per method,
    ``\textbf{}`` for the best of each column, ``$\pm$`` before the interval's half-width."""
    best = best_rows(table, digits)
    lines = ["% needs \\usepackage{booktabs}", "\\begin{table}[t]", "  \\centering",
             f"  \\caption{{{latex_escape(table.caption)}}}", f"  \\label{{{table.label}}}",
             f"  \\begin{{tabular}}{{l{'r' * len(table.columns)}}}", "    \\toprule",
             "    " + " & ".join(latex_escape(c) for c in (table.row_header, *table.columns)) + " \\\\",
             "    \\midrule"]
    for i, (label, cells) in enumerate(table.rows):
        shown = [_latex_cell(cell, i in best[j], digits) for j, cell in enumerate(cells)]
        lines.append("    " + " & ".join([latex_escape(label), *shown]) + " \\\\")
    lines += ["    \\bottomrule", "  \\end{tabular}", "\\end{table}"]
    return "\n".join(lines) + "\n"


def _number(value: Optional[float]) -> str:
    return "" if value is None or math.isnan(value) else f"{value:.6g}"


def render_csv(table: Table, digits: int = 2) -> str:
    """One line per cell measured: row, column, mean, the 95% interval's half-width, sample std, n, whether it
    is its column's best, the paper's number and its round (empty where none)."""
    best = best_rows(table, digits)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([table.row_header.lower(), "column", "mean", "ci95_half_width", "std", "n", "best", "paper",
                     "paper_round"])
    for i, (label, cells) in enumerate(table.rows):
        for j, cell in enumerate(cells):
            if cell is None:
                continue
            s = cell.summary
            writer.writerow([label, table.columns[j], _number(s.mean), _number(s.ci95), _number(s.std), s.n,
                             int(i in best[j]), _number(cell.paper),
                             "" if cell.paper_round is None else cell.paper_round])
    return out.getvalue()
