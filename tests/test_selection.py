"""Selection on validation (``fedrcl report --select val``): the test accuracy rule, the choice made on validation
curves only, the protocol and the refusal of runs without a validation split."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from torch.utils.tensorboard import SummaryWriter

from fedrcl.analysis.catalogue import collect_runs
from fedrcl.analysis.paper_table import protocol, selected_table
from fedrcl.analysis.plots import TAG_LABELS
from fedrcl.analysis.selection import choose_setting, searched, select_on_validation, selection_round
from fedrcl.analysis.tags import (has_validation_split, logged_validation, tag_of_test, val_fraction,
                                  validation_curve, with_test_tags)
from fedrcl.cli import main
from fedrcl.plot import curve_groups
from fedrcl.report import load_paper_results, render_report

PAPER = load_paper_results()
ROUNDS = (1, 2, 3)


def sweep_config(method: str = "FedAvg", seed: int = 0, val: float = 0.1, **method_args) -> dict:
    """A LightningCLI config.yaml as ``fedrcl sweep`` saves one setting's seed: CIFAR-10 alpha 0.1 (a paper
    setting), ``data.val_fraction`` ``val``, the method's swept arguments in ``init_args``."""
    backbone = {"class_path": "fedrcl.models.ResNet18", "init_args": {"width": 64}}
    data = {"dataset": "cifar10", "num_clients": 100, "partition": "dirichlet", "alpha": 0.1,
            "partition_file": None, "batch_size": 50, "local_iters_per_epoch": 10, "seed": 0}
    if val:
        data["val_fraction"] = val
    return {"seed_everything": seed,
            "trainer": {"rounds": len(ROUNDS), "clients_per_round": 5, "local_epochs": 5, "server": None,
                        "seed": seed},
            "model": {"class_path": f"fedrcl.algorithms.{method}", "init_args": {**method_args, "backbone": backbone}},
            "data": data}


def write_run(folder: Path, config: dict, scalars: dict[str, list[float]]) -> None:
    """``folder/version_0``: ``config.yaml`` and an event file with each scalar at rounds 1, 2, ..."""
    version = folder / "version_0"
    version.mkdir(parents=True)
    (version / "config.yaml").write_text(yaml.safe_dump(config))
    writer = SummaryWriter(str(version))
    for tag, values in scalars.items():
        for round_idx, value in enumerate(values, start=1):
            writer.add_scalar(tag, value, round_idx)
    writer.close()


def split_scalars(val: list[float], test: list[float]) -> dict[str, list[float]]:
    """What a run with a validation split logs: ``val/acc*`` on validation, ``test/acc*`` on test (the EMA
    curves here equal the raw ones plus 0.01, to tell them apart)."""
    return {"val/acc": val, "val/acc_ema": [v + 0.01 for v in val], "test/acc": test,
            "test/acc_ema": [t + 0.01 for t in test]}


# {method: {setting: (method args, {seed: (validation curve, test curve)})}}
SWEEP = {
    "FedAvg": {
        "lr0.01": ({"lr": 0.01}, {0: ([.20, .30, .40], [.25, .35, .45]), 1: ([.22, .32, .42], [.27, .37, .47])}),
        "lr0.1": ({"lr": 0.1}, {0: ([.30, .40, .50], [.20, .30, .36]), 1: ([.32, .42, .52], [.22, .32, .38])})},
    "FedProx": {
        "lr0.01_mu0.1": ({"lr": 0.01, "mu": 0.1}, {0: ([.1, .2, .30], [.1, .2, .60]),
                                                   1: ([.1, .2, .30], [.1, .2, .62])}),
        "lr0.01_mu1": ({"lr": 0.01, "mu": 1.0}, {0: ([.1, .2, .45], [.1, .2, .50]),
                                                 1: ([.1, .2, .47], [.1, .2, .54])}),
        "lr0.1_mu0.1": ({"lr": 0.1, "mu": 0.1}, {0: ([.1, .2, .41], [.1, .2, .40]),
                                                 1: ([.1, .2, .41], [.1, .2, .40])})},
}


def write_sweep(root: Path, sweep: dict = SWEEP, val: float = 0.1) -> Path:
    """The runs of ``sweep`` as ``fedrcl sweep`` lays them out: ``<root>/<method>/<setting>/seed<k>``."""
    for method, settings in sweep.items():
        for name, (args, seeds) in settings.items():
            for seed, (val_curve, test_curve) in seeds.items():
                write_run(root / method / name / f"seed{seed}", sweep_config(method, seed, val, **args),
                          split_scalars(val_curve, test_curve))
    return root


