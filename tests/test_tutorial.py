"""docs/tutorial.md runs as written: its commands (at 2 rounds on 10 clients) and Python blocks, in page order;
and the tutorial's methods (docs/tutorial/my_method.py) are pinned to their rules."""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, run_cli
from fedrcl.contract import ClientContext

TUTORIAL = REPO / "docs" / "tutorial.md"
TUTORIAL_DIR = REPO / "docs" / "tutorial"
# What shrinks each `fedrcl fit` / `fedrcl seeds` of the page to a few seconds (appended: later keys win).
SMALL = ["--trainer.rounds", "2", "--trainer.local_epochs", "1", "--data.num_clients", "10",
         "--trainer.clients_per_round", "3", "--trainer.enable_progress_bar", "false",
         "--trainer.enable_model_summary", "false"]


@pytest.fixture(autouse=True)
def tutorial_module(monkeypatch):
    monkeypatch.syspath_prepend(str(TUTORIAL_DIR))
    yield
    sys.modules.pop("my_method", None)


def tutorial_blocks() -> list[tuple[str, str]]:
    """The page's fenced ``bash`` and ``python`` blocks, in order (``{literalinclude}`` blocks show the
    tutorial's file, which the tests import)."""
    blocks = re.findall(r"^```(\w+)\n(.*?)^```$", TUTORIAL.read_text(encoding="utf-8"), flags=re.M | re.S)
    return [(lang, text) for lang, text in blocks if lang in ("bash", "python")]


def run_command(line: str, tmp_path: Path, monkeypatch) -> None:
    """One shell line of the page: ``[PYTHONPATH=dir] fedrcl <subcommand> ...``, run in this process."""
    from fedrcl.cli import main

    words = shlex.split(line)
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        assert name == "PYTHONPATH", f"the tutorial sets {name}, which this test does not emulate"
        monkeypatch.syspath_prepend(str(tmp_path / value))
    assert words[0] == "fedrcl", f"the tutorial runs {words[0]!r}; this test only runs fedrcl commands"
    args = words[1:] + (SMALL if words[1] in ("fit", "seeds") else [])
    try:
        main(args)
    except SystemExit as stop:
        assert stop.code in (0, None), f"`{line}` exited with {stop.code}"


def test_tutorial_runs_as_written(tmp_path, data_root, monkeypatch, capsys):
    for name, target in (("configs", REPO / "configs"), ("docs", REPO / "docs"), ("data", data_root)):
        (tmp_path / name).symlink_to(target)
    monkeypatch.chdir(tmp_path)
    blocks = tutorial_blocks()
    assert [lang for lang, _ in blocks].count("bash") >= 5 and any(lang == "python" for lang, _ in blocks)
    namespace: dict = {}
    for lang, text in blocks:
        if lang == "python":
            exec(compile(text, str(TUTORIAL), "exec"), namespace)
            continue
        for line in text.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                run_command(line, tmp_path, monkeypatch)

    from fedrcl.analysis import load_scalars

    # The report's "Seeds" section groups the three seeds of each method.
    report = (tmp_path / "runs" / "tutorial" / "report.md").read_text()
    seeds = report[report.index("## Seeds"):]
    for experiment, method in (("fedavg", "FedAvg"), ("my_method", "MyMethod")):  # paths below RUNS_DIR
        assert re.search(rf"^\| {experiment} \| {method} \| FedAvg \| 3 \| 0,1,2 ", seeds, flags=re.M), seeds
    # `fedrcl fit` with the config's seeds is seed 0 of `fedrcl seeds`: the same curve.
    single = load_scalars(tmp_path / "runs" / "my_method")["val/acc_ema"]
    seed0 = load_scalars(tmp_path / "runs" / "tutorial" / "my_method" / "seed0")["val/acc_ema"]
    assert single[0].tolist() == seed0[0].tolist() == [1, 2] and single[1].tolist() == seed0[1].tolist()
    # Per-client state: one file per client that trained, named by the manifest of the last checkpoint.
    run = tmp_path / "runs" / "tutorial" / "my_stateful" / "version_0"
    manifest = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["client_state"]["files"]
    assert 3 <= len(manifest) <= 6 and all(Path(f).parent == run / "client_state" for f in manifest.values())
    assert sorted(p.name for p in (run / "client_state").iterdir()) == sorted(Path(f).name for f in manifest.values())
    assert "train/loss_own" in load_scalars(run) and "train/loss_prox" in load_scalars(run)
    # The server learning rate reached the run's config.
    assert "eta: 1.5" in (tmp_path / "runs" / "tutorial" / "server_lr" / "version_0" / "config.yaml").read_text()
    assert "val/acc_ema" in capsys.readouterr().out


