"""``fedrcl report``: the paper's numbers as typed in, and our runs placed in the paper's tables."""
from __future__ import annotations

import copy
import inspect
import itertools
import os
import re
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import yaml
from torch.utils.tensorboard import SummaryWriter

from conftest import REPO, run_cli
from fedrcl.analysis.runs import load_scalars
from fedrcl.cli import main
from fedrcl.analysis.catalogue import RunResult, collect_runs, unread_versions
from fedrcl.analysis.grouping import comparison_rounds, comparisons, pair_by_seed, paired_crossings, seed_groups
from fedrcl.analysis.selection import method_label
from fedrcl.analysis.settings import experiment_key, method_key, run_setting
from fedrcl.report import _cells, load_paper_results, render_report

TEX = REPO.parent / "shared" / "reference" / "fedrcl-paper.tex"
needs_tex = pytest.mark.skipif(not TEX.exists(), reason="the paper's LaTeX source is not beside the repo")


def _plain(cell: str) -> str:
    r"""A LaTeX cell as text: citations, ``(ours)``, ``\textbf{}`` and braces dropped."""
    cell = re.sub(r"~?\\cite[pt]?\{[^}]*\}", "", cell)
    return re.sub(r"\\textbf\{|[{}]", "", cell).replace(" (ours)", "").strip()


def tex_table(label: str) -> tuple[str, list[tuple[Optional[str], str, list[float]]]]:
    r"""The header text and the number rows ``(block, row name, numbers)`` of the tabular after
    ``\label{label}``; ``block``: the last ``\multirow`` name above the row (Table 1's data sets), or None."""
    text = TEX.read_text()
    start = text.index(rf"\label{{{label}}}")
    body = text[text.index(r"\begin{tabular}", start):text.index(r"\end{tabular}", start)]
    header, rows, block = "", [], None
    for line in body.splitlines()[1:]:
        block = next(iter(re.findall(r"\\multirow\{\d+\}\{\*\}\{([^}]*)\}", line)), block)
        cells = [_plain(c) for c in line.strip().removesuffix(r"\\").split("&")]
        name_at = 1 if block else 0
        numbers = cells[name_at + 1:]
        if numbers and all(re.fullmatch(r"\d+\.\d+", c) for c in numbers):
            rows.append((block, cells[name_at], [float(c) for c in numbers]))
        elif not rows:
            header += line
    return header, rows


def paper_rows(table: dict, blocks_down: bool) -> list[tuple[Optional[str], str, list[float]]]:
    """``table``'s values in the tex's order: a row per (block, method) with its columns x rounds when the
    blocks go down the tex table (Table 1), else a row per method with its blocks x columns x rounds."""
    def numbers(row, blocks):
        return [v for block in blocks for column in block.get("columns", table.get("columns"))
                for v in table["values"][block["name"]][row["name"]][column["name"]]]
    if blocks_down:
        return [(block["name"], row["name"], numbers(row, [block])) for block in table["blocks"]
                for row in table["rows"]]
    return [(None, row["name"], numbers(row, table["blocks"])) for row in table["rows"]]


def _tex(name: str) -> str:
    r"""A column name as the tex header writes it, without spaces: ``α=0.05`` is ``$\alpha=0.05$``."""
    return name.replace("α", r"$\alpha").replace("γ", r"$\gamma").replace(" ", "")


PAPER = load_paper_results()


@needs_tex
def test_every_results_table_of_the_tex_is_typed_in():
    labels = re.findall(r"\\label\{(tab:[^}]*)\}", TEX.read_text())
    assert [t["label"] for t in PAPER["tables"]] == labels


@needs_tex
@pytest.mark.parametrize("table", PAPER["tables"], ids=lambda t: t["label"])
def test_paper_results_are_the_tex_tables(table):
    header, expected = tex_table(table["label"])
    blocks_down = expected[0][0] is not None
    assert paper_rows(table, blocks_down) == expected
    blocks = table["blocks"][:1] if blocks_down else table["blocks"]
    columns = [c["name"] for b in blocks for c in b.get("columns", table.get("columns"))]
    header = header.replace(" ", "")
    at = 0
    for name in columns:  # the column names in the tex header's order
        at = header.index(_tex(name), at) + 1
    rounds = [int(r) for r in re.findall(r"(\d+)R\b", header)]
    if rounds:
        assert rounds == [r for _ in columns for r in table["rounds"]]
    else:  # one number per cell, no round in the tex: the note says which and why
        assert table["rounds"] == [1000] and "1000R" in table["note"]


def test_single_round_tables_repeat_other_tables_at_1000_rounds():
    tables = {t["label"]: t["values"] for t in PAPER["tables"]}
    table1, layers = tables["tab:cifar100"]["CIFAR-100"], tables["tab:layer_abl"]["CIFAR-100"]
    for row, same in (("Baseline", "FedAvg"), ("Multi-layers", "FedRCL")):
        assert layers[row] == {alpha: table1[same][alpha][1:] for alpha in layers[row]}
    table5, table_b = tables["tab:integration_server"]["Dirichlet α=0.3"], \
        tables["tab:integration_server_sup"]["Dirichlet α=0.3"]
    differ = {(row, dataset) for row, cells in table5.items() for dataset, values in cells.items()
              if values != table_b[row][dataset][1:]}
    assert differ == {("FedADAM + FedRCL", "Tiny-ImageNet")}  # 41.57 in Table 5, 42.27 in Table B


