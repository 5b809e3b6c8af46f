"""What a new user meets first: the subcommand list, the losses package, threads, progress in a log, CI."""
from __future__ import annotations

import importlib
import inspect
import io
import os
import pkgutil
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO, run_cli
from fedrcl.cli import OTHER_SUBCOMMANDS, main


def test_help_lists_every_subcommand_and_no_predict(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    usage = capsys.readouterr().out.splitlines()[0]
    offered = usage[usage.index("{") + 1:usage.index("}")].split(",")
    assert offered == ["fit", "validate", "test", *OTHER_SUBCOMMANDS]
    assert "report" in offered


def test_predict_is_not_offered(capsys):
    with pytest.raises(SystemExit) as info:
        main(["predict", "--config", str(REPO / "configs" / "quickstart.yaml")])
    assert info.value.code == 2
    assert "predict" in capsys.readouterr().err


def test_losses_package_exports_every_public_function():
    import fedrcl.losses

    assert fedrcl.losses.relaxed_contrastive_loss is \
        importlib.import_module("fedrcl.losses.relaxed_contrastive").relaxed_contrastive_loss
    defined = set()
    for info in pkgutil.iter_modules(fedrcl.losses.__path__):
        module = importlib.import_module(f"fedrcl.losses.{info.name}")
        defined |= {name for name, obj in vars(module).items() if inspect.isfunction(obj)
                    and obj.__module__ == module.__name__ and not name.startswith("_")}
    assert defined and set(fedrcl.losses.__all__) == defined
    assert all(callable(getattr(fedrcl.losses, name)) for name in fedrcl.losses.__all__)


def test_quickstart_sets_one_thread_and_torch_threads_overrides_it(data_root, tmp_path):
    assert "\ntorch_threads: 1\n" in (REPO / "configs" / "quickstart.yaml").read_text()
    threads = torch.get_num_threads()
    try:
        run_cli(data_root, tmp_path, "--torch_threads", "2", rounds=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_without_a_tty_progress_is_one_line_per_round(data_root, tmp_path, capsys):
    run_cli(data_root, tmp_path, "--trainer.enable_progress_bar", "true", rounds=3)
    err = capsys.readouterr().err
    rounds = [line for line in err.splitlines() if line.startswith("Round ")]
    assert [line.split()[1] for line in rounds] == ["1/3", "2/3", "3/3"]
    assert all("val/acc " in line and "val/acc_ema " in line for line in rounds)
    assert "\r" not in err and "it/s" not in err and "Epoch" not in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_the_round_bar(monkeypatch):
    from fedrcl.federated.progress import RoundLines, RoundProgressBar, round_progress

    monkeypatch.setattr(sys, "stdout", _Terminal())  # where Lightning's tqdm draws the bar
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(round_progress(), RoundProgressBar)
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # `fedrcl fit > log`: lines, not redraws
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert isinstance(round_progress(), RoundLines)


def test_ci_runs_the_quickstart_and_removes_its_venv():
    script = (REPO / ".ci" / "run").read_text()
    assert "fedrcl fit --config" in script and "configs/quickstart.yaml" in script
    assert "trap " in script and "rm -rf" in script


# -- honest help ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fit_help() -> str:
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["fit", "--help"])
    return out.getvalue()


def test_fit_help_offers_only_what_a_run_accepts(fit_help):
    from fedrcl.federated.trainer import OWNED_BY_ROUNDS

    for key in OWNED_BY_ROUNDS:  # refused at run time: not offered
        assert f"--trainer.{key} " not in fit_help, key
    for key in ("--trainer.rounds", "--trainer.eval_every", "--trainer.max_time", "--trainer.devices"):
        assert key in fit_help, key
    models = fit_help[fit_help.index("  --model CONFIG"):]
    models = models[:models.index(")")]
    assert "GlobalTeacherClient" not in models and "PersistentClientState" not in models
    assert "fedrcl.algorithms.FedRCL" in models and "fedrcl.algorithms.MOON" in models
    servers = fit_help[fit_help.index("  --trainer.server SERVER\n"):]
    servers = servers[:servers.index("--trainer.eval_every")]
    assert "fedrcl.server.FedAdam" in servers and "fedrcl.server.FedAvgM" in servers
    for base in ("ServerOptimizer", "StatefulServer", "FedOpt,", "FedOpt)"):
        assert f"fedrcl.server.{base}" not in servers, base


def test_every_key_fit_help_offers_is_accepted(fit_help, data_root, tmp_path):
    """Every ``--key`` that ``fedrcl fit --help`` lists is taken by the parser and by the constructors, each
    given the value the quickstart resolves it to, all in one command line, built and not run: a key offered
    that the parser does not know or a constructor refuses outright (as the keys the round loop sets are)
    fails here. (A value refused later, as ``trainer.gradient_clip_algorithm value`` was in a round, is not
    seen: that key is now one of ``OWNED_BY_ROUNDS``, not offered, tested in ``test_bad_input``.)"""
    import json
    import re

    from fedrcl.federated.trainer import FederatedTrainer
    from fedrcl.lightning_cli import build_cli
    from fedrcl.seeds import resolved_config

    quickstart = ["--config", str(REPO / "configs" / "quickstart.yaml")]
    config = resolved_config(quickstart)
    keys = [key for key, rest in re.findall(r"^  --([\w.]+)(?:\+| |\[)(.*)", fit_help, re.M)  # not --data CONFIG
            if not key.endswith(".help") and key != "print_config" and not re.match(r"CONFIG(\s\s|$)", rest)]
    assert len(keys) > 60 and "trainer.rounds" in keys and "model" in keys, keys
    built, fit_method = [], []  # fit's own arguments (ckpt_path, ...) are parsed, not built
    for key in dict.fromkeys(keys):
        value = config
        for part in key.split("."):
            assert part in value, f"--{key} is offered but has no value in --print_config"
            value = value[part]
        arg = f"--{key}={value if isinstance(value, str) else json.dumps(value)}"
        (fit_method if key in inspect.signature(FederatedTrainer.fit).parameters else built).append(arg)
    assert resolved_config([*quickstart, *fit_method, *built]) == config
    cli = build_cli([*quickstart, *built, "--data.root", str(data_root),
                     "--trainer.logger.init_args.save_dir", str(tmp_path)], run=False)
    assert cli.trainer.rounds == config["trainer"]["rounds"] and not list(tmp_path.iterdir())


def test_nested_help_lists_fedrcls_backbones(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--model.help", "fedrcl.algorithms.FedAvg"])
    backbone = capsys.readouterr().out.split("  --model.backbone BACKBONE", 1)[1]
    backbone = backbone[:backbone.index("  --model.")]
    assert "fedrcl.models.ResNet18" in backbone and "fedrcl.models.SmallCNN" in backbone
    assert "torch.nn.Linear" not in backbone and "fedrcl.models.resnet.BasicBlock" not in backbone


def test_selectable_backbones_are_fedrcls():
    from fedrcl.cli import selectable

    assert selectable("fedrcl.models.ResNet18") and selectable("fedrcl.algorithms.FedAvg")
    assert not selectable("fedrcl.algorithms.global_teacher.GlobalTeacherClient")
    assert not selectable("fedrcl.server.FedOpt") and not selectable("fedrcl.server.ServerOptimizer")


def test_subcommand_descriptions_are_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    import re

    raw = capsys.readouterr().out
    for name in ("fit", "validate", "test"):
        entry = re.search(rf"^    {name} +(.*?)(?=^    \w|\Z)", raw, re.M | re.S).group(1)
        sentence = " ".join(entry.split())
        assert sentence[0].isupper() and sentence.endswith("."), sentence  # whole sentences
        assert "resum" not in sentence.lower() and "Lightning" not in sentence, sentence
    out = " ".join(raw.split())
    assert "Train the federation round by round" in out
    assert "Evaluate a checkpoint's global model on the test set" in out


def test_validate_last_says_evaluating_and_warns_of_no_folder(data_root, tmp_path):
    import os
    import subprocess

    run_cli(data_root, tmp_path, rounds=1)
    result = subprocess.run(
        [sys.executable, "-m", "fedrcl.cli", "validate", "--config", str(REPO / "configs" / "quickstart.yaml"),
         "--data.root", str(data_root), "--data.num_clients", "10", "--ckpt_path", "last",
         "--trainer.logger.init_args.save_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--ckpt_path last: evaluating " in result.stderr, result.stderr
    assert "resuming" not in result.stderr and "dirpath has changed" not in result.stderr, result.stderr
    assert not (tmp_path / "quickstart" / "validate_0" / "checkpoints").exists()


# -- quiet logs ----------------------------------------------------------------------------------------------
def test_no_advert_no_leafspec_no_log_every_n_steps_and_a_line_per_round_without_a_bar(data_root, tmp_path):
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "fedrcl.cli", "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
         "--data.root", str(data_root), "--data.num_clients", "10", "--trainer.rounds", "2",
         "--trainer.local_epochs", "1", "--trainer.clients_per_round", "3", "--trainer.enable_progress_bar",
         "false", "--trainer.enable_model_summary", "false", "--trainer.logger.init_args.save_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    err = result.stderr
    assert "litlogger" not in err and "Tip:" not in err, err
    assert "LeafSpec" not in err and "log_every_n_steps" not in err, err
    assert [line.split()[1] for line in err.splitlines() if line.startswith("Round ")] == ["1/2", "2/2"]


def test_the_report_cites_what_a_reader_can_find():
    from fedrcl.report import render_report

    header = next(line for line in render_report([]).splitlines() if line.startswith("Paper: "))
    assert '"Relaxed Contrastive Learning for Federated Learning", CVPR 2024' in header
    assert "fedrcl/paper_results.json" in header and (REPO / "fedrcl" / "paper_results.json").is_file()
    assert "reference/" not in header and ".tex" not in header


def test_without_a_logger_no_config_is_written_over_ones_own(data_root, tmp_path, monkeypatch):
    """``--trainer.logger false``: no run folder, so no ``config.yaml`` (Lightning would write it into the
    working folder, over the user's own) and no ``split.json``; ``fit`` and ``validate`` alike."""
    ckpt = Path(run_cli(data_root, tmp_path / "runs", rounds=1).trainer.logger.log_dir) / "checkpoints" / "last.ckpt"
    work = tmp_path / "work"
    work.mkdir()
    (work / "config.yaml").write_text("# my own notes\n")
    monkeypatch.chdir(work)
    run_cli(data_root, tmp_path / "runs", "--trainer.logger", "false", "--ckpt_path", str(ckpt), subcommand="validate")
    run_cli(data_root, tmp_path / "runs", "--trainer.logger", "false", rounds=1)
    assert (work / "config.yaml").read_text() == "# my own notes\n"
    assert not list(work.rglob("split.json"))


# -- torch and torchvision of builds that do not match -------------------------------------------------------
def test_which_torch_and_torchvision_builds_match():
    from fedrcl.torch_builds import fix_command, mismatch

    assert mismatch("2.14.1", "0.29.1") is None and mismatch("2.14.1+cpu", "0.29.1+cpu") is None
    assert mismatch("2.5.1+cu121", "0.20.1+cu124") is None  # one CUDA major
    assert mismatch("2.14.1", "0.28.0") == "torchvision 0.28 belongs to another torch release"
    assert mismatch("2.14.1+cpu", "0.29.1", platform="linux") == "a CPU torch beside a CUDA torchvision"
    assert mismatch("2.14.1+cpu", "0.29.1", platform="darwin") is None  # PyPI's macOS torchvision is a CPU build
    assert mismatch("2.14.1+cpu", "0.29.1+cu128") == "a CPU torch beside a CUDA torchvision"
    assert mismatch("2.1.0+cu118", "0.16.0+cu121") == "CUDA 11 beside CUDA 12"
    assert fix_command("2.14.1+cpu") == \
        'pip install --force-reinstall --no-deps "torchvision==0.29.*" --index-url https://download.pytorch.org/whl/cpu'
    assert fix_command("2.15.0a0") == 'pip install --force-reinstall --no-deps "torchvision==0.30.*"'


def _fedrcl_with(stub: Path, *args: str) -> subprocess.CompletedProcess:
    """``fedrcl <args>`` in a child process whose ``sys.path`` starts with ``stub``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub), str(REPO)]), "OMP_NUM_THREADS": "1"}
    env.pop("FEDRCL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "fedrcl.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=stub)


def test_a_torchvision_that_cannot_load_its_operators_is_one_line(tmp_path):
    """The failure pip's CPU torch beside PyPI's CUDA torchvision ends in (a 40-line traceback from
    torchmetrics' import before): one line naming both versions and the pip line that fixes it."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    result = _fedrcl_with(tmp_path, "fit", "--config", str(REPO / "configs" / "quickstart.yaml"))
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip()
    assert line.startswith(f"fedrcl: error: torch {metadata.version('torch')} and torchvision "), line
    assert "(operator torchvision::nms does not exist)" in line, line
    assert 'pip install --force-reinstall --no-deps "torchvision==0.' in line, line


def test_a_torchvision_of_another_release_is_named_before_any_command_and_beside_help(tmp_path):
    """Read from the installed packages' metadata, without importing either: ``--help`` stays cheap (no torch,
    no Lightning) and says it; every subcommand stops at it."""
    info = tmp_path / "torchvision-0.20.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.20.1\n")
    shown = _fedrcl_with(tmp_path, "--help")
    assert shown.returncode == 0 and shown.stdout.startswith("usage: fedrcl "), shown.stderr
    torch_version = metadata.version("torch")
    assert shown.stderr.startswith(f"fedrcl: warning: torch {torch_version} and torchvision 0.20.1 are builds that "
                                   "do not work together (torchvision 0.20 belongs to another torch release)"), \
        shown.stderr
    probe = "import sys; from fedrcl.cli import main\ntry: main(['--help'])\nexcept SystemExit: pass\n" \
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert imported.stdout.strip().splitlines()[-1] == "[]", imported.stdout + imported.stderr
    for command in (["report", "runs"], ["fit", "--config", str(REPO / "configs" / "quickstart.yaml")]):
        result = _fedrcl_with(tmp_path, *command)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr[-3000:]
        assert result.stderr.startswith("fedrcl: error: torch ") and '"torchvision==0.' in result.stderr


# -- a GPU-sized run on a CPU ---------------------------------------------------------------------------------
def test_the_time_of_a_run_and_when_it_is_worth_a_warning():
    from fedrcl.federated.progress import LONG_RUN_SECONDS, cpu_scale_configs, long_run_warning, run_seconds

    assert run_seconds(1.0, 250, 1000) == 250_000.0 and run_seconds(0.5, 10, 3, steps_done=4) == 13.0
    assert LONG_RUN_SECONDS == 86400
    # ResNet-18 width 64, the paper's 1000 rounds of 5 clients x 50 steps, at about 1 s a step on one CPU thread
    paper = long_run_warning(run_seconds(1.0, 250, 1000), "1 s a step", "cpu", "cifar10")
    assert paper is not None and "about 2.9 days on this cpu (1 s a step;" in paper, paper
    assert paper.endswith("configs/cpu/cifar10_a01_cnn.yaml, configs/cpu/cifar10_a01_resnet8.yaml, "
                          "configs/cpu/cifar10_unbalanced_cnn.yaml"), paper
    assert cpu_scale_configs("cifar10") == ["configs/cpu/cifar10_a01_cnn.yaml", "configs/cpu/cifar10_a01_resnet8.yaml",
                                            "configs/cpu/cifar10_unbalanced_cnn.yaml"]
    other = long_run_warning(run_seconds(1.0, 250, 1000), "1 s a step", "cpu", "cifar100")
    assert other is not None and "no CPU-scale config of cifar100" in other and "--trainer.rounds" in other
    gpu = long_run_warning(2 * 86400, "0.3 s a step", "cuda", "cifar10")
    assert gpu is not None and "configs/cpu" not in gpu
    # the CPU-scale settings themselves: width 8 (about 63 ms a step), 100 rounds; the CNN (35 ms), 200 rounds
    assert long_run_warning(run_seconds(0.063, 250, 100), "", "cpu", "cifar10") is None
    assert long_run_warning(run_seconds(0.035, 250, 200), "", "cpu", "cifar10") is None


def test_a_run_of_weeks_says_so_from_its_first_steps(data_root, tmp_path, capsys, monkeypatch):
    """Without a terminal the first round says its pace after ``FIRST_LINE_SECONDS`` (here 0: after its second
    step), before the round's line; a run estimated at more than a day warns once. The quickstart with ten
    million rounds, stopped by SIGTERM in round 1."""
    from fedrcl.federated import progress
    from fedrcl.federated.preemption import Preempted

    monkeypatch.setattr(progress, "FIRST_LINE_SECONDS", 0.0)
    with pytest.raises(Preempted):
        run_cli(data_root, tmp_path, "--trainer.callbacks+=faults.SignalAt",
                "--trainer.callbacks.init_args.round=1", "--trainer.callbacks.init_args.step=3", rounds=10_000_000)
    err = capsys.readouterr().err.splitlines()
    first = next(i for i, line in enumerate(err) if line.startswith("Round 1/10000000"))
    assert re.fullmatch(r"Round 1/10000000  step 2/\d+ in 0:0\d  \([\d.e-]+ s a step; round about 0:0\d, "
                        r"run about [\d.]+ days\)", err[first]), err[first]
    assert any(line.startswith("Round 1/10000000  val/acc ") for line in err[first + 1:]), err[first:]
    warnings = [line for line in err if line.startswith("fedrcl: warning: this run would train for about ")]
    assert len(warnings) == 1 and " days on this cpu (" in warnings[0], err
    assert "configs/cpu/ has no CPU-scale config of digits" in warnings[0], warnings


def test_cifar_without_internet_names_a_prepared_npz_as_data_root(tmp_path, monkeypatch):
    """Offline, the way that needs no download: ``--data.root`` at a folder holding ``cifar10.npz``."""
    import urllib.error
    import urllib.request

    from fedrcl.data.datasets import DataUnavailableError, load_dataset

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    for download in (False, True):
        with pytest.raises(DataUnavailableError) as info:
            load_dataset("cifar10", tmp_path, download=download)
        assert "give --data.root a folder holding a prepared cifar10.npz" in str(info.value), str(info.value)


# -- accuracy first ------------------------------------------------------------------------------------------
def tensorboard_order(tags: list[str]) -> list[tuple[str, list[str]]]:
    """The groups of cards of TensorBoard's Time Series tab, in its order (tensorboard 2.x ``webfiles``:
    tags in natural order, where digits compare as numbers and sort, as ``/`` does, before other characters;
    grouped by their first ``/`` part, in the order the groups first appear)."""
    def key(tag: str) -> list[tuple[int, Any]]:
        return [(0, int(part)) if part.isdigit() else (1 if part == "/" else 2, part)
                for part in re.findall(r"\d+|.", tag)]

    groups: dict[str, list[str]] = {}
    for tag in sorted(tags, key=key):
        groups.setdefault(tag.split("/", 1)[0], []).append(tag)
    return list(groups.items())


def test_tensorboard_opens_on_accuracy_and_its_ema(data_root, tmp_path):
    """The first group of TensorBoard's default tab (Time Series; it opens the first two) holds ``val/acc``
    and ``val/acc_ema`` (under ``accuracy/``), the same values as the tags every reader keeps reading."""
    from fedrcl.analysis import load_scalars

    cli = run_cli(data_root, tmp_path, rounds=2)
    curves = load_scalars(Path(cli.trainer.logger.log_dir))
    groups = tensorboard_order(list(curves))
    assert groups[0] == ("accuracy", ["accuracy/val/acc", "accuracy/val/acc_ema"]), groups[:2]
    assert groups[1][0] == "comm" and groups[-1] == ("val", ["val/acc", "val/acc_ema"]), groups
    for tag in ("val/acc", "val/acc_ema"):
        for copy, original in zip(curves[f"accuracy/{tag}"], curves[tag]):
            assert copy.tolist() == original.tolist(), tag
