"""Per-client evaluation (fedrcl.analysis.client_evaluation): hand cases, and end to end on digits."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from fedrcl.analysis import ClientEvaluation, label_mix_accuracy, load_scalars, spread_summary
from fedrcl.analysis.client_evaluation import class_accuracy_counts
from fedrcl.data.augment import to_normalized
from fedrcl.data.datasets import load_dataset


def test_class_accuracy_counts_by_hand():
    predictions = torch.tensor([0, 1, 1, 2, 0, 2])
    labels = torch.tensor([0, 1, 0, 2, 0, 1])
    correct, total = class_accuracy_counts(predictions, labels, num_classes=4)
    assert correct.tolist() == [2, 1, 1, 0]
    assert total.tolist() == [3, 2, 1, 0]


def test_label_mix_accuracy_by_hand():
    correct, total = torch.tensor([8, 1, 0]), torch.tensor([10, 10, 0])  # class 2 has no test samples
    counts = torch.tensor([[1, 3, 0], [0, 0, 5], [2, 0, 2], [5, 5, 0]])
    acc = label_mix_accuracy(correct, total, counts)
    assert acc[0].item() == pytest.approx((0.8 * 1 + 0.1 * 3) / 4)
    assert math.isnan(acc[1].item())  # none of its classes can be tested
    assert acc[2].item() == pytest.approx(0.8)  # class 2 left out, the mix renormalised
    assert acc[3].item() == pytest.approx(9 / 20)  # a balanced mix: the plain test accuracy
    assert label_mix_accuracy(correct, total, counts[0]).item() == pytest.approx(acc[0].item())


def test_spread_summary_by_hand():
    ten = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7, 0.2, 0.4, 0.6, 0.8, 1.0])
    summary = spread_summary(ten)
    assert summary["mean"] == pytest.approx(0.55)
    assert summary["worst10"] == pytest.approx(0.1)  # one client of ten
    assert summary["std"] == pytest.approx(math.sqrt(sum((v - 0.55) ** 2 for v in ten.tolist()) / 10))
    assert spread_summary(torch.cat([ten, torch.tensor([0.0])]))["worst10"] == pytest.approx(0.05)  # 2 of 11


def test_bad_every_n_rounds_is_an_error():
    with pytest.raises(ValueError, match="every_n_rounds"):
        ClientEvaluation(every_n_rounds=0)


def read_csv(log_dir: Path) -> list[dict[str, str]]:
    with open(log_dir / "client_evaluation.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_client_evaluation_end_to_end(data_root, tmp_path):
    """With one client per round and FedAvg's server, the round's local model *is* the new global model:
    its test accuracy is val/acc and its own-mix accuracy is the global model's on its mix."""
    common = ("--trainer.clients_per_round", "1")
    plain = run_cli(data_root, tmp_path / "plain", *common, rounds=2, model="fedrcl.algorithms.FedAvg")
    callback = ("--trainer.callbacks+=fedrcl.analysis.ClientEvaluation",
                "--trainer.callbacks.init_args.every_n_rounds", "1")
    cli = run_cli(data_root, tmp_path / "eval", *common, *callback, rounds=2,
                  model="fedrcl.algorithms.FedAvg")
    log_dir = Path(cli.trainer.log_dir)
    scalars, plain_scalars = load_scalars(log_dir), load_scalars(Path(plain.trainer.log_dir))
    assert scalars["val/acc"][1].tolist() == plain_scalars["val/acc"][1].tolist()  # training untouched

    rows = read_csv(log_dir)
    assert len(rows) == 2 * 10 and [int(r["round"]) for r in rows] == [1] * 10 + [2] * 10
    trained = [r for r in rows if r["local_test_acc"]]
    assert len(trained) == 2  # one client per round
    for row in trained:
        step = int(row["round"])
        assert float(row["local_test_acc"]) == pytest.approx(scalars["val/acc"][1][step - 1], abs=1e-6)
        assert float(row["local_own_mix_acc"]) == pytest.approx(float(row["global_mix_acc"]), abs=1e-12)

    # the last round's global_mix_acc, recomputed from the final weights, the split and the test set
    model = cli.model.backbone.eval()
    data = load_dataset("digits", data_root)
    with torch.no_grad():
        predictions = model(to_normalized(data.x_test, cli.datamodule.info)).logits.argmax(1)
    split = json.loads((log_dir / "split.json").read_text())["clients"]
    for row in rows[10:]:
        labels = data.y_train[split[int(row["client_id"])]]
        share = torch.bincount(labels, minlength=10).double() / len(labels)
        per_class = torch.tensor([(predictions[data.y_test == c] == c).double().mean().item()
                                  for c in range(10)])
        assert float(row["global_mix_acc"]) == pytest.approx(float((share * per_class).sum()), abs=1e-9)
        assert int(row["num_samples"]) == len(labels)
    last = torch.tensor([float(r["global_mix_acc"]) for r in rows[10:]])
    for name, value in spread_summary(last).items():
        assert scalars[f"clients/global_mix_acc_{name}"][1][-1] == pytest.approx(value, abs=1e-6)
    assert (log_dir / "client_evaluation.png").stat().st_size > 0
    assert not list(log_dir.glob("*.tmp*"))
    assert (scalars["time/client_eval_seconds"][1] > 0).all()