def test_paper_cells_name_runs_we_can_make():
    from fedrcl import algorithms, models, server
    from fedrcl.data.datasets import DATASETS

    keys = set(run_setting({}))
    for table in PAPER["tables"]:
        for _, _, _, required in _cells(table):
            assert set(required) <= keys, table["label"]
            assert hasattr(algorithms, required["method"]) and hasattr(server, required["server"])
            assert hasattr(models, required["backbone"]) and required["dataset"] in DATASETS
    table1 = PAPER["tables"][0]
    assert [c["setting"].get("alpha") for c in table1["columns"]] == [0.05, 0.1, 0.3, 0.6, None]


def test_ema_at_a_round_or_at_the_last_round_reached():
    run = RunResult(REPO, ("version_0",), {}, np.array([1, 2, 3, 5]), np.array([10.0, 20.0, 30.0, 50.0]))
    assert run.ema_at(3) == (30.0, True)
    assert run.ema_at(4) == (30.0, True)  # evaluated every other round: the last evaluation so far
    assert run.ema_at(500) == (50.0, False)
    assert RunResult(REPO, (), {}).ema_at(500) is None


def fake_config(dataset="cifar100", partition="dirichlet", alpha=0.05, method="FedRCL", backbone="ResNet18",
                clients_per_round=5, participation=None) -> dict:
    """The keys of a LightningCLI-saved config.yaml that the report reads, as a paper config gives them."""
    method_args = {"beta": 1.0, "levels": None} if method == "FedRCL" else {}
    backbone = {"class_path": f"fedrcl.models.{backbone}", "init_args": {"width": 64, "norm_groups": 2}}
    return {"trainer": {"rounds": 1000, "clients_per_round": clients_per_round,
                        "participation": participation, "local_epochs": 5, "server": None},
            "model": {"class_path": f"fedrcl.algorithms.{method}",
                      "init_args": {**method_args, "backbone": backbone}},
            "data": {"dataset": dataset, "num_clients": 100, "partition": partition, "alpha": alpha,
                     "partition_file": None, "batch_size": 50, "local_iters_per_epoch": 10}}


