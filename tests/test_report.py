"""``fedrcl report``: the paper's numbers as typed in, and our runs placed in the paper's tables."""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import yaml
from torch.utils.tensorboard import SummaryWriter

from conftest import REPO, run_cli
from fedrcl.analysis.runs import load_scalars
from fedrcl.cli import main
from fedrcl.report import RunResult, collect_runs, load_paper_results, render_report

TEX = REPO.parent / "shared" / "reference" / "fedrcl-paper.tex"


def tex_table1() -> dict[tuple[str, str], list[float]]:
    """``{(dataset, method): [10 numbers]}`` read from the LaTeX rows of ``tab:cifar100``."""
    text = TEX.read_text()
    start = text.index(r"\label{tab:cifar100}")
    body = text[start:text.index(r"\end{tabular}", start)]
    rows, dataset = {}, None
    for line in body.splitlines():
        block = re.search(r"\\multirow\{\d+\}\{\*\}\{([^}]*)\}", line)
        dataset = block.group(1) if block else dataset
        cells = [c.strip() for c in line.strip().removesuffix(r"\\").split("&")]
        if dataset is None or len(cells) != 12 or not all(re.search(r"\d\.\d\d", c) for c in cells[2:]):
            continue  # header rows
        method = re.sub(r"\\textbf\{(.*)\}", r"\1", re.sub(r"~?\\cite[pt]?\{[^}]*\}", "", cells[1])).strip()
        rows[(dataset, method.removesuffix(" (ours)"))] = [float(re.sub(r"\\textbf\{(.*)\}", r"\1", c))
                                                          for c in cells[2:]]
    return rows


@pytest.mark.skipif(not TEX.exists(), reason="the paper's LaTeX source is not beside the repository")
def test_paper_results_are_table1_of_the_tex_source():
    expected = tex_table1()
    assert len(expected) == 30
    table = next(t for t in load_paper_results()["tables"] if t["label"] == "tab:cifar100")
    assert table["rounds"] == [500, 1000]
    got = {(block, row): [v for column in table["columns"] for v in cells[column["name"]]]
           for block, rows in table["values"].items() for row, cells in rows.items()}
    assert got == expected


def test_paper_table1_cells_name_runs_we_can_make():
    from fedrcl import algorithms
    from fedrcl.data.datasets import DATASETS

    table = next(t for t in load_paper_results()["tables"] if t["label"] == "tab:cifar100")
    assert all(hasattr(algorithms, row["setting"]["method"]) for row in table["rows"])
    assert all(block["setting"]["dataset"] in DATASETS for block in table["blocks"])
    assert [c["setting"].get("alpha") for c in table["columns"]] == [0.05, 0.1, 0.3, 0.6, None]


def test_ema_at_a_round_or_at_the_last_round_reached():
    run = RunResult(REPO, ("version_0",), {}, np.array([1, 2, 3, 5]), np.array([10.0, 20.0, 30.0, 50.0]))
    assert run.ema_at(3) == (30.0, True)
    assert run.ema_at(4) == (30.0, True)  # evaluated every other round: the last evaluation so far
    assert run.ema_at(500) == (50.0, False)
    assert RunResult(REPO, (), {}).ema_at(500) is None


def fake_config(dataset="cifar100", partition="dirichlet", alpha=0.05, method="FedRCL", backbone="ResNet18",
                clients_per_round=5, participation=None) -> dict:
    """The keys of a LightningCLI-saved config.yaml that the report reads, as a paper config gives them."""
    return {"trainer": {"rounds": 1000, "clients_per_round": clients_per_round,
                        "participation": participation, "local_epochs": 5, "server": None},
            "model": {"class_path": f"fedrcl.algorithms.{method}",
                      "init_args": {"backbone": {"class_path": f"fedrcl.models.{backbone}",
                                                 "init_args": {"width": 64, "norm_groups": 2}}}},
            "data": {"dataset": dataset, "num_clients": 100, "partition": partition, "alpha": alpha,
                     "partition_file": None, "batch_size": 50, "local_iters_per_epoch": 10}}


def fake_version(folder, config: dict, curve: dict[int, float]) -> None:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    writer = SummaryWriter(str(folder))
    for step, value in curve.items():
        writer.add_scalar("val/acc_ema", value, step)
    writer.close()


