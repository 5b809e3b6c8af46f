"""Seeds as an axis: t quantiles, ``fedrcl seeds`` and the report's Seeds table, checked from event files."""
from __future__ import annotations

import itertools
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ACCELERATOR, REPO
from fedrcl.analysis import seed_curves, summarize_seeds, t_quantile
from fedrcl.analysis.catalogue import collect_runs, seed_runs
from fedrcl.analysis.settings import experiment_key
from fedrcl.cli import main
from fedrcl.report import render_seed_table
from fedrcl.seeds import fit_args_for_seed, run_name


def test_t_quantiles_against_published_values():
    published = {1: 12.7062, 2: 4.3027, 4: 2.7764, 9: 2.2622, 29: 2.0452, 30: 2.0423, 31: 2.0395,
                 40: 2.0211, 60: 2.0003, 120: 1.9799, 10 ** 6: 1.9600}
    for df, value in published.items():
        assert t_quantile(df) == pytest.approx(value, abs=1e-4), df
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile(0)


def test_summarize_seeds_by_hand():
    s = summarize_seeds([1.0, 2.0, 3.0])
    assert (s.mean, s.std, s.n) == (2.0, 1.0, 3)
    assert s.ci95 == pytest.approx(4.302652730 / math.sqrt(3))
    assert s.format(scale=10) == "20.00 ± 10.00"
    one = summarize_seeds([0.5])
    assert one.n == 1 and math.isnan(one.std) and one.format() == "0.50"