def test_analysis_callbacks_run_in_seeds_together_as_in_each_seeds_fit(data_root, tmp_path, capsys):
    """``RoundCallback``s run in seeds together (the clients' local models are in the process): ClientEvaluation's
    and RepresentationMonitor's scalars (the local models' ones included) and ClientEvaluation's table of each seed
    trained together are those of its own fit (float64, 1e-9), and the run names neither as not run."""
    from fedrcl import seeds
    from test_together import args, scalars

    extra = ("--trainer.precision", "64-true",
             "--trainer.callbacks+=fedrcl.analysis.ClientEvaluation",
             "--trainer.callbacks.init_args.every_n_rounds", "1",
             "--trainer.callbacks+=fedrcl.analysis.RepresentationMonitor",
             "--trainer.callbacks.init_args.every_n_rounds", "1", "--trainer.callbacks.init_args.num_samples", "200")
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path / "together", *extra, rounds=2)])
    out = capsys.readouterr().out
    assert "--together:" not in out and "does not run" not in out, out  # together, every callback run
    seeds.main(["--seeds", "0", "1", *args(data_root, tmp_path / "alone", *extra, rounds=2)])
    for seed in (0, 1):
        together, alone = scalars(tmp_path / "together", seed), scalars(tmp_path / "alone", seed)
        analysis = sorted(t for t in alone if t.startswith(("clients/", "repr/")))
        assert {"clients/global_mix_acc_mean", "clients/local_test_acc_mean", "repr/local/level0/vci"} <= set(analysis)
        assert set(analysis) <= set(together)
        for tag in analysis:
            assert [s for s, _ in together[tag]] == [s for s, _ in alone[tag]] == [1, 2], tag
            assert [v for _, v in together[tag]] == pytest.approx([v for _, v in alone[tag]], rel=1e-9, abs=1e-12), tag
        folder = Path("quickstart") / f"seed{seed}" / "version_0"
        rows = {name: read_csv(tmp_path / name / folder) for name in ("together", "alone")}
        assert len(rows["together"]) == len(rows["alone"]) == 2 * 10
        for a, b in zip(rows["together"], rows["alone"]):
            assert a.keys() == b.keys() and a["client_id"] == b["client_id"] and a["round"] == b["round"]
            for key in ("global_mix_acc", "local_test_acc", "local_own_mix_acc"):
                assert (a[key] == "") == (b[key] == "")
                if a[key]:
                    assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-9), key
