"""``fedrcl check``: a method run on every backend, its weights compared with the sequential run's.

The tutorial's table (docs/tutorial.md, "Check your method on every backend") comes from its two commands;
here they run again on the backends that take seconds (sequential, batched; two processes for the agreeing
method) and give the page's rows. Flower's rows are the simulation's (``test_flower.py`` checks the tutorial's
methods on Flower bitwise).
"""
from __future__ import annotations

import re
import shlex

import pytest
import torch

from conftest import REPO
from fedrcl.check import error_line, max_relative_difference

TUTORIAL = REPO / "docs" / "tutorial.md"


def check(argv: list[str], capsys) -> tuple[int, dict[str, list[str]]]:
    """``fedrcl check`` in this process: its exit status and its table's cells by backend."""
    from fedrcl.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["check", *argv])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    return int(stop.value.code or 0), {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def page_checks() -> list[tuple[list[str], dict[str, list[str]]]]:
    """The tutorial's ``fedrcl check`` commands (without ``PYTHONPATH=``) and the table under each."""
    text = TUTORIAL.read_text(encoding="utf-8")
    found = []
    for command, table in re.findall(r"^```console\n\$ (PYTHONPATH=\S+ fedrcl check .*?)\n(\|.*?)\n```$", text,
                                     flags=re.M | re.S):
        rows = [line.split("|")[1:-1] for line in table.splitlines()[2:]]
        found.append((shlex.split(command)[3:], {r[0].strip(): [c.strip() for c in r[1:]] for r in rows}))
    return found


def without_rule(verdict: str) -> str:
    """A verdict without its rule, ``(bitwise)`` or ``(<= 1e-09)``: which of the two a backend that agrees gets
    may change with the CPU (the 16th digit of a float64 sum)."""
    return re.sub(r" \((bitwise|<= [^)]*)\)", "", verdict)


def test_max_relative_difference_by_hand():
    a = {"w": torch.tensor([2.0, -4.0]), "b": torch.zeros(2)}
    assert max_relative_difference(a, {"w": torch.tensor([2.0, -4.0]), "b": torch.zeros(2)}) == 0.0
    assert max_relative_difference(a, {"w": torch.tensor([2.0, -3.0]), "b": torch.zeros(2)}) == 0.25  # 1 / 4
    assert max_relative_difference(a, {"w": a["w"], "b": torch.tensor([0.0, 0.5])}) == 0.5  # zeros: absolute
    assert max_relative_difference(a, {"w": a["w"]}) == float("inf")
    assert max_relative_difference(a, {"w": torch.tensor([float("nan"), 0.0]), "b": a["b"]}) == float("inf")


def test_a_failed_run_is_named_by_its_own_error():
    assert error_line("Round 1\nfedrcl: error: model X: bad\nTraceback\nValueError: y\n") == "fedrcl: error: model X: bad"
    flower = "INFO: start\nNameError: name 'z' is not defined\nThe above exception...\nNo round was done in this run."
    assert error_line(flower) == "NameError: name 'z' is not defined"  # a node's exception, not the last line
    assert error_line("one\nlast\n") == "last" and error_line("") == "no output"
    assert error_line("fedrcl fit: error: unrecognized arguments: x\n(all options: fedrcl fit --help)\n") == \
        "fedrcl fit: error: unrecognized arguments: x"


def test_the_tutorials_tables_are_what_check_prints(data_root, tmp_path, monkeypatch, capsys):
    """Each row's verdict is the page's (its reason too, for a row that falls back); a difference to its two
    digits where it is the method's, not rounding's (which another CPU may change in the 16th digit)."""
    checks = page_checks()
    assert [args[args.index("--model") + 1] for args, _ in checks] == ["my_method.MySharpMethod",
                                                                       "my_method.MyMethod",
                                                                       "my_method.MyLeakyMethod"]
    monkeypatch.syspath_prepend(str(REPO / "docs" / "tutorial"))
    monkeypatch.chdir(REPO)
    for (args, page), backends in zip(checks, (["sequential", "batched", "together"],
                                               ["sequential", "batched", "together", "processes"],
                                               ["sequential", "batched"])):
        assert list(page) == ["sequential", "batched", "together", "processes", "flower"]
        status, rows = check([*args, "--data.root", str(data_root), "--backends", *backends], capsys)
        assert status == (1 if "my_method.MyLeakyMethod" in args else 0)
        for backend in backends:
            _, difference, word = rows[backend]
            assert without_rule(word) == without_rule(page[backend][2]), (backend, rows)
            if not word.startswith("agrees"):
                assert difference == page[backend][1], (backend, rows[backend], page[backend])


def test_together_trains_a_method_together_as_the_sequential_run(data_root, tmp_path, monkeypatch, capsys):
    """The ``together`` backend compares the run's seed trained beside the next one with the sequential run:
    FedLC trains together (its counts stacked per client) and agrees."""
    monkeypatch.syspath_prepend(str(REPO / "docs" / "tutorial"))
    monkeypatch.chdir(tmp_path)
    common = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--data.root", str(data_root),
              "--data.num_clients", "10", "--trainer.clients_per_round", "3", "--trainer.local_epochs", "1",
              "--data.local_iters_per_epoch", "3", "--rounds", "2", "--backends", "sequential", "together"]
    status, rows = check([*common, "--model", "fedrcl.algorithms.FedLC"], capsys)
    assert status == 0 and rows["together"][2] in ("agrees (bitwise)", "agrees (<= 1e-09)"), rows


def test_a_refused_method_is_named_with_its_reason(data_root, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    status, rows = check(["--config", str(REPO / "configs" / "quickstart.yaml"), "--model",
                          "semantics_methods.KeepsLoss", "--data.root", str(data_root), "--data.num_clients", "10",
                          "--trainer.clients_per_round", "3", "--trainer.local_epochs", "1", "--rounds", "1",
                          "--backends", "sequential", "batched"], capsys)
    assert status == 1
    assert rows["sequential"][1:] == ["reference", ""]
    assert rows["batched"][2].startswith("refused: model KeepsLoss: client_loss stores self.last_loss")


def test_a_row_that_did_not_run_what_it_names_says_fell_back(data_root, tmp_path, monkeypatch, capsys):
    """MOON keeps per-client models (``unbatchable_reason``): its batched clients train one after another and its
    seeds together each go on alone. Both rows agree with the sequential run, and say that they fell back."""
    monkeypatch.chdir(tmp_path)
    status, rows = check(["--config", str(REPO / "configs" / "quickstart.yaml"), "--config",
                          str(REPO / "configs" / "methods" / "moon.yaml"), "--model", "fedrcl.algorithms.MOON",
                          "--data.root", str(data_root), "--data.num_clients", "10", "--trainer.clients_per_round",
                          "3", "--trainer.local_epochs", "1", "--data.local_iters_per_epoch", "3", "--rounds", "1",
                          "--backends", "sequential", "batched", "together"], capsys)
    assert status == 0, rows
    assert rows["batched"][2].startswith("fell back (") and "its clients trained one after another" in rows["batched"][2]
    assert rows["together"][2].startswith("fell back (") and "(see its notice)" in rows["together"][2], rows
