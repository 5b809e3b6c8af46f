"""What a new user meets first: the subcommand list, the losses package, threads, progress in a log, CI."""
from __future__ import annotations

import importlib
import inspect
import io
import pkgutil
import sys

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

    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert isinstance(round_progress(), RoundProgressBar)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(round_progress(), RoundLines)


def test_ci_runs_the_quickstart_and_removes_its_venv():
    script = (REPO / ".ci" / "run").read_text()
    assert "fedrcl fit --config" in script and "configs/quickstart.yaml" in script
    assert "trap " in script and "rm -rf" in script
