"""``fedrcl plot``: curves per method, mean and 95% band over seeds, PNG and SVG; ``fedrcl report`` and
``fedrcl plot`` read runs without loading Lightning."""
from __future__ import annotations

import math
import re
import subprocess
import sys

import matplotlib
import numpy as np
import pytest
import yaml
from test_report import event_file, fake_config, fake_version, read_only_folder
from torch.utils.tensorboard import SummaryWriter

from conftest import REPO
from fedrcl.analysis.plots import plot_seed_groups
from fedrcl.analysis.seed_stats import align, mean_band, t_quantile
from fedrcl.plot import curve_groups, main, nonfinite_notes

matplotlib.use("Agg")


def seeded(config: dict, seed: int) -> dict:
    config.update(seed_everything=seed)
    config["trainer"]["seed"] = seed
    return config


@pytest.fixture
def two_methods(tmp_path):
    """FedAvg under seeds 0-2 (EMA 0.50, 0.52, 0.54 at every round), FedRCL under seeds 0-1 (0.6, 0.7), as
    ``fedrcl seeds`` lays them out; FedRCL's seed 1 logged rounds 1-8 of 10 only."""
    root = tmp_path / "runs"
    for seed, ema in enumerate((0.50, 0.52, 0.54)):
        fake_version(root / "fedavg" / f"seed{seed}" / "version_0", seeded(fake_config(method="FedAvg"), seed),
                     {r: ema for r in range(1, 11)})
    for seed, ema, last in ((0, 0.6, 10), (1, 0.7, 8)):
        fake_version(root / "fedrcl" / f"seed{seed}" / "version_0", seeded(fake_config(), seed),
                     {r: ema for r in range(1, last + 1)})
    return root


def test_mean_band_is_the_t_interval_of_the_mean():
    values = np.array([[1.0, 10.0], [3.0, 10.0], [5.0, 10.0]])  # std 2 and 0 (ddof 1)
    mean, half = mean_band(values)
    np.testing.assert_allclose(mean, [3.0, 10.0])
    np.testing.assert_allclose(half, [4.302652730 * 2 / math.sqrt(3), 0.0])
    np.testing.assert_allclose(mean_band(values, "std")[1], [2.0, 0.0])
    np.testing.assert_allclose(mean_band(values[:1])[1], [0.0, 0.0])  # one seed: no band
    rounds, aligned = align([(np.array([1, 2, 3]), np.array([0.1, 0.2, 0.3])), (np.array([2, 3, 4]),
                                                                                 np.array([2.0, 3.0, 4.0]))])
    assert rounds.tolist() == [2, 3] and aligned.tolist() == [[0.2, 0.3], [2.0, 3.0]]


def test_curves_are_grouped_by_method_and_drawn_with_their_band(two_methods):
    groups = curve_groups([str(two_methods)], ["val/acc_ema"])
    assert list(groups) == ["FedAvg", "FedRCL"] and [len(g) for g in groups.values()] == [3, 2]
    fig = plot_seed_groups(groups, ["val/acc_ema"])
    ax = fig.axes[0]
    fedavg, fedrcl = ax.lines
    np.testing.assert_allclose(fedavg.get_ydata(), 52.0, rtol=1e-6)
    assert fedrcl.get_xdata().tolist() == list(range(1, 9))  # the rounds both seeds logged
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    half = t_quantile(2) * 2.0 / math.sqrt(3)
    assert band.min() == pytest.approx(52.0 - half, rel=1e-5) and band.max() == pytest.approx(52.0 + half, rel=1e-5)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["FedAvg (n=3)", "FedRCL (n=2)"]
    fedrcl_band = ax.collections[1].get_paths()[0].vertices[:, 1]  # 65 ± 63.5 (t with 1 df), cut to [0, 100]
    assert fedrcl_band.max() == 100.0 and fedrcl_band.min() == pytest.approx(65.0 - 12.706204736 * 5.0, abs=1e-3)


def test_up_to_twenty_curves_have_twenty_colours():
    """matplotlib's own cycle repeats after ten: an eleventh method drew in the first one's colour."""
    curve = {"val/acc": (np.arange(1, 4), np.array([0.1, 0.2, 0.3]))}
    for n in (3, 11, 20):
        fig = plot_seed_groups({f"m{k}": [curve] for k in range(n)}, ["val/acc"])
        colours = {tuple(matplotlib.colors.to_rgba(line.get_color())) for line in fig.axes[0].lines}
        assert len(colours) == n