def fake_version(folder, config: dict, curve: dict[int, float],
                 scalars: Optional[dict[str, dict[int, float]]] = None) -> None:
    """A version folder: ``config.yaml`` and an event file with ``curve`` as ``val/acc_ema`` and ``scalars``."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    writer = SummaryWriter(str(folder))
    for tag, points in {"val/acc_ema": curve, **(scalars or {})}.items():
        for step, value in points.items():
            writer.add_scalar(tag, value, step)
    writer.close()


def flower_version(folder, config: dict, curve: dict[int, float]) -> None:
    """A version as the Flower ServerApp writes it: ``fedrcl fit``'s config and scalars, and the bytes Flower's
    ArrayRecords carried every round (``flower/down_bytes``, ``flower/up_bytes``)."""
    fake_version(folder, config, curve, {f"flower/{d}_bytes": {r: 1e6 for r in curve} for d in ("down", "up")})


def event_file(version):
    """The one event file of a version folder."""
    (path,) = version.glob("*tfevents*")
    return path


def read_only_folder(parent, monkeypatch) -> Path:
    """A folder under ``parent`` the user cannot write in: mode 555; for root, who may write anywhere,
    ``os.access`` answers for it as the system answers a user without the right."""
    folder = parent / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:
        access = os.access

        def as_a_user(path, mode, **kwargs):
            return not (Path(path) == folder and mode & os.W_OK) and access(path, mode, **kwargs)

        monkeypatch.setattr(os, "access", as_a_user)
    return folder


def rows_of(markdown: str, heading: str) -> dict[str, list[str]]:
    """``{row label: cells}`` of the first table after ``heading``."""
    after = markdown.split(f"\n{heading}\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(after) if line.startswith("|"))
    table = list(itertools.takewhile(lambda line: line.startswith("|"), after[start:]))
    rows = ([c.strip() for c in line.strip("|").split("|")] for line in table[2:])
    return {cells[0]: cells[1:] for cells in rows}


def table_under(markdown: str, header: str) -> list[list[str]]:
    """The cells of each row of the table whose header line is ``header``."""
    after = markdown.split(f"\n{header}\n", 1)[1].splitlines()[1:]
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in itertools.takewhile(lambda line: line.startswith("|"), after)]


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
    markdown = render_report(collect_runs(fake_runs), paper_tables=True)
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
    runs = rows_of(markdown, "## Your runs")
    cnn = next(cells for label, cells in runs.items() if label.endswith("cifar10_a005_cnn"))
    assert cnn[5:] == ["SmallCNN (width 64)", "5/100", "10 of 1000, not finished", "30.00", "—"]
    shown = next(cells for label, cells in runs.items() if label.endswith("/cifar10_iid"))
    assert shown[-1] == "tab:cifar100 / CIFAR-10 / FedRCL / i.i.d."


def section(markdown: str, label: str) -> str:
    """The part of the report under the heading of table ``label``."""
    start = markdown.index(f"(`{label}`)\n")
    return markdown[start:markdown.find("\n## ", start)]


def test_report_renders_every_table_in_the_papers_layout():
    markdown = render_report([], paper_tables=True)
    for table in PAPER["tables"]:
        assert f"\n## {table['title']} (`{table['label']}`)\n" in markdown
        for block in table["blocks"]:
            rows = rows_of(section(markdown, table["label"]), f"### {block['name']}")
            assert len(rows) == 2 * len(table["rows"])
    shards = section(markdown, "tab:quantity-based")
    assert "| Method | γ=2 500R | γ=2 1000R | γ=5 500R | γ=5 1000R |" in shards  # a block's own columns
    assert rows_of(shards, "### CIFAR-100")["FedRCL (paper)"] == ["51.09", "59.78", "58.05", "63.50"]
    assert rows_of(section(markdown, "tab:local_epochs"), "### CIFAR-100")["FedLC (paper)"][2] == "42.70"
    layers = section(markdown, "tab:layer_abl")
    assert "| Method | α=0.05 1000R | α=0.1 1000R | α=0.3 1000R | α=0.6 1000R |" in layers
    assert "Table 1's 1000R numbers" in layers  # the note


# configs/README.md's recipe for a cell of each table: the cells its run fills
RECIPES = [
    (["tinyimagenet_a03.yaml"], ["tab:cifar100 / Tiny-ImageNet / FedRCL / α=0.3"]),
    (["cifar100_a005.yaml", "methods/fedavg.yaml"],
     ["tab:cifar100 / CIFAR-100 / FedAvg / α=0.05", "tab:cl_abl / CIFAR-100 / Baseline / α=0.05",
      "tab:layer_abl / CIFAR-100 / Baseline / α=0.05"]),
    (["cifar100_a03.yaml", "methods/fedscl.yaml"], ["tab:cl_abl / CIFAR-100 / FedSCL / α=0.3"]),
    (["cifar100_a01.yaml", "methods/fedcl.yaml"], ["tab:cl_abl / CIFAR-100 / FedCL / α=0.1"]),
    (["cifar100_a01.yaml", "methods/fedrcl_last_level.yaml"],
     ["tab:layer_abl / CIFAR-100 / Last-layer only / α=0.1"]),
    (["cifar100_a03.yaml", "--model.init_args.beta", "5"], []),  # the beta figure's runs fill no table
    (["cifar10_a03.yaml", "settings/participation2_clients500.yaml", "methods/moon.yaml"],
     ["tab:large_scale / CIFAR-10 / MOON / 500 clients"]),
    (["tinyimagenet_a03.yaml", "server/fedacg.yaml"],
     ["tab:integration_server / Dirichlet α=0.3 / FedACG + FedRCL / Tiny-ImageNet",
      "tab:integration_server_sup / Dirichlet α=0.3 / FedACG + FedRCL / Tiny-ImageNet"]),
    (["cifar10_a03.yaml", "server/fedadam.yaml", "methods/feddecorr.yaml"],
     ["tab:integration_server_sup / Dirichlet α=0.3 / FedADAM + FedDecorr / CIFAR-10"]),
    (["cifar10_iid.yaml", "settings/shards_gamma5.yaml", "methods/fedlc.yaml"],
     ["tab:quantity-based / CIFAR-10 / FedLC / γ=5"]),
    (["cifar100_a03.yaml", "backbones/mobilenetv2.yaml"],
     ["tab:other_backbone / CIFAR-100 / FedRCL / MobileNet-V2"]),
    (["cifar100_a03.yaml", "backbones/vgg9.yaml", "methods/fitnet.yaml"],
     ["tab:other_backbone / CIFAR-100 / + FitNet / VGG-9"]),
    (["tinyimagenet_a005.yaml", "settings/local_epochs10.yaml", "methods/feddecorr.yaml"],
     ["tab:local_epochs / Tiny-ImageNet / FedDecorr / α=0.05"]),
]


@pytest.mark.parametrize("args, cells", RECIPES, ids=[" ".join(args) for args, _ in RECIPES])
def test_a_run_made_by_the_configs_recipe_fills_its_cells(args, cells, capsys):
    argv = ["fit"]
    for arg in args:
        argv += ["--config", str(REPO / "configs" / arg)] if arg.endswith(".yaml") else [arg]
    with pytest.raises(SystemExit):
        main(argv + ["--print_config"])
    setting = run_setting(yaml.safe_load(capsys.readouterr().out))
    run = RunResult(REPO / "runs" / "recipe", ("version_0",), setting, np.array([1000]), np.array([50.0]))
    assert rows_of(render_report([run]), "## Your runs")[str(run.path)][-1] == ("; ".join(cells) or "—")


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
    cells = rows_of(markdown, "## Your runs")["quickstart"]
    assert cells[:4] == ["version_0", "digits", "dirichlet α=0.3", "FedAvg"]
    assert cells[-3:] == ["2 of 2", f"{100 * ema:.2f}", "—"]
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path / "missing")])
    assert info.value.code == 2


def test_report_lists_your_runs_first_and_only_the_paper_cells_they_fill(fake_runs):
    markdown = render_report(collect_runs(fake_runs), root=fake_runs)
    headings = [line for line in markdown.splitlines() if line.startswith("## ")]
    assert headings == ["## Your runs", "## Seeds", "## Paired by seed", "## Left out", "## Beside the paper"]
    assert "### CIFAR-100" not in markdown and "(paper)" not in markdown  # the full tables need --paper
    assert "| tab:cifar100 | CIFAR-100 | FedRCL | α=0.05 | 500 | 43.71 | 50.00 (+6.29) |" in markdown
    assert "| tab:cifar100 | CIFAR-100 | FedRCL | α=0.05 | 1000 | 54.63 | 60.00* (+5.37) |" in markdown
    assert len(markdown.splitlines()) < 80  # FedRCL and FedAvg of cifar100_a005 paired: 17 lines of it
    assert "cpu/cifar10_a005_cnn" in rows_of(markdown, "## Your runs")  # paths relative to RUNS_DIR


def test_experiment_ignores_cover_the_resume_fingerprints_ignored_keys():
    from fedrcl.federated.fingerprint import IGNORED
    from fedrcl.analysis.settings import EXPERIMENT_IGNORES

    assert set(IGNORED) <= set(EXPERIMENT_IGNORES)


def test_round_loop_values_are_the_trainers_owned_arguments():
    from fedrcl.federated.trainer import OWNED_BY_ROUNDS
    from fedrcl.analysis.settings import ROUND_LOOP_VALUES

    assert ROUND_LOOP_VALUES == {key: value for key, (value, _) in OWNED_BY_ROUNDS.items()}


def test_round_loop_keys_an_older_fedrcl_wrote_do_not_make_another_experiment():
    """Seed 0 of the width-8 runs was saved with ``max_epochs: null`` ... ; its later seeds without."""
    newer = fake_config()
    older = fake_config()
    older["trainer"].update(max_epochs=None, min_epochs=None, max_steps=-1, check_val_every_n_epoch=1,
                            num_sanity_val_steps=None, gradient_clip_val=None, gradient_clip_algorithm=None,
                            reload_dataloaders_every_n_epochs=0)
    assert experiment_key(older) == experiment_key(newer)
    older["trainer"]["max_steps"] = 100  # not the round loop's value: the config says something else
    assert experiment_key(older) != experiment_key(newer)


def test_a_key_added_since_at_its_default_does_not_make_another_experiment():
    """Seed 0 of FedNova was saved before ``data.val_fraction`` existed, seed 1 with ``val_fraction: 0.0``: one
    experiment; a validation split held out is another."""
    older, newer = fake_config(), fake_config()
    newer["data"]["val_fraction"] = 0.0
    assert experiment_key(older) == experiment_key(newer)
    newer["data"]["val_fraction"] = 0.1
    assert experiment_key(older) != experiment_key(newer)
    runs = collect_runs(REPO / "docs" / "baseline_runs" / "cifar10_a01_cnn_fednova")
    assert "val_fraction" not in runs[0].config["data"] and "val_fraction" in runs[1].config["data"]
    assert len(runs) >= 2 and len(seed_groups(runs)) == 1


def test_the_added_keys_are_at_the_defaults_of_the_arguments_they_name():
    """``ADDED_KEYS``' data keys are FederatedDataModule's arguments at their defaults and ``trainer.privacy``
    FederatedTrainer's: a key added later with another default would train otherwise than a config without it."""
    from fedrcl.analysis.settings import ADDED_KEYS
    from fedrcl.data.datamodule import FederatedDataModule
    from fedrcl.federated.trainer import FederatedTrainer
    owners = {"data": inspect.signature(FederatedDataModule.__init__).parameters,
              "trainer": inspect.signature(FederatedTrainer.__init__).parameters}
    for key, value in ADDED_KEYS.items():
        section, _, name = key.partition(".")
        if section in owners and name != "barebones":  # barebones: Lightning's, refused by fedrcl when true
            assert owners[section][name].default == value, key