def curve(values) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(1, len(values) + 1), np.asarray(values, dtype=np.float64)


def test_a_runs_test_accuracy_is_test_acc_where_logged_else_val_acc():
    old = {"val/acc": curve([0.3]), "val/acc_ema": curve([0.2])}
    new = {**old, "test/acc": curve([0.4]), "test/acc_ema": curve([0.35])}
    assert tag_of_test(old) == "val/acc_ema" and tag_of_test(old, "acc") == "val/acc"
    assert tag_of_test(new) == "test/acc_ema" and tag_of_test(new, "acc") == "test/acc"
    assert not logged_validation(old) and logged_validation(new)
    assert validation_curve(old) is None  # its val/acc_ema is the test accuracy: no validation accuracy
    assert validation_curve(new, "acc")[1].tolist() == [0.3]
    assert with_test_tags(old)["test/acc_ema"][1].tolist() == [0.2]  # old runs read as test/acc* too
    assert with_test_tags(old)["val/acc_ema"][1].tolist() == [0.2]
    assert with_test_tags(new)["test/acc_ema"][1].tolist() == [0.35]
    with pytest.raises(ValueError, match="kind"):
        tag_of_test(old, "loss")


def test_val_fraction_is_read_from_a_plain_or_a_class_path_data_config():
    assert val_fraction(sweep_config(val=0.1)) == 0.1
    assert val_fraction(sweep_config(val=0)) == 0.0
    assert val_fraction({"data": {"class_path": "fedrcl.data.FederatedDataModule",
                                  "init_args": {"val_fraction": 0.25}}}) == 0.25
    assert val_fraction({}) == 0.0
    assert has_validation_split(sweep_config(val=0), {"test/acc": curve([0.1])})
    assert not has_validation_split(sweep_config(val=0), {"val/acc": curve([0.1])})


def test_the_setting_with_the_best_mean_validation_accuracy_wins_by_hand():
    validation = {"a": [curve([0.1, 0.5]), curve([0.1, 0.7])],   # mean 0.6 at round 2
                  "b": [curve([0.9, 0.6]), curve([0.9, 0.65])],  # 0.625
                  "c": [curve([0.9])]}                           # did not log round 2
    choice = choose_setting(validation)
    assert selection_round(validation) == 1  # the last round all curves logged
    choice = choose_setting(validation, 2)
    assert (choice.best, choice.round_idx, choice.left_out) == ("b", 2, ("c",))
    assert choice.scores == pytest.approx({"a": 0.6, "b": 0.625})
    assert choose_setting(validation, 1).best == "b"  # 0.9 against 0.1; c ties b at 0.9 and comes later
    assert choose_setting({"x": [curve([0.5])], "y": [curve([0.5])]}).best == "x"  # a tie: the first listed
    diverged = {"nan": [curve([math.nan]), curve([0.9])], "ok": [curve([0.2]), curve([0.2])]}
    assert choose_setting(diverged).best == "ok"
    with pytest.raises(ValueError, match="round 5"):
        choose_setting({"a": [curve([0.5])]}, 5)


def test_the_choice_is_the_argmax_of_the_mean_over_seeds_random():
    rng = np.random.default_rng(0)
    for _ in range(20):
        values = rng.uniform(size=(6, 3, 4))  # settings x seeds x rounds
        validation = {f"s{i}": [curve(seed) for seed in setting] for i, setting in enumerate(values)}
        round_idx = int(rng.integers(1, 5))
        assert choose_setting(validation, round_idx).best == f"s{values[:, :, round_idx - 1].mean(1).argmax()}"


def test_searched_names_the_keys_that_differ_between_settings(tmp_path):
    runs = collect_runs(write_sweep(tmp_path / "runs"))
    (fedavg, fedprox) = select_on_validation(runs)
    assert fedavg.searched == {"model.init_args.lr": [0.01, 0.1]}
    assert fedprox.searched == {"model.init_args.lr": [0.01, 0.01, 0.1], "model.init_args.mu": [0.1, 1.0, 0.1]}
    assert searched([fedavg.settings[0]]) == {}


def _selected(root: Path) -> dict[str, tuple[dict, list[float]]]:
    """``{method: (chosen values, its runs' test EMA at the selection round)}``."""
    out = {}
    for s in select_on_validation(collect_runs(root)):
        tests = sorted(float(run.curves["test/acc_ema"][1][s.choice.round_idx - 1]) for run in s.chosen)
        out[s.method] = (s.chosen_values(), tests)
    return out