def test_each_seed_gets_its_seeds_and_its_run_name():
    named = {"trainer": {"logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                    "init_args": {"save_dir": "runs", "name": "quickstart"}}}}
    assert run_name(named) == ("runs", "quickstart", "lightning.pytorch.loggers.TensorBoardLogger")
    assert fit_args_for_seed(["--config", "x.yaml"], named, 2) == [
        "--config", "x.yaml", "--seed_everything", "2", "--trainer.seed", "2",
        "--trainer.logger.init_args.name", "quickstart/seed2"]
    assert fit_args_for_seed([], named, 1, vary_split=True)[4:6] == ["--data.seed", "1"]
    default = fit_args_for_seed([], {"trainer": {"logger": None}}, 3)  # fedrcl's default logger: runs/fedrcl
    assert default[-1].startswith("--trainer.logger=") and '"name": "fedrcl/seed3"' in default[-1]
    with pytest.raises(ValueError, match="trainer.logger"):
        run_name({"trainer": {"logger": False}})


def test_seed_bookkeeping_keys_do_not_make_another_experiment():
    base = {"seed_everything": 0, "data": {"seed": 0, "alpha": 0.1, "root": "data"},
            "trainer": {"seed": 0, "rounds": 10, "logger": {"init_args": {"name": "a/seed0"}}},
            "model": {"init_args": {"lr": 0.1}}}
    other = yaml.safe_load(yaml.safe_dump(base))
    other.update(seed_everything=1)
    other["trainer"].update(seed=1, rounds=20, logger={"init_args": {"name": "a/seed1"}})
    other["data"].update(seed=1, root="elsewhere", eval_batch_size=100, channels_last="off")
    other["trainer"].update(client_batching="on", compile_clients=True, devices=2, eval_every=5)
    assert experiment_key(base) == experiment_key(other)
    other["trainer"]["local_epochs"] = 2
    assert experiment_key(base) != experiment_key(other)
    del other["trainer"]["local_epochs"]
    other["model"]["init_args"]["lr"] = 0.05
    assert experiment_key(base) != experiment_key(other)
    # list values are part of the setting (levels); callbacks, a list of class_path mappings, are not
    other = yaml.safe_load(yaml.safe_dump(base))
    base["model"]["init_args"]["levels"] = [1, 2]
    base["trainer"]["callbacks"] = [{"class_path": "fedrcl.analysis.ClientEvaluation", "init_args": {"every": 5}}]
    other["model"]["init_args"]["levels"] = [1, 2]
    assert experiment_key(base) == experiment_key(other)
    other["model"]["init_args"]["levels"] = [2]
    assert experiment_key(base) != experiment_key(other)


def fit_args(data_root: Path, save_dir: Path, model: str) -> list[str]:
    return ["--config", str(REPO / "configs" / "quickstart.yaml"), "--model", model,
            "--data.root", str(data_root), "--data.num_clients", "10", "--trainer.accelerator", ACCELERATOR,
            "--trainer.logger.init_args.save_dir", str(save_dir),
            "--trainer.logger.init_args.name", model.rsplit(".", 1)[1],
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.rounds", "2", "--trainer.local_epochs", "1", "--trainer.clients_per_round", "3"]


def events(run: Path, tag: str) -> dict[int, float]:
    """``{round: value}`` of ``tag``, read straight from the run's event file."""
    (version,) = run.glob("version_*")
    acc = EventAccumulator(str(version))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def seeds_rows(markdown: str) -> dict[str, list[str]]:
    after = itertools.dropwhile(lambda line: not line.startswith("|"), markdown.splitlines())
    lines = list(itertools.takewhile(lambda line: line.startswith("|"), after))
    rows = ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    return {cells[1]: cells for cells in rows}


@pytest.mark.slow
def test_three_seeds_of_two_methods_and_their_report(data_root, tmp_path, capsys):
    torch.set_num_threads(1)
    for model in ("fedrcl.algorithms.FedAvg", "fedrcl.algorithms.FedRCL"):
        main(["seeds", "--seeds", "0", "1", "2", *fit_args(data_root, tmp_path, model)])
    for method in ("FedAvg", "FedRCL"):
        runs = seed_runs(tmp_path / method)
        assert [r.name for r in runs] == ["seed0", "seed1", "seed2"]
        for k, run in enumerate(runs):
            config = yaml.safe_load(next(run.glob("version_*/config.yaml")).read_text())
            seeds = config["seed_everything"], config["trainer"]["seed"], config["data"]["seed"]
            assert seeds == (k, k, 0)
        splits = {next(r.glob("version_*/split.json")).read_text() for r in runs}
        assert len(splits) == 1  # data.seed stays fixed: one split
        curves = [events(r, "val/acc") for r in runs]
        assert len({tuple(c.values()) for c in curves}) > 1  # the seeds change the run

    capsys.readouterr()
    markdown = "\n".join(render_seed_table(collect_runs(tmp_path)))
    rows = seeds_rows(markdown)
    assert set(rows) == {"FedAvg", "FedRCL"}
    for method, cells in rows.items():
        assert cells[3] == "3" and cells[4] == "0,1,2 / 0,1,2 / 0"
        for column, tag in ((5, "val/acc_ema"), (7, "val/acc")):
            values = 100 * np.array([events(r, tag)[2] for r in seed_runs(tmp_path / method)])
            mean, std = values.mean(), values.std(ddof=1)
            half = 4.302652730 * std / math.sqrt(3)  # t_{0.975, 2}
            assert cells[column] == f"{mean:.2f} ± {std:.2f} @2"
            assert cells[column + 1] == f"[{mean - half:.2f}, {mean + half:.2f}]"
    rounds, values = seed_curves(seed_runs(tmp_path / "FedAvg"), "val/acc")
    assert rounds.tolist() == [1, 2] and values.shape == (3, 2)

    main(["report", str(tmp_path), "--tags", "val/acc_ema", "comm/cumulative_bytes"])
    out = capsys.readouterr().out
    assert "## Seeds" in out and "comm/cumulative_bytes mean ± std" in out


def test_repeated_seeds_are_an_error(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["seeds", "--seeds", "0", "0", "--config", str(REPO / "configs" / "quickstart.yaml")])
    assert stop.value.code == 2 and "repeated" in capsys.readouterr().err


def test_a_failed_seed_reports_a_fedrcl_error_in_one_line(data_root, tmp_path, capsys):
    args = [*fit_args(data_root, tmp_path, "fedrcl.algorithms.FedAvg"), "--trainer.rounds", "0"]
    with pytest.raises(SystemExit) as stop:
        main(["seeds", "--seeds", "0", "1", *args])  # refused by each seed's fit
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "Traceback" not in err
    for seed in (0, 1):
        assert f"fedrcl seeds: seed {seed}: error: trainer.rounds must be >= 1, got 0" in err
    assert "seeds [0, 1] failed" in err and not (tmp_path / "FedAvg").exists()


SIGTERM_IN_ROUND = ("--trainer.callbacks+=faults.SignalAt", "--trainer.callbacks.init_args.step=1",
                    "--trainer.callbacks.init_args.round")


@pytest.mark.parametrize("signal_round, stopped, not_started", [(2, [0], [1, 2]), (3, [], [1, 2])])
def test_sigterm_stops_the_seed_in_progress_and_starts_no_other(data_root, tmp_path, capsys, signal_round,
                                                                 stopped, not_started):
    """SIGTERM in a round of seed 0 (3 rounds): the seed stops after that round, checkpointed (in its last
    round it simply ends); it is not called failed, seeds 1 and 2 never start, and one line says how to finish
    them all; exit status 143, as for fedrcl fit."""
    args = [*fit_args(data_root, tmp_path, "fedrcl.algorithms.FedAvg"), "--trainer.rounds", "3",
            *SIGTERM_IN_ROUND, str(signal_round)]
    with pytest.raises(SystemExit) as stop:
        main(["seeds", "--seeds", "0", "1", "2", *args])
    err = capsys.readouterr().err
    assert stop.value.code == 143, err[-3000:]
    assert "failed" not in err and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "FedAvg").iterdir()) == ["seed0"]
    last = torch.load(next((tmp_path / "FedAvg" / "seed0").glob("version_0/checkpoints/last.ckpt")),
                      weights_only=True)
    assert last["epoch"] == signal_round - 1  # the round the signal came in, whole
    line = err.strip().splitlines()[-1]
    assert line.startswith("fedrcl seeds: stopped by SIGTERM"), line
    assert f"stopped after a round: {stopped or 'none'}, not started: {not_started}" in line
    commands = line.split("; resume: ", 1)[1].split(" && ")
    resume = [f"fedrcl seeds --seeds 0 {shlex.join(args)} --ckpt_path last"] if stopped else []
    assert commands == [*resume, f"fedrcl seeds --seeds 1 2 {shlex.join(args)}"]


def test_ctrl_c_stops_the_seed_in_progress_after_its_round_and_starts_no_other(data_root, tmp_path, capsys):
    """Ctrl-C as SIGTERM (Lightning alone would end the seed with status 1 and start the next): exit status
    130 and the line that finishes the seeds."""
    args = [*fit_args(data_root, tmp_path, "fedrcl.algorithms.FedAvg"), "--trainer.rounds", "3",
            *SIGTERM_IN_ROUND, "2", "--trainer.callbacks.init_args.signal=SIGINT"]
    with pytest.raises(SystemExit) as stop:
        main(["seeds", "--seeds", "0", "1", *args])
    err = capsys.readouterr().err
    assert stop.value.code == 130, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("fedrcl seeds: stopped by SIGINT (seed 0 after round 2/3, checkpoint "), line
    assert "stopped after a round: [0], not started: [1]" in line and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "FedAvg").iterdir()) == ["seed0"]