def test_the_baselines_pair_with_the_fedavg_runs_saved_before_their_keys_existed():
    """docs/seed_runs' FedAvg was saved before the data keys of own data and feature skew and ``trainer.privacy``
    existed and with ``optimizer: null``; FedSAM's runs of docs/baseline_runs after: the same experiment but for
    the method, so ``fedrcl report`` pairs them by seed."""
    fedavg = collect_runs(REPO / "docs" / "seed_runs" / "cifar10_a01_cnn_fedavg")
    fedsam = collect_runs(REPO / "docs" / "baseline_runs" / "cifar10_a01_cnn_fedsam")
    assert "optimizer" in fedavg[0].config and "feature_skew" in fedsam[0].config["data"]
    ((reference, challenger),) = comparisons(seed_groups(fedavg + fedsam))
    assert reference[0].setting["method"] == "FedAvg" and challenger[0].setting["method"] == "FedSAM"
    assert len(pair_by_seed(reference, challenger)) >= 2


def test_the_committed_width8_runs_of_three_seeds_are_one_seed_group_per_method():
    runs = collect_runs(REPO / "docs" / "cpu_runs" / "r8_fedavg") + \
        collect_runs(REPO / "docs" / "cpu_runs" / "r8_seeds" / "fedavg")
    (group,) = seed_groups(runs)
    assert sorted(run.seeds["seed_everything"] for run in group) == [0, 1, 2]