def _swap(sweep: dict, method: str, a: str, b: str, which: int) -> dict:
    """``sweep`` with the validation (``which`` 0) or test (1) curves of settings ``a`` and ``b`` swapped."""
    swapped = {m: {name: (args, {seed: list(curves) for seed, curves in seeds.items()})
                   for name, (args, seeds) in settings.items()} for m, settings in sweep.items()}
    seeds_a, seeds_b = swapped[method][a][1], swapped[method][b][1]
    for seed in seeds_a:
        seeds_a[seed][which], seeds_b[seed][which] = seeds_b[seed][which], seeds_a[seed][which]
    return swapped


def test_the_choice_reads_validation_never_test(tmp_path):
    """FedAvg's lr 0.1 has the better validation accuracy and the worse test accuracy; FedProx's mu 0.1 has the
    best test accuracy and a middling validation one: validation decides."""
    chosen = _selected(write_sweep(tmp_path / "runs"))
    assert chosen["FedAvg"] == ({"model.init_args.lr": 0.1}, [pytest.approx(0.37), pytest.approx(0.39)])
    assert chosen["FedProx"][0] == {"model.init_args.lr": 0.01, "model.init_args.mu": 1.0}
    # the test numbers of two settings swapped: the same setting chosen, its (swapped-in) test numbers reported
    swapped = _selected(write_sweep(tmp_path / "test_swapped", _swap(SWEEP, "FedAvg", "lr0.01", "lr0.1", 1)))
    assert swapped["FedAvg"] == ({"model.init_args.lr": 0.1}, [pytest.approx(0.46), pytest.approx(0.48)])
    swapped = _selected(write_sweep(tmp_path / "test_swapped_prox",
                                    _swap(SWEEP, "FedProx", "lr0.01_mu1", "lr0.01_mu0.1", 1)))
    assert swapped["FedProx"][0] == {"model.init_args.lr": 0.01, "model.init_args.mu": 1.0}
    # the validation numbers swapped: the choice follows them
    swapped = _selected(write_sweep(tmp_path / "val_swapped", _swap(SWEEP, "FedAvg", "lr0.01", "lr0.1", 0)))
    assert swapped["FedAvg"][0] == {"model.init_args.lr": 0.01}
    swapped = _selected(write_sweep(tmp_path / "val_swapped_prox",
                                    _swap(SWEEP, "FedProx", "lr0.01_mu1", "lr0.01_mu0.1", 0)))
    assert swapped["FedProx"][0] == {"model.init_args.lr": 0.01, "model.init_args.mu": 0.1}


def test_selected_table_reports_test_accuracy_and_the_paired_difference(tmp_path):
    selections = select_on_validation(collect_runs(write_sweep(tmp_path / "runs")))
    table = selected_table(selections, PAPER)
    assert table.columns == ("test acc EMA", "test acc", "Δ EMA vs FedAvg (paired)")
    (fedavg, (ema, raw, diff)), (fedprox, (p_ema, p_raw, p_diff)) = table.rows
    assert fedavg == "FedAvg (lr=0.1)" and fedprox == "FedProx (lr=0.01, mu=1.0)"
    # FedAvg lr 0.1, round 3: test EMA 37 and 39 (mean 38, std sqrt(2), 95% half-width t(1) = 12.706)
    assert (ema.summary.mean, ema.summary.n) == (pytest.approx(38.0), 2)
    assert ema.summary.ci95 == pytest.approx(12.706204736, rel=1e-5)  # event files hold float32
    assert (ema.paper, ema.paper_round) == (70.82, 1000)  # the paper's FedAvg, CIFAR-10 alpha 0.1, round 1000
    assert raw.summary.mean == pytest.approx(37.0) and diff is None
    # FedProx mu 1 minus FedAvg lr 0.1 per seed: 51 - 37 = 14, 55 - 39 = 16
    assert (p_diff.summary.mean, p_diff.summary.std, p_diff.summary.n) == (
        pytest.approx(15.0), pytest.approx(math.sqrt(2), rel=1e-5), 2)
    assert (p_ema.paper, p_ema.paper_round) == (68.87, 1000)  # the paper's FedProx there


