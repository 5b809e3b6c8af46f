"""Client baselines: each loss against its definition, and each method for 2 rounds through ``fedrcl fit``."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from conftest import REPO, assert_same_state, run_cli
from fedrcl.cli import main
from fedrcl.contract.context import ClientContext
from fedrcl.contract.weights import snapshot
from fedrcl.losses.decorrelation import decorrelation_loss
from fedrcl.losses.feature_distillation import hint_losses
from fedrcl.losses.logit_calibration import calibrated_cross_entropy
from fedrcl.losses.not_true_distillation import not_true_distillation
from fedrcl.losses.proximal import squared_distance
from fedrcl.models import SmallCNN


# -- FedProx ----------------------------------------------------------------------------------------------
def test_squared_distance_hand_case():
    w = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    a = [torch.zeros(2), torch.tensor([[1.0]])]
    assert squared_distance(w, a).item() == pytest.approx(9.0)  # (1 + 4) + (3 - 1)^2


def test_squared_distance_random_and_gradient():
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(3, 4, generator=g, requires_grad=True), torch.randn(5, generator=g, requires_grad=True)]
    a = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    ref = sum(float(x - y) ** 2 for wi, ai in zip(w, a) for x, y in zip(wi.detach().double().flatten(),
                                                                       ai.double().flatten()))
    d = squared_distance(w, a)
    assert d.item() == pytest.approx(ref, rel=1e-6)
    d.backward()
    for wi, ai in zip(w, a):
        torch.testing.assert_close(wi.grad, 2 * (wi.detach() - ai))
    assert squared_distance(a, a).item() == 0.0


# -- FedLC ------------------------------------------------------------------------------------------------
def test_calibrated_ce_hand_case_with_an_absent_class():
    logits = torch.zeros(2, 3)
    counts = torch.tensor([16, 1, 0])
    # offsets: 16^-1/4 = 0.5, 1^-1/4 = 1, inf -> calibrated logits [-0.5, -1, -inf]
    # label 0: log(1 + e^-0.5) = 0.474077; label 1: log(1 + e^0.5) = 0.974077; mean 0.724077
    loss = calibrated_cross_entropy(logits, torch.tensor([0, 1]), counts, tau=1.0)
    assert loss.item() == pytest.approx(0.724077, abs=1e-6)


def reference_calibrated_ce(logits, labels, counts, tau):
    total = 0.0
    for row, y in zip(logits.double().tolist(), labels.tolist()):
        z = {c: row[c] - tau * counts[c] ** -0.25 for c in range(len(row)) if counts[c] > 0}
        total += -z[y] + math.log(sum(math.exp(v) for v in z.values()))
    return total / len(labels)


@pytest.mark.parametrize("tau", [0.5, 1.0, 2.0])
def test_calibrated_ce_random_client_missing_classes(tau):
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([40, 0, 3, 0, 120, 1, 0, 7])  # the client holds 5 of 8 classes
    present = torch.nonzero(counts).flatten()
    labels = present[torch.randint(len(present), (16,), generator=g)]
    logits = (3 * torch.randn(16, 8, generator=g)).requires_grad_(True)
    loss = calibrated_cross_entropy(logits, labels, counts, tau)
    assert loss.item() == pytest.approx(reference_calibrated_ce(logits.detach(), labels, counts.tolist(), tau),
                                        rel=1e-5)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[:, counts == 0] == 0).all()  # absent classes: out of the softmax, logits untouched


def test_calibrated_ce_tau_zero_is_plain_ce():
    logits, labels = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1])
    counts = torch.tensor([5, 0, 2, 9])
    torch.testing.assert_close(calibrated_cross_entropy(logits, labels, counts, tau=0.0),
                               torch.nn.functional.cross_entropy(logits, labels))


# -- FedDecorr --------------------------------------------------------------------------------------------
def test_decorrelation_hand_cases():
    # two perfectly correlated dims: K = [[1, 1], [1, 1]], ||K||_F^2 / d^2 = 4 / 4
    assert decorrelation_loss(torch.tensor([[1.0, 1.0], [-1.0, -1.0]])).item() == pytest.approx(1.0, abs=1e-6)
    # two uncorrelated dims: K = I, 2 / 4
    z = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]])
    assert decorrelation_loss(z).item() == pytest.approx(0.5, abs=1e-6)
    assert decorrelation_loss(torch.ones(1, 5)).item() == 0.0  # one sample: no correlations


def test_decorrelation_random_against_numpy_corrcoef():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(20, 6, generator=g) @ torch.randn(6, 6, generator=g) + 3  # correlated dims, shifted
    k = np.corrcoef(z.double().numpy(), rowvar=False)
    assert decorrelation_loss(z).item() == pytest.approx(float((k ** 2).sum() / 6 ** 2), rel=1e-5)


# -- FedNTD -----------------------------------------------------------------------------------------------
def test_ntd_hand_case():
    # label 0; not-true local logits [0, 0] -> q_l = [1/2, 1/2]; global [ln 3, 0] -> q_g = [3/4, 1/4]
    # KL = 3/4 ln(3/2) + 1/4 ln(1/2) = 0.304099 - 0.173287 = 0.130812 (the true-class logits do not matter)
    local = torch.tensor([[5.0, 0.0, 0.0]])
    glob = torch.tensor([[-2.0, math.log(3.0), 0.0]])
    assert not_true_distillation(local, glob, torch.tensor([0])).item() == pytest.approx(0.130812, abs=1e-6)


def reference_ntd(local, glob, labels, t):
    total = 0.0
    for lr, gr, y in zip(local.double().tolist(), glob.double().tolist(), labels.tolist()):
        keep = [c for c in range(len(lr)) if c != y]
        zl = sum(math.exp(lr[c] / t) for c in keep)
        zg = sum(math.exp(gr[c] / t) for c in keep)
        total += sum(math.exp(gr[c] / t) / zg * math.log((math.exp(gr[c] / t) / zg) / (math.exp(lr[c] / t) / zl))
                     for c in keep)
    return total / len(labels)


@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_ntd_random_and_zero_at_equal_logits(temperature):
    g = torch.Generator().manual_seed(3)
    local, glob = 2 * torch.randn(12, 7, generator=g), 2 * torch.randn(12, 7, generator=g)
    labels = torch.randint(7, (12,), generator=g)
    got = not_true_distillation(local, glob, labels, temperature)
    assert got.item() == pytest.approx(reference_ntd(local, glob, labels, temperature), rel=1e-5)
    assert not_true_distillation(local, local.clone(), labels, temperature).item() == pytest.approx(0.0, abs=1e-7)
    shifted = local.clone()
    shifted[torch.arange(12), labels] += 10.0  # only the true class moves: no change
    assert not_true_distillation(shifted, glob, labels, temperature).item() == pytest.approx(got.item(), rel=1e-5)


# -- FitNet -----------------------------------------------------------------------------------------------
def test_hint_losses_hand_case():
    local = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0]])]
    glob = [torch.zeros(1, 2), torch.tensor([[1.0]])]
    # level 0: (1 + 4) / 2 = 2.5; level 1: (3 - 1)^2 = 4
    torch.testing.assert_close(hint_losses(local, glob), torch.tensor([2.5, 4.0]))


def test_hint_losses_random():
    g = torch.Generator().manual_seed(4)
    local = [torch.randn(5, c, generator=g) for c in (3, 8)]
    glob = [torch.randn(5, c, generator=g) for c in (3, 8)]
    ref = [sum((float(a) - float(b)) ** 2 for a, b in zip(h.double().flatten(), t.double().flatten())) / h.numel()
           for h, t in zip(local, glob)]
    assert hint_losses(local, glob).tolist() == pytest.approx(ref, rel=1e-5)


# -- the modules, outside a run ---------------------------------------------------------------------------
def make(cls, **kwargs):
    model = cls(backbone=lambda c, i, s: SmallCNN(c, i, s, conv_padding=2), num_classes=10, in_channels=1,
                image_size=8, **kwargs)
    model.trainer = SimpleNamespace(optimizers=[])  # on_client_start resets the (absent) optimizers
    return model


def start_client(model, client_id=0):
    ctx = ClientContext(round_idx=0, client_id=client_id, num_samples=10, num_steps=1, seed=0,
                        global_state=snapshot(model.backbone))
    model.on_client_start(ctx)
    return ctx


def test_fedprox_is_zero_at_the_global_weights():
    from fedrcl.algorithms import FedProx

    model = make(FedProx, mu=0.5)
    start_client(model)
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    loss, parts = model.client_loss(x, y, model.backbone(x))
    assert parts["prox"].item() == 0.0 and loss.item() == parts["ce"].item()
    with torch.no_grad():
        model.backbone.fc.bias[0] += 0.1
    loss, parts = model.client_loss(x, y, model.backbone(x))
    assert parts["prox"].item() == pytest.approx(0.01, rel=1e-4)  # 0.1^2
    assert loss.item() == pytest.approx(parts["ce"].item() + 0.25 * 0.01, rel=1e-5)


@pytest.mark.parametrize("name", ["FedNTD", "FitNet"])
def test_teacher_is_built_once_and_stays_out_of_the_state(name):
    import fedrcl.algorithms as algorithms

    model = make(getattr(algorithms, name))
    keys_before, params_before = set(model.state_dict()), len(list(model.parameters()))
    start_client(model)
    teacher = model.teacher.module
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    _, parts = model.client_loss(x, y, model.backbone(x))
    term = parts["ntd"] if name == "FedNTD" else parts["hint"]
    assert term.item() == pytest.approx(0.0, abs=1e-7)  # the teacher holds the global = current weights
    with torch.no_grad():
        for p in model.backbone.parameters():
            p.add_(0.05)
    start_client(model, client_id=1)  # the next client: teacher overwritten in place with the new weights
    assert model.teacher.module is teacher and not teacher.training
    assert all(not p.requires_grad for p in teacher.parameters())
    torch.testing.assert_close(teacher(x).logits, model.backbone(x).logits)
    assert set(model.state_dict()) == keys_before and len(list(model.parameters())) == params_before
    assert not any("teacher" in k for k in model.state_dict())


# -- end to end -------------------------------------------------------------------------------------------
METHODS = {  # config stem: (class, {hyperparameter: paper value}, logged parts)
    "fedprox": ("FedProx", {"mu": 0.001}, ["ce", "prox"]),
    "fedlc": ("FedLC", {"tau": 1.0}, ["ce_calibrated", "ce"]),
    "feddecorr": ("FedDecorr", {"beta": 0.01}, ["ce", "decorr"]),
    "fedntd": ("FedNTD", {"beta": 0.3, "temperature": 1.0}, ["ce", "ntd"]),
    "fitnet": ("FitNet", {"hint_weight": 0.001}, ["ce", "hint", "hint_level0", "hint_level3"]),
}


@pytest.mark.parametrize("stem", METHODS)
def test_method_config_keeps_the_base_backbone(stem, capsys):
    cls, hparams, _ = METHODS[stem]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
              "--config", str(REPO / "configs" / "methods" / f"{stem}.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert model["class_path"] == f"fedrcl.algorithms.{cls}"
    assert model["init_args"]["backbone"] == {"class_path": "fedrcl.models.SmallCNN",
                                              "init_args": {"conv_padding": 2}}
    assert {k: model["init_args"][k] for k in hparams} == hparams


@pytest.mark.parametrize("stem", METHODS)
def test_method_trains_two_rounds(stem, data_root, tmp_path):
    cls, hparams, parts = METHODS[stem]
    cli = run_cli(data_root, tmp_path, "--config", str(REPO / "configs" / "methods" / f"{stem}.yaml"),
                  model=f"fedrcl.algorithms.{cls}")
    model, metrics = cli.model, cli.trainer.callback_metrics
    assert type(model).__name__ == cls and all(getattr(model, k) == v for k, v in hparams.items())
    assert cli.trainer.current_epoch == 2
    for name in ["train/loss", *(f"train/loss_{p}" for p in parts)]:
        assert name in metrics and torch.isfinite(metrics[name]), name
    assert 0.0 <= metrics["val/acc"].item() <= 1.0
    if stem == "fedlc":  # the last client's counts come from its own partition
        dm = cli.datamodule
        expected = torch.bincount(dm.y_train[dm.client_indices[model.client.client_id]], minlength=10)
        assert torch.equal(model.client.tensors["class_counts"], expected)


def test_teacher_method_resumes_from_its_checkpoint(data_root, tmp_path):
    """FedNTD's checkpoint holds only the global model; a resumed run rebuilds its teacher and matches."""
    extra = ("--config", str(REPO / "configs" / "methods" / "fedntd.yaml"))
    full = run_cli(data_root, tmp_path / "full", *extra, rounds=3, model="fedrcl.algorithms.FedNTD")
    run_cli(data_root, tmp_path / "split", *extra, rounds=2, model="fedrcl.algorithms.FedNTD")
    resumed = run_cli(data_root, tmp_path / "split", *extra, "--ckpt_path", "last", rounds=3,
                      model="fedrcl.algorithms.FedNTD")
    assert_same_state(full.model.state_dict(), resumed.model.state_dict())