def toy_run(method: str, seed: int, ema: Optional[list[float]] = None, raw: Optional[list[float]] = None,
            lr: float = 0.1, width: int = 8, data_seed: int = 0) -> RunResult:
    """A run of ``method`` under ``seed`` (``data.seed`` 0) with curves at rounds 1, 2, ... (fractions)."""
    config = fake_config(method=method)
    config["seed_everything"] = seed
    config["trainer"]["seed"] = seed
    config["data"]["seed"] = data_seed
    config["model"]["init_args"].update(lr=lr)
    config["model"]["init_args"]["backbone"]["init_args"]["width"] = width
    curves = {tag: (np.arange(1, len(values) + 1), np.asarray(values, dtype=np.float64))
              for tag, values in (("val/acc_ema", ema), ("val/acc", raw)) if values is not None}
    return RunResult(REPO / f"{method}_lr{lr}_w{width}" / f"seed{seed}", ("version_0",), run_setting(config),
                     config=config, curves=curves)


def test_method_key_sets_the_method_aside_but_keeps_the_network():
    fedrcl, fedavg = toy_run("FedRCL", 0).config, toy_run("FedAvg", 0, lr=0.05).config
    assert method_key(fedrcl) == method_key(fedavg) and experiment_key(fedrcl) != experiment_key(fedavg)
    assert method_key(toy_run("FedAvg", 0, width=16).config) != method_key(fedavg)
    other_split = toy_run("FedAvg", 0).config
    other_split["data"]["alpha"] = 0.3
    assert method_key(other_split) != method_key(fedavg)


def test_methods_are_compared_with_fedavg_else_the_first_group():
    runs = [toy_run(method, seed, lr=lr, width=width) for method, lr, width in
            (("FedRCL", 0.1, 8), ("FedAvg", 0.1, 8), ("FedRCL", 0.05, 8), ("FedRCL", 0.1, 16), ("FedLC", 0.1, 16))
            for seed in (0, 1)]
    groups = seed_groups(runs)
    names = {id(group): (group[0].setting["method"], group[0].config["model"]["init_args"]["lr"],
                         group[0].setting["width"]) for group in groups}
    assert [(names[id(ref)], names[id(ch)]) for ref, ch in comparisons(groups)] == [
        (("FedAvg", 0.1, 8), ("FedRCL", 0.1, 8)),
        (("FedAvg", 0.1, 8), ("FedRCL", 0.05, 8)),
        (("FedRCL", 0.1, 16), ("FedLC", 0.1, 16)),  # no FedAvg of width 16: the first group is the reference
    ]
    assert comparisons(seed_groups(runs[:2])) == []


def test_runs_pair_when_all_their_seeds_are_equal_in_seed_order():
    reference = [toy_run("FedAvg", seed) for seed in (10, 2, 0)]
    challenger = [toy_run("FedRCL", 2), toy_run("FedRCL", 10), toy_run("FedRCL", 0, data_seed=1),
                  toy_run("FedRCL", 3)]
    pairs = pair_by_seed(reference, challenger)
    assert list(pairs) == [(2, 2, 0), (10, 10, 0)]  # seed 0 of another split and seed 3 have no partner
    assert pairs[(10, 10, 0)] == (reference[0], challenger[1])


def test_paired_rounds_default_to_the_last_round_all_paired_runs_logged():
    pairs = pair_by_seed([toy_run("FedAvg", 0, [0.1] * 5), toy_run("FedAvg", 1, [0.1] * 9)],
                         [toy_run("FedRCL", 0, [0.1] * 7), toy_run("FedRCL", 1, [0.1] * 4),
                          toy_run("FedRCL", 2, [0.1] * 2)])
    assert comparison_rounds(pairs) == [4]  # seed 2 has no FedAvg run: not paired
    assert comparison_rounds(pairs, [3, 8]) == [3, 8]
    assert comparison_rounds({}) == []


def test_seed_crossings_are_read_up_to_the_last_round_asked_for():
    reference = [toy_run("FedAvg", 0, [0.3, 0.3, 0.3, 0.3, 0.3, 0.3]), toy_run("FedAvg", 1, [0.3, 0.3, 0.3])]
    challenger = [toy_run("FedRCL", 0, [0.2, 0.4, 0.2, 0.4, 0.4, 0.2]), toy_run("FedRCL", 1, [0.4, 0.2, 0.4, 0.4])]
    crossings = paired_crossings(pair_by_seed(reference, challenger), through=5)
    seed0, seed1 = crossings[(0, 0, 0)], crossings[(1, 1, 0)]
    # seed 0 cut at round 5 (it falls below at 6); seed 1's reference stops at 3
    assert (seed0.first_above, seed0.above_from, seed0.last_common) == (2, 4, 5)
    assert seed0.gap_at_last == pytest.approx(0.1)
    assert (seed1.first_above, seed1.above_from, seed1.last_common) == (1, 3, 3)
    assert paired_crossings(pair_by_seed(reference, challenger), through=0) == {}