def test_the_protocol_says_what_was_searched_and_warns_of_unequal_budgets(tmp_path):
    lines = protocol(select_on_validation(collect_runs(write_sweep(tmp_path / "runs"))))
    assert ("- FedAvg: 2 settings x 2 seeds x 3 rounds = 12 run-rounds; searched: `model.init_args.lr` in "
            "{0.01, 0.1}; chosen: lr=0.1 (validation 52.00; all settings 42.00 to 52.00)") in lines
    assert ("- FedProx: 3 settings x 2 seeds x 3 rounds = 18 run-rounds; searched: `model.init_args.lr` in "
            "{0.01, 0.1}; `model.init_args.mu` in {0.1, 1.0}; chosen: lr=0.01, mu=1.0 (validation 47.00; all "
            "settings 31.00 to 47.00)") in lines
    warning = next(line for line in lines if "unequal" in line)
    assert "FedAvg 12, FedProx 18" in warning
    equal = {m: dict(list(s.items())[:2]) for m, s in SWEEP.items()}
    assert not any("unequal" in line
                   for line in protocol(select_on_validation(collect_runs(write_sweep(tmp_path / "eq", equal)))))


def test_fedrcl_report_select_val_prints_the_protocol_and_the_table(tmp_path, capsys):
    root = write_sweep(tmp_path / "runs")
    main(["report", str(root), "--select", "val"])
    out = capsys.readouterr().out
    assert out.index("## Protocol") < out.index("## Selected on validation")
    assert "| **FedProx (lr=0.01, mu=1.0)** |" not in out  # bold marks cells, not names
    row = next(line for line in out.splitlines() if line.startswith("| FedProx"))
    assert row.startswith("| FedProx (lr=0.01, mu=1.0) | **53.00 ± 25.41** (paper ")
    main(["report", str(root), "--select", "val", "--select_tag", "acc", "--select_round", "2",
          "--reference", "FedProx"])
    out = capsys.readouterr().out
    assert "`val/acc`" in out and "x 2 rounds" in out and "Δ EMA vs FedProx (paired)" in out


def test_select_val_refuses_a_run_without_a_validation_split_in_one_line(tmp_path, capsys):
    root = write_sweep(tmp_path / "runs")
    old = root / "FedAvg" / "old" / "seed0"
    write_run(old, sweep_config("FedAvg", 0, val=0, lr=0.03), {"val/acc": [.5, .6, .7], "val/acc_ema": [.5, .6, .7]})
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(root), "--select", "val"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err
    assert err.startswith(f"fedrcl report: error: {old}: data.val_fraction is 0, so the run has no validation split")
    shutil.rmtree(old)
    with pytest.raises(SystemExit):
        main(["report", str(root), "--select", "val", "--reference", "FedNova"])
    assert "--reference FedNova: no such method" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", str(root), "--reference", "FedAvg"])
    assert "go with --select val" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", str(root), "--select", "val", "--rounds", "2"])
    assert "give the round selected at as --select_round" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", str(root), "--format", "latex", "--tags", "val/acc"])
    assert "--tags go with the markdown report" in capsys.readouterr().err


def test_report_and_plot_show_the_test_accuracy_of_a_run_with_a_validation_split(tmp_path):
    root = write_sweep(tmp_path / "runs")
    runs = collect_runs(root)
    run = next(r for r in runs if r.path == root / "FedAvg" / "lr0.1" / "seed0")
    assert run.ema.tolist() == pytest.approx([21.0, 31.0, 37.0])  # test/acc_ema, not val/acc_ema
    markdown = render_report(runs, root=root)
    assert "test/acc_ema mean ± std" in markdown and "val/acc_ema mean ± std" not in markdown
    paired = markdown.split("## Paired by seed\n", 1)[1]
    # two FedAvg settings are told apart by their folders; round 3's test accuracy, raw / EMA (val: 50 / 51)
    assert "| FedAvg/lr0.1 | 0 | FedAvg/lr0.1/seed0 | 36.00 / 37.00 | 3 |" in paired
    groups = curve_groups([str(root / "FedAvg" / "lr0.1")])
    (label,) = groups
    assert groups[label][0]["test/acc_ema"][1].tolist() == pytest.approx([0.21, 0.31, 0.37])
    assert TAG_LABELS["test/acc_ema"] == "EMA(0.9) test accuracy (%)"


def test_an_old_run_reads_as_before(tmp_path):
    """A run without a validation split: its val/acc* are its test accuracy, for report and plot alike."""
    write_run(tmp_path / "runs" / "old", sweep_config(val=0, lr=0.1), {"val/acc": [.5, .6], "val/acc_ema": [.4, .5]})
    (run,) = collect_runs(tmp_path / "runs")
    assert run.ema.tolist() == pytest.approx([40.0, 50.0])
    assert "val/acc_ema mean ± std" in render_report([run])
    groups = curve_groups([str(tmp_path / "runs")])
    assert next(iter(groups.values()))[0]["test/acc_ema"][1].tolist() == pytest.approx([0.4, 0.5])