def test_fedrcl_plot_writes_png_and_svg_and_prints_the_table(two_methods, tmp_path, capsys):
    main([f"Baseline={two_methods / 'fedavg'}", str(two_methods / "fedrcl"), "--out", str(tmp_path / "fig.png"),
          "--tags", "val/acc_ema", "--rounds", "5", "10"])
    out = capsys.readouterr().out
    assert (tmp_path / "fig.png").stat().st_size > 10_000 and (tmp_path / "fig.svg").read_text().startswith("<?xml")
    assert "| Baseline | 3 | 52.00 ± 2.00 | 52.00 ± 2.00 | 10 |" in out
    assert "| FedRCL | 2 | 65.00 ± 7.07 | - | 8 |" in out  # round 10: seed 1 stopped at 8


def test_fedrcl_plot_refuses_seeds_of_different_experiments_in_one_label(two_methods, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main([f"All={two_methods}", "--tags", "val/acc_ema", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("fedrcl plot: error: All=") and "2 experiments" in err
    with pytest.raises(SystemExit):
        main([str(two_methods), "--tags", "val/loss", "--out", str(tmp_path / "x")])
    assert f"fedrcl plot: error: {two_methods}: no runs with val/loss under" in capsys.readouterr().err
    assert not list(tmp_path.glob("x.*"))


def test_one_label_over_several_paths_is_one_curve_of_their_runs(two_methods, tmp_path, capsys):
    """``LABEL=PATH,PATH``: seeds kept in two folders, whose configs differ in more than the seed (the rounds),
    are one curve: FedAvg's seed 0 run elsewhere for 20 rounds (EMA 0.44) and seeds 1-2 under ``two_methods``."""
    longer = fake_config(method="FedAvg")
    longer["trainer"]["rounds"] = 20
    fake_version(tmp_path / "long" / "version_0", seeded(longer, 0), {r: 0.44 for r in range(1, 21)})
    groups = curve_groups([f"FedAvg={tmp_path / 'long'},{two_methods / 'fedavg' / 'seed1'},"
                           f"{two_methods / 'fedavg' / 'seed2'}"], ["val/acc_ema"])
    assert list(groups) == ["FedAvg"] and len(groups["FedAvg"]) == 3
    main([f"FedAvg={tmp_path / 'long'},{two_methods / 'fedavg' / 'seed1'},{two_methods / 'fedavg' / 'seed2'}",
          "--tags", "val/acc_ema", "--rounds", "10", "--out", str(tmp_path / "x")])
    assert "| FedAvg | 3 | 50.00 ± 5.29 | 10 |" in capsys.readouterr().out  # 44, 52, 54; the common rounds 1-10
    with pytest.raises(SystemExit):  # each path still holds one experiment
        main([f"Mixed={tmp_path / 'long'},{two_methods}", "--tags", "val/acc_ema", "--out", str(tmp_path / "y")])
    assert "2 experiments" in capsys.readouterr().err


def test_fedrcl_plot_leaves_out_a_run_without_the_tags_and_says_so(two_methods, tmp_path, capsys):
    config = seeded(fake_config(method="FedAvg"), 3)
    (tmp_path / "runs" / "fedavg" / "seed3" / "version_0").mkdir(parents=True)  # killed before any round
    (tmp_path / "runs" / "fedavg" / "seed3" / "version_0" / "config.yaml").write_text(yaml.safe_dump(config))
    SummaryWriter(str(tmp_path / "runs" / "fedavg" / "seed3" / "version_0")).close()
    main([str(two_methods), "--tags", "val/acc_ema", "--out", str(tmp_path / "x")])
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"fedrcl plot: left out {two_methods / 'fedavg' / 'seed3'} (version_0): "
                                         "no val/acc_ema logged"]
    assert "| FedAvg | 3 |" in captured.out


def test_report_and_plot_do_not_load_lightning_or_torch(two_methods, tmp_path):
    """Both, run through the ``fedrcl`` command's dispatcher, read runs in a fresh process that never imports
    Lightning or torch."""
    code = (f"import sys; from fedrcl.cli import main; "
            f"main(['report', {str(two_methods)!r}, '--out', {str(tmp_path / 'r.md')!r}]); "
            f"main(['plot', {str(two_methods)!r}, '--tags', 'val/acc_ema', '--out', {str(tmp_path / 'p')!r}]); "
            "print(sorted(m for m in ('lightning', 'torch', 'tensorboard') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "['tensorboard']"  # the event files' reader only
    assert (tmp_path / "p.svg").is_file() and "## Your runs" in (tmp_path / "r.md").read_text()


def custom_scalars(version) -> list:
    """The Custom Scalars layouts written into a version folder's event files."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.custom_scalar import layout_pb2

    return [layout_pb2.Layout.FromString(value.tensor.string_val[0])
            for path in sorted(version.glob("events.*")) for event in EventFileLoader(str(path)).Load()
            for value in event.summary.value if value.metadata.plugin_data.plugin_name == "custom_scalars"]


@pytest.mark.slow
def test_a_run_opens_tensorboard_on_accuracy_and_plots(data_root, tmp_path, capsys):
    """A real run writes the Custom Scalars layout once, accuracy and its EMA first; ``fedrcl plot`` draws it."""
    from conftest import run_cli

    cli = run_cli(data_root, tmp_path / "runs", "--trainer.enable_checkpointing", "false", rounds=2)
    (layout,) = custom_scalars(tmp_path / "runs" / "quickstart" / "version_0")
    first = layout.category[0]
    assert first.title == "accuracy" and list(first.chart[0].multiline.tag) == ["^val/acc$", "^val/acc_ema$"]
    assert [c.title for c in layout.category] == ["accuracy", "loss", "learning rate", "seconds per round", "bytes"]
    main([str(tmp_path / "runs"), "--out", str(tmp_path / "curves")])
    ema = 100 * cli.trainer.callback_metrics["val/acc_ema"].item()
    assert f"| FedRCL | 1 | {ema:.2f} | 2 |" in capsys.readouterr().out
    assert (tmp_path / "curves.png").is_file() and (tmp_path / "curves.svg").is_file()


def error_of(capsys, argv) -> str:
    """The one line ``fedrcl plot ARGV`` refuses with (exit status 2, nothing on stdout)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    captured = capsys.readouterr()
    assert (info.value.code, captured.out) == (2, "") and len(captured.err.splitlines()) == 1, captured
    return captured.err.strip()


def test_plot_names_an_event_file_it_cannot_read(two_methods, tmp_path, capsys):
    """A seed's event file overwritten: the file and why are on stderr and the curve has the other seeds; one
    run alone, damaged: one line naming the file (it said only "no runs")."""
    events = event_file(two_methods / "fedavg" / "seed2" / "version_0")
    events.write_bytes(b"\x07garbage" * 50)
    main([str(two_methods), "--tags", "val/acc_ema", "--out", str(tmp_path / "x")])
    captured = capsys.readouterr()
    assert f"fedrcl plot: left out {events}: corrupt (a record's length fails its checksum) at byte 0 of 400; " \
           "nothing read" in captured.err.splitlines()
    assert "| FedAvg | 2 | 51.00 ± 1.41 | 10 |" in captured.out
    err = error_of(capsys, [f"Broken={two_methods / 'fedavg' / 'seed2'}", "--tags", "val/acc_ema",
                            "--out", str(tmp_path / "y")])
    assert err == (f"fedrcl plot: error: Broken={two_methods / 'fedavg' / 'seed2'}: no run under "
                   f"{two_methods / 'fedavg' / 'seed2'} logged all of val/acc_ema (left out: {events}: corrupt (a "
                   "record's length fails its checksum) at byte 0 of 400; nothing read; "
                   f"{two_methods / 'fedavg' / 'seed2'} (version_0): no val/acc_ema logged)")


def test_non_finite_points_are_noted_under_the_figure_and_in_the_table(two_methods, tmp_path, capsys):
    """FedRCL's seed 0 logged NaN at rounds 3 and 4 and infinity at 5: the mean is not drawn there, and the figure
    and the table say so (they were dropped without a word)."""
    import matplotlib.pyplot as plt

    config = seeded(fake_config(), 2)
    curve = {r: 0.6 for r in range(1, 11)} | {3: math.nan, 4: math.nan, 5: math.inf}
    fake_version(two_methods / "fedrcl" / "seed2" / "version_0", config, curve)
    plt.close("all")
    main([str(two_methods), "--tags", "val/acc_ema", "--rounds", "2", "4", "--out", str(tmp_path / "x")])
    out = capsys.readouterr().out
    note = "FedRCL: val/acc_ema is NaN or infinite at rounds 3, 4, 5 in 1 of its 3 runs; not drawn there"
    assert "| FedRCL | 3 | 63.33 ± 5.77 | non-finite in 1 of 3 | 8 |" in out and f"- {note}" in out
    (number,) = plt.get_fignums()
    assert plt.figure(number).get_supxlabel() == note
    values = np.array([1, np.nan, 1, np.inf, np.nan, np.nan, -np.inf])
    assert nonfinite_notes({"A": [{"t": (np.arange(1, 8), values)}]}, ["t"]) == [
        "A: t is NaN or infinite at rounds 2, 4, 5, ... 7 (5 rounds) in 1 of its 1 runs; not drawn there"]


def test_a_path_that_exists_is_a_path_and_labels_are_checked(two_methods, tmp_path, capsys):
    """A folder named ``lr=0.1`` is a folder (it was read as label ``lr`` of path ``0.1``); ``=PATH`` and
    ``--run '' PATH`` (an empty label) and one label for two curves are refused in one line."""
    lr = tmp_path / "sweep" / "lr=0.1"
    lr.parent.mkdir()
    (two_methods / "fedavg").rename(lr)
    groups = curve_groups([str(lr)], ["val/acc_ema"])
    assert list(groups) == ["FedAvg"] and len(groups["FedAvg"]) == 3
    main([str(lr), "--tags", "val/acc_ema", "--out", str(tmp_path / "x")])
    assert "| FedAvg | 3 | 52.00 ± 2.00 | 10 |" in capsys.readouterr().out
    assert error_of(capsys, [f"={lr}", "--out", str(tmp_path / "y")]) == (
        f"fedrcl plot: error: ={lr}: empty label; give LABEL=PATH (or --run LABEL PATH), or PATH alone to label "
        "its runs by method")
    assert error_of(capsys, ["--run", "", str(lr), "--out", str(tmp_path / "y")]) == \
        f"fedrcl plot: error: --run  {lr}: empty label; give the curve a name"
    assert error_of(capsys, [f"A={lr}", f"A={two_methods / 'fedrcl'}", "--tags", "val/acc_ema",
                             "--out", str(tmp_path / "y")]) == (
        f"fedrcl plot: error: A={two_methods / 'fedrcl'}: a second curve named A; give each curve its own label")
    assert not list(tmp_path.glob("y.*"))


def test_run_label_path_takes_any_folder_name_and_repeats_into_one_curve(two_methods, tmp_path, capsys):
    """``--run LABEL PATH`` for a folder with a comma in its name; the same label again adds a path."""
    odd = tmp_path / "seeds 0,1"
    odd.mkdir()
    for seed in (0, 1):
        (two_methods / "fedavg" / f"seed{seed}").rename(odd / f"seed{seed}")
    main(["--run", "FedAvg", str(odd), "--run", "FedAvg", str(two_methods / "fedavg"), "--run", "FedRCL",
          str(two_methods / "fedrcl"), "--tags", "val/acc_ema", "--out", str(tmp_path / "x")])
    out = capsys.readouterr().out
    assert "| FedAvg | 3 | 52.00 ± 2.00 | 10 |" in out and "| FedRCL | 2 | 65.00 ± 7.07 | 8 |" in out


@pytest.mark.parametrize("case", ["read-only folder", "under a file", "a folder at OUT.svg"])
def test_plot_out_problems_are_one_line_before_anything_is_printed(two_methods, tmp_path, capsys, monkeypatch,
                                                                    case):
    """``--out`` in a folder the user cannot write in, under a regular file, or where OUT.svg is a folder: one
    line naming the path before the table is printed (the table came first, then a traceback)."""
    (tmp_path / "notes.txt").write_text("kept")
    (tmp_path / "fig.svg").mkdir()
    out = {"read-only folder": read_only_folder(tmp_path, monkeypatch) / "fig",
           "under a file": tmp_path / "notes.txt" / "fig", "a folder at OUT.svg": tmp_path / "fig"}[case]
    expected = {"read-only folder": f"{out}.png: cannot write in {out.parent} (read-only or not yours)",
                "under a file": f"{out}.png: {out.parent} is a file, not a folder",
                "a folder at OUT.svg": f"{out}.svg is a folder; give a file name"}[case]
    assert error_of(capsys, [str(two_methods), "--out", str(out)]) == f"fedrcl plot: error: --out {expected}"
    assert (tmp_path / "notes.txt").read_text() == "kept" and not list(out.parent.glob("fig.png"))


def test_plot_refuses_runs_of_several_data_sets_in_one_figure(two_methods, tmp_path, capsys):
    """A digits run beside CIFAR-100 runs: one line naming each data set's curves (they were drawn on one pair of
    axes)."""
    fake_version(two_methods / "digits_fedrcl" / "version_0", seeded(fake_config("digits"), 0), {1: 0.9})
    assert error_of(capsys, [str(two_methods), "--tags", "val/acc_ema", "--out", str(tmp_path / "x")]) == (
        "fedrcl plot: error: runs of 2 data sets (digits: FedRCL (digits_fedrcl); cifar100: FedAvg, FedRCL "
        "(fedrcl)); one figure holds one data set: plot each on its own")
    with pytest.raises(ValueError, match=re.escape("runs of 2 data sets (digits: Digits; cifar100: Cifar)")):
        curve_groups([f"Digits={two_methods / 'digits_fedrcl'}", f"Cifar={two_methods / 'fedavg'}"],
                     ["val/acc_ema"])
    assert not list(tmp_path.glob("x.*"))