def test_report_pairs_methods_by_seed_at_the_rounds_asked_for():
    """Two seeds of FedAvg and FedRCL, hand-made curves: the paired rows and crossing lines, and the Seeds
    section at the rounds asked for."""
    runs = [toy_run("FedAvg", 0, ema=[0.10, 0.20, 0.30, 0.40], raw=[0.10, 0.20, 0.30, 0.40]),
            toy_run("FedAvg", 1, ema=[0.10, 0.20, 0.30, 0.40], raw=[0.10, 0.20, 0.30, 0.40]),
            toy_run("FedRCL", 0, ema=[0.05, 0.25, 0.35, 0.45], raw=[0.10, 0.20, 0.30, 0.40]),
            toy_run("FedRCL", 1, ema=[0.12, 0.18, 0.33, 0.47], raw=[0.10, 0.20, 0.30]),
            toy_run("FedLC", 5, ema=[0.1])]  # no FedAvg run of seed 5: compared, but nothing to pair
    markdown = render_report(runs, root=REPO, rounds=[2, 4])
    paired = markdown.split("## Paired by seed\n", 1)[1].split("\n## ", 1)[0]
    assert "### FedRCL (FedRCL_lr0.1_w8) against FedAvg (FedAvg_lr0.1_w8)" in paired
    assert "| FedRCL | 1 | FedRCL_lr0.1_w8/seed1 | 20.00 / 18.00 | - / 47.00 | 4 |" in paired
    header = "| FedRCL minus FedAvg | round 2 | round 4 |"
    differences = {cells[0]: cells[1:] for cells in table_under(paired, header)}
    assert differences["EMA, per seed"] == ["s0 +5.00, s1 -2.00", "s0 +5.00, s1 +7.00"]
    # 6 ± sqrt(2), 95% interval 6 ± t(1) sqrt(2) / sqrt(2) = 6 ± 12.706
    assert differences["EMA, mean"] == ["1.50 ± 4.95 [-42.97, 45.97] (n=2)", "6.00 ± 1.41 [-6.71, 18.71] (n=2)"]
    assert differences["raw, per seed"] == ["s0 +0.00, s1 +0.00", "s0 +0.00"]  # seed 1's raw stops at 3
    assert differences["raw, mean"] == ["0.00 ± 0.00 [0.00, 0.00] (n=2)", "0.00 (n=1)"]
    assert [line for line in paired.splitlines() if line.startswith("- ")] == [
        "- seed 0, FedRCL vs FedAvg EMA: first above at round 2; above for good from round 2 through round 4 "
        "(last common round, gap +5.00)",
        "- seed 1, FedRCL vs FedAvg EMA: first above at round 1; above for good from round 3 through round 4 "
        "(last common round, gap +7.00)"]
    assert "### FedLC (FedLC_lr0.1_w8) against FedAvg (FedAvg_lr0.1_w8)\n\nNo seeds in common." in paired
    at_rounds = table_under(markdown, "| Experiment | Method | Tag | round 2 | round 4 |")
    assert ["FedRCL_lr0.1_w8", "FedRCL", "val/acc_ema", "21.50 ± 4.95 [-22.97, 65.97] (n=2)",
            "46.00 ± 1.41 [33.29, 58.71] (n=2)"] in at_rounds
    # without --rounds: the last round all paired runs logged, where seed 1's raw accuracy is missing
    paired = render_report(runs, root=REPO).split("## Paired by seed\n", 1)[1]
    assert "| FedRCL | 1 | FedRCL_lr0.1_w8/seed1 | - / 47.00 | 4 |" in paired


def test_report_reads_csvlogger_runs(tmp_path):
    """What Lightning's CSVLogger writes (a ``metrics.csv`` row per call, the round as its step)."""
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path), name="csv_run")
    for round_idx in range(1, 4):
        logger.log_metrics({"train/loss": 2.0 / round_idx}, step=round_idx)
        logger.log_metrics({"val/acc": 0.1 * round_idx, "val/acc_ema": 0.05 * round_idx}, step=round_idx)
    logger.save()
    config = yaml.safe_dump(fake_config("cifar10", backbone="SmallCNN"))
    (tmp_path / "csv_run" / "version_0" / "config.yaml").write_text(config)
    scalars = load_scalars(tmp_path / "csv_run")
    assert scalars["val/acc_ema"][0].tolist() == [1, 2, 3]
    np.testing.assert_allclose(scalars["train/loss"][1], [2.0, 1.0, 2.0 / 3])
    cells = rows_of(render_report(collect_runs(tmp_path), root=tmp_path), "## Your runs")["csv_run"]
    assert cells[-3:] == ["3 of 1000, not finished", "15.00", "—"]


def test_report_says_what_it_left_out(tmp_path):
    config = fake_config("cifar10", backbone="SmallCNN")
    fake_version(tmp_path / "a" / "version_0", config, {r: 0.3 for r in range(1, 21)})
    longer = fake_config("cifar10", backbone="SmallCNN")
    longer["trainer"].update(rounds=50, callbacks=[{"class_path": "fedrcl.analysis.RepresentationMonitor"}])
    fake_version(tmp_path / "b" / "version_0", longer, {r: 0.4 for r in range(1, 31)})  # same seeds: a repeat
    (tmp_path / "lightning_only" / "version_0").mkdir(parents=True)
    (tmp_path / "c" / "version_0").mkdir(parents=True)
    (tmp_path / "c" / "version_0" / "config.yaml").write_text(yaml.safe_dump(config))
    markdown = render_report(collect_runs(tmp_path), unread=unread_versions(tmp_path), root=tmp_path)
    left_out = markdown.split("## Left out\n", 1)[1].split("\n## ", 1)[0]
    notes = [line for line in left_out.splitlines() if line.startswith("- ")]
    assert len(notes) == 3, left_out
    assert notes[0].startswith("- `c/version_0`: no TensorBoard event file and no CSVLogger metrics.csv")
    assert notes[1].startswith("- `lightning_only/version_0`: no config.yaml")
    assert notes[2].startswith("- `a` (version_0): the same experiment and seeds as `b` (version_0), which got "
                               "further (round 30 against 20)")
    assert rows_of(markdown, "## Seeds")["b"][2] == "1"