@pytest.mark.slow
def test_sigterm_to_parallel_seeds_reaches_the_running_fits(data_root, tmp_path):
    """``--parallel 2``: SIGTERM to ``fedrcl seeds`` alone is passed on to both running fits, which stop after
    their round, checkpointed; seed 2 never starts; exit status 143 and the line that finishes them."""
    import os
    import signal
    import time

    args = [*fit_args(data_root, tmp_path, "fedrcl.algorithms.FedAvg"), "--trainer.rounds", "50"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fedrcl.cli", "seeds", "--seeds", "0", "1", "2", "--parallel",
                             "2", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        logs, deadline = [tmp_path / "FedAvg" / f"seed{k}.log" for k in (0, 1)], time.monotonic() + 300
        while not all(log.exists() and "Round 1/50" in log.read_text() for log in logs):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # the parent only, as `kill PID` would
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # a hang: end the fits too
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert "stopped after a round: [0, 1], not started: [2]" in line, line
    assert line.endswith(f"resume: fedrcl seeds --seeds 0 1 --parallel 2 {shlex.join(args)} --ckpt_path last && "
                         f"fedrcl seeds --seeds 2 --parallel 2 {shlex.join(args)}"), line
    for k in (0, 1):
        last = next((tmp_path / "FedAvg" / f"seed{k}").glob("version_0/checkpoints/last.ckpt"))
        assert 0 <= torch.load(last, weights_only=True)["epoch"] < 49
    assert not (tmp_path / "FedAvg" / "seed2").exists()


@pytest.mark.slow
def test_parallel_seeds_run_as_processes(data_root, tmp_path, monkeypatch, capsys):
    """``--parallel 2``: two ``fedrcl fit`` processes, and lines on their progress (here at every poll)."""
    from fedrcl import seeds

    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the children import this checkout's fedrcl
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = [a if a != "2" else "1" for a in fit_args(data_root, tmp_path, "fedrcl.algorithms.FedAvg")]
    started = []
    popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a[0]) or popen(*a, **k))
    monkeypatch.setattr(seeds, "PROGRESS_SECONDS", 0.0)  # a progress line at every poll
    main(["seeds", "--seeds", "3", "4", "--parallel", "2", *args])
    progress = [line for line in capsys.readouterr().out.splitlines()
                if line.startswith("fedrcl seeds: seed 3 ") and ", seed 4 " in line]
    assert progress and progress[0].startswith("fedrcl seeds: seed 3 starting, seed 4 "), progress
    assert any(re.fullmatch(r"fedrcl seeds: seed 3 round 1/1 \(left 0:00\), .*; all seeds about 0:00 more", line)
               for line in progress), progress
    fits = [cmd for cmd in started if "fedrcl.cli" in cmd]
    assert [cmd[:4] for cmd in fits] == [[sys.executable, "-m", "fedrcl.cli", "fit"]] * 2
    for seed in (3, 4):
        assert events(tmp_path / "FedAvg" / f"seed{seed}", "val/acc").keys() == {1}
        assert "fedrcl: 1/1 rounds in " in (tmp_path / "FedAvg" / f"seed{seed}.log").read_text()