def rows_of(markdown: str, heading: str) -> dict[str, list[str]]:
    """``{row label: cells}`` of the first table after ``heading``."""
    after = markdown.split(f"\n{heading}\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(after) if line.startswith("|"))
    table = list(itertools.takewhile(lambda line: line.startswith("|"), after[start:]))
    rows = ([c.strip() for c in line.strip("|").split("|")] for line in table[2:])
    return {cells[0]: cells[1:] for cells in rows}


@pytest.fixture
def fake_runs(tmp_path):
    root = tmp_path / "runs"
    interrupted = {r: r / 1000 for r in range(1, 290)} | {r: 0.99 for r in range(290, 301)}
    fake_version(root / "cifar100_a005" / "version_0", fake_config(), interrupted)
    fake_version(root / "cifar100_a005" / "version_1", fake_config(), {r: r / 1000 for r in range(290, 601)})
    # a method config on top of the same base config keeps the run name: the config tells them apart
    fake_version(root / "cifar100_a005" / "version_2", fake_config(method="FedAvg"),
                 {r: 0.4 for r in range(1, 1001)})
    fake_version(root / "cpu" / "cifar10_a005_cnn" / "version_0", fake_config("cifar10", backbone="SmallCNN"),
                 {r: 0.3 for r in range(1, 11)})
    iid = fake_config("cifar10", "iid", 0.3, clients_per_round=None, participation=0.05)
    fake_version(root / "deeper" / "cifar10_iid" / "version_0", iid, {r: 0.9 for r in range(1, 1001)})
    fake_version(root / "deeper" / "cifar10_iid_short" / "version_0", iid, {r: 0.1 for r in range(1, 101)})
    return root


def test_runs_are_told_apart_by_config_and_resumed_versions_merge(fake_runs):
    runs = {(r.path.name, r.versions): r for r in collect_runs(fake_runs)}
    assert set(runs) == {("cifar100_a005", ("version_0", "version_1")), ("cifar100_a005", ("version_2",)),
                         ("cifar10_a005_cnn", ("version_0",)), ("cifar10_iid", ("version_0",)),
                         ("cifar10_iid_short", ("version_0",))}
    resumed = runs[("cifar100_a005", ("version_0", "version_1"))]
    assert resumed.setting["method"] == "FedRCL" and resumed.last_round == 600
    assert resumed.ema_at(295) == (pytest.approx(29.5), True)  # the resumed version's point wins
    assert runs[("cifar100_a005", ("version_2",))].setting["method"] == "FedAvg"
    assert runs[("cifar10_iid", ("version_0",))].setting["clients_per_round"] == 5  # from participation 0.05


def test_report_puts_our_numbers_beside_the_papers(fake_runs):
    markdown = render_report(collect_runs(fake_runs))
    cifar100 = rows_of(markdown, "### CIFAR-100")
    assert cifar100["FedRCL (paper)"] == ["43.71", "54.63", "49.82", "58.23", "57.89", "63.46", "58.71",
                                          "64.06", "60.25", "64.81"]
    # 500 rounds reached: the EMA there; 1000 not reached: the last round's (600), marked
    assert cifar100["FedRCL (ours)"] == ["50.00 (+6.29)", "60.00* (+5.37)"] + [""] * 8
    assert cifar100["FedAvg (ours)"] == ["40.00 (+8.80)", "40.00 (+0.14)"] + [""] * 8
    assert cifar100["MOON (ours)"] == [""] * 10
    cifar10 = rows_of(markdown, "### CIFAR-10")
    assert cifar10["FedRCL (ours)"] == [""] * 8 + ["90.00 (+0.30)", "90.00 (-1.90)"]  # the longer run of two
    assert cifar10["FedRCL (paper)"][-2:] == ["89.70", "91.90"]
    assert all(cells == [""] * 10 for label, cells in rows_of(markdown, "### Tiny-ImageNet").items()
               if label.endswith("(ours)"))
    runs = rows_of(markdown, "## Runs")
    cnn = next(cells for label, cells in runs.items() if label.endswith("cifar10_a005_cnn"))
    assert cnn[5:] == ["SmallCNN (width 64)", "5/100", "10", "30.00", "—"]
    shown = next(cells for label, cells in runs.items() if label.endswith("/cifar10_iid"))
    assert shown[-1] == "tab:cifar100 / CIFAR-10 / FedRCL / i.i.d."


@pytest.mark.slow
def test_fedrcl_report_command_reads_real_runs(tmp_path, data_root, capsys):
    cli = run_cli(data_root, tmp_path / "runs", rounds=2, model="fedrcl.algorithms.FedAvg")
    ema = load_scalars(cli.trainer.log_dir)["val/acc_ema"][1][-1]
    capsys.readouterr()
    main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "report.md")])
    markdown = (tmp_path / "report.md").read_text()
    assert capsys.readouterr().out == ""
    main(["report", str(tmp_path / "runs")])
    assert capsys.readouterr().out == markdown
    cells = rows_of(markdown, "## Runs")[str(tmp_path / "runs" / "quickstart")]
    assert cells[:4] == ["version_0", "digits", "dirichlet α=0.3", "FedAvg"]
    assert cells[-3:] == ["2", f"{100 * ema:.2f}", "—"]
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path / "missing")])
    assert info.value.code == 2