@pytest.mark.parametrize("layout", ["empty", "no config"])
def test_report_on_a_folder_without_runs_is_a_one_line_error(tmp_path, capsys, layout):
    if layout == "no config":
        (tmp_path / "run" / "version_0").mkdir(parents=True)
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"fedrcl report: error: no runs under {tmp_path}")
    assert ("1 version folders without config.yaml" in err) == (layout == "no config")


def left_out_notes(markdown: str) -> list[str]:
    return [line for line in markdown.split("## Left out\n", 1)[1].split("\n## ", 1)[0].splitlines()
            if line.startswith("- ")]


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_report_names_an_event_file_it_cannot_read_whole(tmp_path, capsys, damage):
    """A finished run of 10 rounds whose event file is cut short (a killed writer, a full disk, half a copy)
    or overwritten: its row says its logs were not read whole and "Left out" names the file with why (it was
    "0 of 10, not finished" and "Left out: Nothing"); the rounds before the damage are kept. A notebook's
    ``load_scalars`` warns, naming the file."""
    config = fake_config("cifar10", backbone="SmallCNN")
    config["trainer"]["rounds"] = 10
    fake_version(tmp_path / "runs" / "damaged" / "version_0", config, {r: r / 100 for r in range(1, 11)})
    events = event_file(tmp_path / "runs" / "damaged" / "version_0")
    data = events.read_bytes()
    events.write_bytes(data[:-7] if damage == "truncated" else b"\x07garbage" * 50)
    main(["report", str(tmp_path / "runs")])
    markdown = capsys.readouterr().out
    rounds, last_ema = rows_of(markdown, "## Your runs")["damaged"][-3:-1]
    (note,) = left_out_notes(markdown)
    assert note.startswith(f"- `damaged/version_0/{events.name}` (of `damaged`, version_0): ")
    if damage == "truncated":  # the last record, round 10's, is cut
        assert (rounds, last_ema) == ("9 of 10, logs not read whole (see Left out)", "9.00")
        assert re.search(r": truncated \(the writer stopped mid-record: killed, a full disk, or still writing\) at "
                         rf"byte \d+ of {len(data) - 7}; rounds after 9 not read; the run is shown with", note)
    else:
        assert (rounds, last_ema) == ("0 of 10, logs not read whole (see Left out)", "no val/acc_ema yet")
        assert "corrupt (a record's length fails its checksum) at byte 0 of 400; nothing read" in note
    with pytest.warns(UserWarning, match=re.escape(str(events))):
        load_scalars(tmp_path / "runs" / "damaged")


def test_report_names_a_metrics_csv_and_a_config_it_cannot_read(tmp_path):
    """A ``metrics.csv`` with a value that is no number, a ``config.yaml`` that is no YAML: named with why (they
    were tracebacks)."""
    config = fake_config("cifar10", backbone="SmallCNN")
    version = tmp_path / "csv_run" / "version_0"
    version.mkdir(parents=True)
    (version / "config.yaml").write_text(yaml.safe_dump(config))
    (version / "metrics.csv").write_text("epoch,step,val/acc_ema\n0,1,0.1\n0,2,0.2\n0,3,abc\n")
    fake_version(tmp_path / "bad_yaml" / "version_0", config, {1: 0.5})
    (tmp_path / "bad_yaml" / "version_0" / "config.yaml").write_text("trainer: [rounds: 2\n")
    (run,) = collect_runs(tmp_path)
    assert run.curves["val/acc_ema"][0].tolist() == [1, 2]
    assert run.problems == ((version / "metrics.csv", "not a CSVLogger metrics.csv from line 4 on (could not "
                             "convert string to float: 'abc'); the rows before it are read"),)
    ((path, why),) = unread_versions(tmp_path)
    assert path == tmp_path / "bad_yaml" / "version_0" and why.startswith("config.yaml not readable (")


def test_versions_of_one_folder_merge_only_when_they_continue(tmp_path):
    """A resume continues after its checkpoint's round: one run (here resumed on Flower: both backends). The
    same config started over in the same folder is another run, a repeat of the first."""
    config = fake_config("cifar10", backbone="SmallCNN")
    fake_version(tmp_path / "a" / "version_0", config, {r: 0.1 for r in range(1, 6)})
    flower_version(tmp_path / "a" / "version_1", config, {r: 0.2 for r in range(6, 11)})
    fake_version(tmp_path / "b" / "version_0", config, {r: 0.1 for r in range(1, 6)})
    fake_version(tmp_path / "b" / "version_1", config, {r: 0.3 for r in range(1, 4)})  # started over
    runs = collect_runs(tmp_path)
    assert [(r.path.name, r.versions, r.backend, r.last_round) for r in runs] == [
        ("a", ("version_0", "version_1"), "fedrcl fit, Flower", 10),
        ("b", ("version_0",), "fedrcl fit", 5), ("b", ("version_1",), "fedrcl fit", 3)]