def test_my_method_loss_is_ce_plus_head_proximal_term():
    from my_method import MyMethod

    from fedrcl.models import SmallCNN

    torch.manual_seed(0)
    method = MyMethod(backbone=SmallCNN, num_classes=10, in_channels=3, image_size=32, mu=0.3)
    assert method.head_names == ["fc.weight", "fc.bias"]
    # The broadcast classifier: every weight 0.5 away from the local one (weight: 192 x 10, bias: 10).
    sent = {name: p.detach() + 0.5 for name, p in method.backbone.named_parameters()}
    method.client = ClientContext(round_idx=0, client_id=0, num_samples=4, num_steps=1, seed=0, global_state=sent)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    out = method.backbone(x)
    loss, parts = method.client_loss(x, y, out)
    assert parts["prox"].item() == pytest.approx(0.25 * (1920 + 10))
    assert loss.item() == pytest.approx(F.cross_entropy(out.logits, y).item() + 0.3 / 2 * 0.25 * 1930, rel=1e-6)
    loss.backward()  # the term's gradient reaches the classifier only: mu * (w - anchor) = 0.3 * -0.5
    ce_only = MyMethod(backbone=SmallCNN, num_classes=10, in_channels=3, image_size=32, mu=0.0)
    ce_only.load_state_dict(method.state_dict())
    ce_only.client = method.client
    ce_only.client_loss(x, y, ce_only.backbone(x))[0].backward()
    for (name, p), q in zip(method.backbone.named_parameters(), ce_only.backbone.parameters()):
        expected = q.grad + (-0.15 if name.startswith("fc.") else 0.0)
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="model.mu must be >= 0"):
        MyMethod(backbone=SmallCNN, num_classes=10, in_channels=3, image_size=32, mu=-1.0)
    with pytest.raises(ValueError, match="model.head"):
        MyMethod(backbone=SmallCNN, num_classes=10, in_channels=3, image_size=32, head="classifier.")


def test_server_lr_step_by_hand():
    from my_method import ServerLR

    from fedrcl.server import FedAvg

    global_state = {"w": torch.tensor([1.0, 2.0]), "count": torch.tensor(7)}
    client_mean = {"w": torch.tensor([3.0, 0.0])}
    new = ServerLR(eta=0.5).step(global_state, global_state, client_mean)
    assert new["w"].tolist() == [2.0, 1.0] and new["count"].item() == 7  # 1 + 0.5 * 2, 2 + 0.5 * -2
    assert ServerLR(eta=1.0).step(global_state, global_state, client_mean)["w"].tolist() == \
        FedAvg().step(global_state, global_state, client_mean)["w"].tolist()
    with pytest.raises(ValueError, match="trainer.server.init_args.eta must be > 0"):
        ServerLR(eta=0.0)


def test_my_stateful_method_batched_equals_one_client_at_a_time(data_root, tmp_path):
    """``client.tensors`` is what lets per-client state train batched: the same weights and loss parts as
    the sequential loop (float64, 3 clients that all train in both rounds, so round 2 reads their state)."""
    results = {}
    for mode in ("off", "on"):
        cli = run_cli(data_root, tmp_path / mode, "--data.num_clients", "3", "--trainer.precision", "64-true",
                      "--trainer.client_batching", mode, model="my_method.MyStatefulMethod")
        assert cli.trainer.federation.plan(1).batched == (mode == "on")
        results[mode] = ({k: v.clone() for k, v in cli.model.backbone.state_dict().items()},
                         {k: v.item() for k, v in cli.trainer.logged_metrics.items() if k.startswith("train/loss")})
    (seq_weights, seq_losses), (bat_weights, bat_losses) = results["off"], results["on"]
    assert seq_losses["train/loss_own"] > 0 and seq_losses.keys() == bat_losses.keys()
    for key, value in seq_losses.items():
        assert bat_losses[key] == pytest.approx(value, rel=1e-5), key
    for key, value in seq_weights.items():
        torch.testing.assert_close(bat_weights[key], value, rtol=1e-5, atol=1e-8, msg=key)
