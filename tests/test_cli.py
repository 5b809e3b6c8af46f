"""End to end through ``fedrcl fit`` on digits: logging, checkpoints, resume, one model object."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ACCELERATOR, assert_same_state, run_cli


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def load_ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_fit_logs_every_round_and_checkpoints(data_root, tmp_path):
    cli = run_cli(data_root, tmp_path, rounds=3)
    log_dir = Path(cli.trainer.logger.log_dir)
    acc = scalars(log_dir, "val/acc")
    assert [s for s, _ in acc] == [1, 2, 3]  # x-axis is the round
    assert all(0.0 <= v <= 1.0 for _, v in acc)
    ema = scalars(log_dir, "val/acc_ema")
    assert ema[0][1] == pytest.approx(acc[0][1])
    assert ema[-1][1] == pytest.approx(0.9 * (0.9 * acc[0][1] + 0.1 * acc[1][1]) + 0.1 * acc[2][1], abs=1e-6)
    for tag in ("train/loss", "train/loss_ce", "train/loss_scl", "train/loss_penalty", "train/loss_scl_level0",
                "train/lr", "time/round_seconds"):
        assert len(scalars(log_dir, tag)) == 3, tag
    lrs = [v for _, v in scalars(log_dir, "train/lr")]
    assert lrs == pytest.approx([0.1, 0.1 * 0.998, 0.1 * 0.998 ** 2])
    ckpt = load_ckpt(log_dir / "checkpoints" / "last.ckpt")
    assert ckpt["epoch"] == 2 and "Federation" in "".join(ckpt["callbacks"])


def test_one_model_and_one_optimizer_for_all_clients(data_root, tmp_path, monkeypatch):
    from fedrcl.algorithms import FedAvg

    built = []
    original = FedAvg.configure_optimizers
    monkeypatch.setattr(FedAvg, "configure_optimizers", lambda self: built.append(1) or original(self))
    cli = run_cli(data_root, tmp_path, rounds=2, model="fedrcl.algorithms.FedAvg")
    assert len(built) == 1
    assert cli.trainer.optimizers[0].param_groups[0]["params"][0] is next(cli.model.backbone.parameters())


@pytest.mark.parametrize("precision", ["32-true", "64-true"])
def test_resume_gives_the_same_curve_and_weights(data_root, tmp_path, precision):
    """Bitwise on CPU, in float64 too: Lightning restores weights before converting the module to the run's
    precision, so a float64 checkpoint read into the float32 module came back rounded (7e-9 in FedAvg's
    weights); ``FederatedTrainer.fit`` converts the module first."""
    full = run_cli(data_root, tmp_path / "full", "--trainer.precision", precision, rounds=4)
    run_cli(data_root, tmp_path / "split", "--trainer.precision", precision, rounds=2)
    resumed = run_cli(data_root, tmp_path / "split", "--trainer.precision", precision, "--ckpt_path", "last",
                      rounds=4)
    full_dir, resumed_dir = Path(full.trainer.logger.log_dir), Path(resumed.trainer.logger.log_dir)
    assert resumed_dir.name == "version_1"  # a resumed run writes a new version; nothing is overwritten
    assert (resumed_dir.parent / "version_0" / "checkpoints" / "last.ckpt").exists()
    a, b = load_ckpt(full_dir / "checkpoints" / "last.ckpt"), load_ckpt(resumed_dir / "checkpoints" / "last.ckpt")
    assert a.keys() >= {"state_dict", "callbacks", "acc_ema"}
    assert_same_state(a["state_dict"], b["state_dict"])
    tolerance = 0 if ACCELERATOR == "cpu" else 0.01
    assert a["acc_ema"] == pytest.approx(b["acc_ema"], abs=tolerance)
    full_curve, resumed_curve = scalars(full_dir, "val/acc")[2:], scalars(resumed_dir, "val/acc")
    assert [s for s, _ in full_curve] == [s for s, _ in resumed_curve] == [3, 4]
    assert [v for _, v in full_curve] == pytest.approx([v for _, v in resumed_curve], abs=tolerance)


def test_methods_see_the_same_clients(data_root, tmp_path):
    plans = []
    for model in ("fedrcl.algorithms.FedAvg", "fedrcl.algorithms.FedRCL"):
        cli = run_cli(data_root, tmp_path / model, rounds=1, model=model)
        plans.append([cli.trainer.federation.plan(r).client_ids for r in range(5)])
    assert plans[0] == plans[1]


def test_fedavg_round_equals_a_raw_pytorch_round(data_root, tmp_path):
    """One framework round == load global, plain SGD on each client's batches, sample-weighted mean."""
    from fedrcl.federated.sampling import sample_clients

    cli = run_cli(data_root, tmp_path, "--model.init_args.lr", "0.1", rounds=1, model="fedrcl.algorithms.FedAvg")
    model, dm, fed = cli.model, cli.datamodule, cli.trainer.federation
    after = {k: v.clone() for k, v in model.backbone.state_dict().items()}

    device = dm.x_train.device
    torch.manual_seed(0)  # seed_everything(0) before the model was built: the same initial weights
    start = type(model.backbone)(10, 1, 8, conv_padding=2).to(device).state_dict()
    clients = sample_clients(dm.num_clients, 3, fed.seed, 0)
    total, weight = {k: torch.zeros_like(v) for k, v in start.items()}, 0
    net = type(model.backbone)(10, 1, 8, conv_padding=2).to(device)
    for client_id in clients:
        net.load_state_dict(start)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, weight_decay=1e-3)
        for x, y in dm.client_batches(client_id, 0, 1, fed.seed):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x).logits, y).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
            opt.step()
        n = dm.client_num_samples(client_id)
        for k, v in net.state_dict().items():
            total[k] += n * v
        weight += n
    for k, v in total.items():
        torch.testing.assert_close(after[k], (v / weight).to(after[k].device), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("subcommand, key", [("test", "test/acc"), ("validate", "val/acc")])
def test_evaluate_a_checkpoint(data_root, tmp_path, subcommand, key):
    fit = run_cli(data_root, tmp_path, rounds=2)
    log_dir = Path(fit.trainer.logger.log_dir)
    evaluated = run_cli(data_root, tmp_path, "--ckpt_path", str(log_dir / "checkpoints" / "last.ckpt"),
                        subcommand=subcommand)
    assert evaluated.trainer.callback_metrics[key].item() == pytest.approx(scalars(log_dir, "val/acc")[-1][1])


def test_console_script_exits_zero(data_root, tmp_path):
    """``fedrcl fit`` as a user runs it: a separate process, exit status 0."""
    import subprocess
    import sys

    from conftest import REPO

    result = subprocess.run(
        [sys.executable, "-c", "from fedrcl.cli import main; raise SystemExit(main())", "fit",
         "--config", str(REPO / "configs" / "quickstart.yaml"), "--data.root", str(data_root),
         "--trainer.rounds", "1", "--trainer.enable_progress_bar", "false",
         "--trainer.logger.init_args.save_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_console_script_finds_a_method_in_the_current_folder(tmp_path):
    """``fedrcl fit --model my_method.Mine`` with ``my_method.py`` in the folder the user runs it from."""
    import subprocess
    import sys

    from conftest import REPO

    (tmp_path / "my_method.py").write_text("from fedrcl.algorithms import FedAvg\n\n\nclass Mine(FedAvg):\n"
                                           "    pass\n")
    script = Path(sys.executable).parent / "fedrcl"
    result = subprocess.run([str(script), "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
                             "--model", "my_method.Mine", "--print_config"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "class_path: my_method.Mine" in result.stdout


def test_bf16_mixed_precision(data_root, tmp_path):
    """Lightning's --trainer.precision works with the round loop and the RCL loss."""
    cli = run_cli(data_root, tmp_path, "--trainer.precision", "bf16-mixed", rounds=1)
    log_dir = Path(cli.trainer.logger.log_dir)
    assert all(torch.isfinite(torch.tensor(v)) for _, v in scalars(log_dir, "train/loss"))
    assert cli.model.backbone.fc1.weight.dtype == torch.float32  # mixed: weights stay float32


def test_progress_bar_counts_rounds(data_root, tmp_path, capsys):
    """The bar is labelled 'Round r/R' from its first line on, never with Lightning's 0-based 'Epoch'."""
    run_cli(data_root, tmp_path, "--trainer.enable_progress_bar", "true")
    shown = "".join(capsys.readouterr())
    assert "Round 1/2" in shown and "Round 2/2" in shown
    assert "Epoch" not in shown


def test_help_report_plot_and_seeds_start_without_lightning():
    """``fedrcl --help`` and the subcommands that only read runs never import Lightning (nor torch): it took
    3.7 of their 3.8 s. Checked in a fresh interpreter, where nothing is imported yet."""
    import subprocess
    import sys

    from conftest import REPO

    script = ("import sys\nfrom fedrcl.cli import main\n"
              "for args in (['--help'], ['report', '--help'], ['plot', '--help'], ['seeds', '--help'], ['nope']):\n"
              "    try:\n        main(args)\n    except SystemExit:\n        pass\n"
              "    loaded = [m for m in ('lightning', 'torch') if m in sys.modules]\n"
              "    assert not loaded, (args, loaded)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage: fedrcl [-h] {fit,validate,test," in result.stdout
    assert "invalid choice: 'nope'" in result.stderr


def test_the_top_level_help_matches_the_trainers_subcommands():
    """``fedrcl --help`` lists LightningCLI's subcommands with the first paragraph of their docstring, as
    LightningCLI's own help does (written out in ``fedrcl.cli`` so that it needs no Lightning)."""
    import inspect

    from fedrcl.cli import TRAINER_SUBCOMMANDS
    from fedrcl.federated.trainer import FederatedTrainer
    from fedrcl.lightning_cli import FedRCLCLI

    assert list(TRAINER_SUBCOMMANDS) == list(FedRCLCLI.subcommands())
    for name, text in TRAINER_SUBCOMMANDS.items():
        first = inspect.getdoc(getattr(FederatedTrainer, name)).split("\n\n")[0]
        assert text == " ".join(first.split()), name


def test_rounds_show_elapsed_and_time_left_and_the_fit_ends_in_a_summary(data_root, tmp_path, capsys, caplog):
    import re

    cli = run_cli(data_root, tmp_path, "--trainer.enable_model_summary", "true", rounds=3)
    err = capsys.readouterr().err.splitlines()
    rounds = [line for line in err if line.startswith("Round ")]
    assert len(rounds) == 3
    for k, line in enumerate(rounds, 1):
        assert re.fullmatch(rf"Round {k}/3  val/acc \S+  val/acc_ema \S+  \(\d+\.\d\d s; elapsed \d+:\d\d, "
                            rf"left \d+:\d\d\)", line), line
    assert rounds[-1].endswith("left 0:00)")
    log_dir = Path(cli.trainer.logger.log_dir)
    acc, ema = (cli.trainer.callback_metrics[k].item() for k in ("val/acc", "val/acc_ema"))
    summary = err[err.index(rounds[-1]) + 1:]
    assert re.fullmatch(rf"fedrcl: 3/3 rounds in \d+:\d\d; val/acc {acc:.4f}, val/acc_ema {ema:.4f}", summary[0])
    assert summary[1:] == [f"  run folder: {log_dir}", f"  checkpoint: {log_dir / 'checkpoints' / 'last.ckpt'}"]
    assert "stopped early" not in "\n".join(err)
    shown = caplog.text  # the model summary: weights only, no FLOPs counted from nothing, no metric objects
    assert "backbone | SmallCNN" in shown and "Total params" in shown
    assert "FLOPs" not in shown and "val_acc" not in shown and "Trainer.fit` stopped" not in shown


@pytest.mark.parametrize("args, reason", [
    (["--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping", "--trainer.callbacks.monitor=val/acc",
      "--trainer.callbacks.mode=max", "--trainer.callbacks.stopping_threshold=0.0"],
     "EarlyStopping: Stopping threshold reached: val/acc = "),
    (['--trainer.max_time={"milliseconds": 1}'], "trainer.max_time reached ("),
])
def test_a_run_stopped_early_says_why_in_one_line(data_root, tmp_path, capsys, args, reason):
    cli = run_cli(data_root, tmp_path, *args, rounds=3)
    assert cli.trainer.current_epoch == 1
    line = next(line for line in capsys.readouterr().err.splitlines() if "stopped early" in line)
    assert line.startswith(f"fedrcl: stopped early after round 1/3: {reason}"), line


def test_a_terminals_bar_shows_elapsed_and_time_left(data_root, tmp_path, monkeypatch):
    """On a terminal the bar's label carries what the log line does: the round, the elapsed time and the time
    left (before round 1 ends nothing is known: ``left ?``), then the same closing summary."""
    import io
    import re
    import sys

    from fedrcl.federated.progress import RoundProgressBar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setattr(sys, "stdout", Terminal())  # where Lightning's tqdm draws
    cli = run_cli(data_root, tmp_path, "--trainer.enable_progress_bar", "true", rounds=2)
    bar = sys.stdout.getvalue()
    assert isinstance(cli.trainer.progress_bar_callback, RoundProgressBar)
    assert "Round 1/2 (elapsed 0:00, left ?)" in bar
    assert re.search(r"Round 2/2 \(elapsed \d+:\d\d, left \d+:\d\d\)", bar), bar[-2000:]
    assert "fedrcl: 2/2 rounds in " in sys.stderr.getvalue()


# -- what a run can pick -------------------------------------------------------------------------------------
def test_fedrcl_methods_lists_methods_and_servers_with_paper_and_options_without_lightning():
    """``fedrcl methods``: every client method and server optimizer, its paper and its options with their
    defaults (the paper's lambda is FedRCL's ``threshold``), read from the source: no torch, no Lightning,
    well under a second."""
    import subprocess
    import sys
    import time

    from conftest import REPO
    from fedrcl.methods import entries, listing

    script = ("import sys, time\nfrom fedrcl.cli import main\nstart = time.perf_counter()\nmain(['methods'])\n"
              "print('seconds', time.perf_counter() - start)\n"
              "print('loaded', [m for m in ('lightning', 'torch') if m in sys.modules])\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert out.strip().splitlines()[-1] == "loaded []", out[-500:]
    assert float(out.strip().splitlines()[-2].split()[1]) < 1.0, out[-500:]
    assert '  FedRCL      Seo et al., "Relaxed Contrastive Learning for Federated Learning", CVPR 2024' in out
    assert re.search(r"^      threshold 0\.7 +lambda: same-class pairs", out, re.M), out
    assert re.search(r"^      mu 0\.001 +weight of the proximal term", out, re.M), out
    assert re.search(r"^  FedACG +Kim, Kim and Han, .*CVPR 2024\n      lam 0\.85 ", out, re.M), out
    servers = [e.name for e in entries("server")]
    assert servers[0] == "FedAvg" and {"FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "FedACG"} <= set(servers)
    assert not {"ServerOptimizer", "StatefulServer", "FedOpt"} & set(servers)  # left to subclasses
    adagrad = next(e for e in entries("server") if e.name == "FedAdagrad")
    assert [o.name for o in adagrad.options] == ["eta", "beta1", "tau"]  # FedOpt's, which it inherits
    assert listing() == out[:out.index("\nseconds ")]


def test_methods_lists_what_fit_help_offers():
    """The same classes as ``fedrcl fit --help``'s choices (``selectable``), in ``__all__``'s order."""
    import fedrcl.algorithms
    import fedrcl.server
    from fedrcl.lightning_cli import selectable
    from fedrcl.methods import entries

    for package, module in (("algorithms", fedrcl.algorithms), ("server", fedrcl.server)):
        offered = {name for name in module.__all__ if selectable(f"fedrcl.{package}.{name}")}
        assert {e.name for e in entries(package)} == offered, package


def test_an_unknown_model_option_names_the_methods_options_and_the_closest(capsys):
    """``--model.lambda`` (jsonargparse: ``NestedArg(key='lambda', ...)`` "not a class fedrcl can import"):
    one line naming FedRCL's options and ``threshold``, the paper's lambda; a misspelling gets its option."""
    from conftest import REPO
    from fedrcl.cli import main

    for typed, meant in ((["--model.lambda", "0.5"], "threshold (lambda: same-class pairs at least this similar "
                                                        "are pushed apart)"),
                         (["--model.init_args.temprature=0.1"], "temperature (tau of the contrastive terms)")):
        with pytest.raises(SystemExit) as info:
            main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), *typed])
        assert info.value.code == 2
        err = capsys.readouterr().err
        first = err.splitlines()[0]
        assert first.startswith("fedrcl fit: error: --model.") and "NestedArg" not in err, err
        assert f"; did you mean {meant}? Its options: temperature, threshold, beta, " in first, first
        assert "lr, lr_decay" in first and "num_classes" not in first, first


def test_fit_help_starts_with_the_methods_and_server_optimizers(capsys):
    from fedrcl.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    head = out.splitlines()[:30]
    assert head[0] == "Client methods (--model fedrcl.algorithms.<Name>):", head
    assert any(line.startswith("  FedRCL      Seo et al.") for line in head), head
    assert any(line.startswith("Server optimizers (--trainer.server fedrcl.server.<Name>") for line in head), head
    assert out.index("usage: fedrcl") > out.index("  FedAvgM ")