def test_a_flower_run_a_fit_run_and_two_methods_in_one_folder_never_merge(tmp_path):
    """The tutorial's method written into runs/quickstart beside FedRCL, and a Flower run of the quickstart
    into the same folder: three runs, the Flower one in a seed group of its own, compared with no fit run, and
    the report says which backend each run is (the fit and Flower versions were one FedRCL run, "60 of 60")."""
    root = tmp_path / "runs"
    fedrcl, fedavg = fake_config("digits", backbone="SmallCNN"), fake_config("digits", method="FedAvg",
                                                                             backbone="SmallCNN")
    for config in (fedrcl, fedavg):
        config["trainer"]["rounds"] = 2
    flower = copy.deepcopy(fedrcl)
    flower["trainer"]["rounds"] = 60
    fake_version(root / "quickstart" / "version_0", fedrcl, {1: 0.5, 2: 0.6})
    flower_version(root / "quickstart" / "version_1", flower, {r: 0.7 for r in range(1, 61)})
    fake_version(root / "quickstart" / "version_2", fedavg, {1: 0.4, 2: 0.5})
    runs = collect_runs(root)
    assert [(r.versions, r.setting["method"], r.backend) for r in runs] == [
        (("version_0",), "FedRCL", "fedrcl fit"), (("version_1",), "FedRCL", "Flower"),
        (("version_2",), "FedAvg", "fedrcl fit")]
    markdown = render_report(runs, root=root)
    assert "Runs of 2 backends (fedrcl fit: 2, Flower: 1): runs of different backends are never merged" in markdown
    header = ("| Run | Versions | Dataset | Split | Method | Server | Backend | Backbone | Clients/round | Rounds | "
              "Last EMA | Paper cells |")
    assert [(row[1], row[4], row[6], row[9]) for row in table_under(markdown, header)] == [
        ("version_0", "FedRCL", "fedrcl fit", "2 of 2"), ("version_1", "FedRCL", "Flower", "60 of 60"),
        ("version_2", "FedAvg", "fedrcl fit", "2 of 2")]
    seeds = rows_of(markdown, "## Seeds")
    assert [(where, cells[0], cells[2]) for where, cells in seeds.items()] == [
        ("quickstart on fedrcl fit", "FedAvg", "1"), ("quickstart on Flower", "FedRCL", "1")]  # rows_of: last wins
    assert markdown.count("| quickstart on fedrcl fit | FedRCL |") == 1
    assert "\n- `quickstart` holds 3 experiments, differing in method, beta, backend.\n" in markdown
    paired = markdown.split("## Paired by seed\n", 1)[1].split("\n## ", 1)[0]
    assert [line for line in paired.splitlines() if line.startswith("### ")] == [
        "### FedRCL (quickstart on fedrcl fit) against FedAvg (quickstart on fedrcl fit)"]
    assert left_out_notes(markdown) == []


@pytest.mark.parametrize("case", ["read-only folder", "under a file", "a folder"])
def test_report_out_problems_are_one_line_before_anything_is_printed(fake_runs, tmp_path, capsys, monkeypatch,
                                                                      case):
    """``--out`` in a folder the user cannot write in, under a regular file, or at an existing folder: one line
    naming the path and exit status 2, nothing on stdout (they were 11-26-line tracebacks)."""
    (tmp_path / "notes.txt").write_text("kept")
    out = {"read-only folder": read_only_folder(tmp_path, monkeypatch) / "report.md",
           "under a file": tmp_path / "notes.txt" / "report.md", "a folder": fake_runs}[case]
    with pytest.raises(SystemExit) as info:
        main(["report", str(fake_runs), "--out", str(out)])
    captured = capsys.readouterr()
    assert (info.value.code, captured.out) == (2, "")
    expected = {"read-only folder": f"{out}: cannot write in {out.parent} (read-only or not yours)",
                "under a file": f"{out}: {out.parent} is a file, not a folder",
                "a folder": f"{out} is a folder; give a file name"}[case]
    assert captured.err == f"fedrcl report: error: --out {expected}\n"
    assert (tmp_path / "notes.txt").read_text() == "kept" and not list(out.parent.glob("report.md"))


def test_methods_with_a_server_half_of_their_own_are_compared_with_plain_fedavg():
    """FedNova's normalised averaging, FedAvg under FedAdam's server: challengers of the FedAvg group with
    FedAvg's server, named by ``method_label``; the server is set aside by ``method_key`` only."""
    def with_server(method: str, server: Optional[str], seed: int) -> RunResult:
        run = toy_run(method, seed)
        if server is not None:
            run.config["trainer"]["server"] = {"class_path": f"fedrcl.server.{server}", "init_args": {}}
        return RunResult(run.path.parent.with_name(f"{method}_{server}") / run.path.name, run.versions,
                         run_setting(run.config), config=run.config, curves=run.curves)

    runs = [with_server(method, server, seed) for method, server in
            (("FedAvg", "FedAdam"), ("FedNova", "FedNova"), ("FedAvg", None)) for seed in (0, 1)]
    fedadam, fednova, fedavg = runs[0].config, runs[2].config, runs[4].config
    assert method_key(fedadam) == method_key(fednova) == method_key(fedavg)
    assert len({experiment_key(fedadam), experiment_key(fednova), experiment_key(fedavg)}) == 3
    compared = comparisons(seed_groups(runs))
    assert [(method_label(ref[0].setting), method_label(ch[0].setting)) for ref, ch in compared] == [
        ("FedAvg", "FedAdam + FedAvg"), ("FedAvg", "FedNova")]