def test_paper_cells_show_the_mean_over_seeds(tmp_path):
    from test_report import fake_config, fake_version, rows_of

    from fedrcl.report import render_report

    for seed, ema in enumerate((0.50, 0.52, 0.54)):
        config = fake_config()
        config.update(seed_everything=seed)
        config["trainer"]["seed"] = seed
        fake_version(tmp_path / "a005" / f"seed{seed}" / "version_0", config, {r: ema for r in range(1, 601)})
    repeat = fake_config()
    repeat.update(seed_everything=2)
    repeat["trainer"]["seed"] = 2  # seed 2 again, shorter: a repeat, not a fourth seed
    fake_version(tmp_path / "again" / "version_0", repeat, {r: 0.9 for r in range(1, 11)})
    markdown = render_report(collect_runs(tmp_path), paper_tables=True)
    cells = rows_of(markdown, "### CIFAR-100")["FedRCL (ours)"]
    assert cells[:2] == ["52.00 ± 2.00 (n=3) (+8.29)", "52.00 ± 2.00 (n=3)* (-2.63)"]  # paper 43.71, 54.63
    seeds = rows_of(markdown, "## Seeds")
    (row,) = seeds.values()
    assert row[2:4] == ["3", "0,1,2 / 0,1,2 / None"]
    assert row[4] == "52.00 ± 2.00 @600"


def test_parallel_progress_reads_the_round_lines_and_adds_up_the_time_left(tmp_path):
    """``--parallel``'s progress line: each running seed's last round line (also the first round's early line),
    and the time until the last seed ends, the waiting seeds taking the running ones' mean time."""
    from fedrcl.seeds import progress_line, seconds_of, seeds_left

    assert [seconds_of(t) for t in ("1:02:05", "1:15", "5.8 days", "?")] == [3725, 75, 5.8 * 86400, None]
    assert seeds_left([10.0, 40.0], waiting=1, seed_seconds=100.0, parallel=2) == 110.0
    assert seeds_left([10.0], waiting=3, seed_seconds=100.0, parallel=2) == 200.0  # a free slot starts one now
    assert seeds_left([], waiting=0, seed_seconds=0.0, parallel=2) == 0.0
    (tmp_path / "seed0.log").write_text("Seed set to 0\nRound 1/60  val/acc 0.1  val/acc_ema 0.1  "
                                        "(0.41 s; elapsed 0:10, left 9:50)\nRound 2/60  val/acc 0.2  "
                                        "val/acc_ema 0.11  (0.41 s; elapsed 0:20, left 9:40)\n")
    (tmp_path / "seed1.log").write_text("Round 1/60  step 3/250 in 0:07  (2.01 s a step; round about 8:22, run "
                                        "about 5.8 days)\n")
    logs = {0: tmp_path / "seed0.log", 1: tmp_path / "seed1.log"}
    line = progress_line(logs, [2], 2, {0: 20.0, 1: 7.0})
    # seed 2 waits for seed 0's slot (9:40) and takes the mean (2.9 days): seed 1 (5.8 days) ends last
    assert line == ("fedrcl seeds: seed 0 round 2/60 (left 9:40), seed 1 round 1/60 (left 5.8 days); waiting: [2]; "
                    "all seeds about 5.8 days more")
    (tmp_path / "seed1.log").write_text("Seed set to 1\n")
    assert progress_line(logs, [], 2, {0: 20.0, 1: 1.0}) == \
        "fedrcl seeds: seed 0 round 2/60 (left 9:40), seed 1 starting"
