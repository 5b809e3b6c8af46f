"""Batched clients (``trainer.client_batching``): the same training as clients one after another."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import run_cli
from fedrcl.federated.batched import ClientBatching, stack_clients

RESNET8 = ("--model.init_args.backbone", "fedrcl.models.ResNet18",
           "--model.init_args.backbone.init_args.width", "8")


def train_logs(log_dir: Path) -> dict[str, list[float]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    tags = [tag for tag in acc.Tags()["scalars"] if tag.startswith("train/")]
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in tags}


def fit(data_root, save_dir, mode, model, *extra, precision="64-true"):
    """Two rounds of 3 clients x 3 steps; in float64, where rounding (which the clients' vmapped kernels do in
    another order) stays far below the tolerance."""
    cli = run_cli(data_root, save_dir, "--trainer.client_batching", mode, "--trainer.precision", precision,
                  "--data.local_iters_per_epoch", "3", *extra, rounds=2, model=model)
    weights = {k: v.detach().clone() for k, v in cli.model.backbone.state_dict().items()}
    return weights, train_logs(Path(cli.trainer.logger.log_dir)), cli


def assert_equal_runs(a, b, rtol=1e-5):
    (wa, la, _), (wb, lb, _) = a, b
    assert wa.keys() == wb.keys()
    for key, value in wa.items():
        torch.testing.assert_close(wb[key], value, rtol=rtol, atol=rtol / 100, msg=key)
    assert la.keys() == lb.keys() and "train/loss" in la
    for tag, values in la.items():
        assert len(values) == 2, tag
        assert lb[tag] == pytest.approx(values, rel=rtol, abs=rtol / 100), tag


@pytest.mark.parametrize("model", [f"fedrcl.algorithms.{name}" for name in ("FedAvg", "FedRCL", "FedNTD")])
@pytest.mark.parametrize("backbone", ["cnn", "resnet8"])
def test_batched_clients_equal_sequential(data_root, tmp_path, model, backbone):
    extra = RESNET8 if backbone == "resnet8" else ()
    seq = fit(data_root, tmp_path / "seq", "off", model, *extra)
    bat = fit(data_root, tmp_path / "bat", "on", model, *extra)
    assert bat[2].trainer.federation.plan(1).batched and not seq[2].trainer.federation.plan(1).batched
    assert_equal_runs(seq, bat)


OTHERS = {
    "FedSCL": (), "FedProx": (), "FedLC": (), "FedDecorr": (), "FitNet": (), "FedMLB": (), "FedProc": (),
    "FedCL": ("--data.views", "2"),
    "FedRCL+FedACG": ("--trainer.server", "fedrcl.server.FedACG"),
}


@pytest.mark.parametrize("name", list(OTHERS))
def test_every_batch_method_equals_sequential(data_root, tmp_path, name):
    model = f"fedrcl.algorithms.{name.split('+')[0]}"
    # Every method in float64, FedProc included: its client report's forward pass reads client.data, which
    # serves the run's precision.
    seq = fit(data_root, tmp_path / "seq", "off", model, *OTHERS[name])
    bat = fit(data_root, tmp_path / "bat", "on", model, *OTHERS[name])
    assert bat[2].trainer.global_step == seq[2].trainer.global_step == 2 * 3 * 3  # client steps on both backends
    assert_equal_runs(seq, bat)


def test_moon_falls_back_with_a_notice(data_root, tmp_path, caplog):
    """A method with per-client models trains one after another, said once (unequal clients train batched under
    the step mask: tests/test_step_mask.py)."""
    with caplog.at_level("INFO"):
        _, _, cli = fit(data_root, tmp_path / "moon", "on", "fedrcl.algorithms.MOON")
        assert not cli.trainer.federation.plan(1).batched
    notices = [r.getMessage() for r in caplog.records if "client_batching" in r.getMessage()]
    assert any("MOON keeps a previous local model" in m for m in notices)


def test_auto_is_sequential_on_cpu_and_bad_mode_is_an_error(data_root, tmp_path):
    cli = run_cli(data_root, tmp_path, "--data.local_iters_per_epoch", "2", rounds=1,
                  model="fedrcl.algorithms.FedAvg")
    assert cli.trainer.federation.batching.mode == "auto" and not cli.trainer.federation.plan(0).batched
    with pytest.raises(ValueError, match="client_batching"):
        ClientBatching("always")


def test_16_mixed_trains_one_client_after_another_with_a_notice(caplog):
    """The stacked engine has no loss scale: under 16-mixed (CUDA only, so the decision is tested without a run)
    clients fall back, said once; bf16-mixed and 32-true stay batched."""
    from fedrcl.algorithms import FedAvg
    from fedrcl.models import SmallCNN

    module, cuda = FedAvg(backbone=SmallCNN), torch.device("cuda")
    batching = ClientBatching("on")
    assert batching.applies(module, cuda, "bf16-mixed") and batching.applies(module, cuda, "32-true")
    with caplog.at_level("INFO"):
        assert not batching.applies(module, cuda, "16-mixed") and not batching.applies(module, cuda, "16-mixed")
    notices = [r.getMessage() for r in caplog.records if "16-mixed" in r.getMessage()]
    assert len(notices) == 1 and "no loss scale" in notices[0]
    assert not ClientBatching("auto").applies(module, cuda, "16-mixed")


def test_per_client_clip_matches_torch_clip():
    from fedrcl.federated.client_step import clipped

    gen = torch.Generator().manual_seed(0)
    grads = {"w": torch.randn(3, 4, 5, generator=gen) * 3, "b": torch.randn(3, 7, generator=gen)}
    grads["w"][1] *= 0.01  # client 1 below the threshold: left unchanged
    grads["b"][1] *= 0.01
    out = clipped(grads, 5.0)
    for k in range(3):
        params = [torch.zeros_like(g[k], requires_grad=True) for g in grads.values()]
        for p, g in zip(params, grads.values()):
            p.grad = g[k].clone()
        torch.nn.utils.clip_grad_norm_(params, 5.0)
        for name, p in zip(grads, params):
            torch.testing.assert_close(out[name][k], p.grad)
    client0 = torch.cat([g[0].flatten() for g in out.values()])
    assert torch.linalg.vector_norm(client0) == pytest.approx(5.0, rel=1e-5)
    assert torch.equal(out["w"][1], grads["w"][1])


def test_stack_clients_keeps_each_slice_in_the_memory_format():
    w = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)
    stacked = stack_clients(w, 2)
    assert stacked.shape == (2, 4, 3, 5, 5) and torch.equal(stacked[1], w)
    assert stacked[0].is_contiguous(memory_format=torch.channels_last)
    assert stack_clients(torch.randn(3), 2).is_contiguous()


def test_batched_step_runs_under_lightning_autocast(data_root, tmp_path, monkeypatch):
    from fedrcl.algorithms import FedAvg

    dtypes = []
    original = FedAvg.client_loss
    monkeypatch.setattr(FedAvg, "client_loss", lambda self, x, y, out: dtypes.append(out.logits.dtype)
                        or original(self, x, y, out))
    runs = {mode: run_cli(data_root, tmp_path / mode, "--trainer.client_batching", mode, "--trainer.precision",
                          "bf16-mixed", "--data.local_iters_per_epoch", "2", rounds=1,
                          model="fedrcl.algorithms.FedAvg")
            for mode in ("on", "off")}
    assert runs["on"].trainer.federation.plan(0).batched
    assert dtypes and set(dtypes) == {torch.bfloat16}  # autocast's dtype in both paths
    losses = {mode: train_logs(Path(cli.trainer.logger.log_dir))["train/loss"] for mode, cli in runs.items()}
    assert losses["on"] == pytest.approx(losses["off"], rel=2e-2)  # bf16 rounding apart


def test_compiled_stacked_step_equals_eager(monkeypatch):
    """torch.compile traces the whole stacked step (forward, the mapped local loss, backward, clip, SGD; here with
    the cheap aot_eager backend, SmallCNN): the same new weights, losses and loss parts as the eager step."""
    from types import SimpleNamespace

    from fedrcl.algorithms import FedAvg
    from fedrcl.contract.context import ClientContext
    from fedrcl.federated import batched
    from fedrcl.federated.client_step import ClientStep, StepInputs
    from fedrcl.models import SmallCNN
    from fedrcl.server import FedAvg as FedAvgServer

    torch.manual_seed(0)
    model = FedAvg(backbone=lambda c, i, s: SmallCNN(c, i, s, conv_padding=2), num_classes=10, in_channels=1,
                   image_size=8, momentum=0.5)
    monkeypatch.setattr(FedAvg, "trainer", property(
        lambda self: SimpleNamespace(federation=SimpleNamespace(server=FedAvgServer()))))
    sent = {k: v.detach().clone() for k, v in model.backbone.state_dict().items()}
    model.client, model._params = ClientContext(0, 0, 10, 1, 0, sent), dict(model.backbone.named_parameters())
    x, y = torch.randn(3, 8, 1, 8, 8), torch.randint(0, 10, (3, 8))
    facts = {name: torch.arange(3) for name in batched.CLIENT_FACTS}
    inputs = StepInputs(x, y, torch.full((3,), 0.1), {}, facts, {k: v.unsqueeze(0) for k, v in sent.items()})

    def step(compile):
        params = {n: stack_clients(p.detach(), 3) for n, p in model.backbone.named_parameters()}
        momenta = {n: torch.zeros_like(p) for n, p in params.items()}
        return ClientStep(model, 1, 3, compile=compile)(params, momenta, inputs)

    eager, compiled = step(None), step({"backend": "aot_eager"})
    for a, b in zip(compiled[:2], eager[:2]):
        for name in a:
            torch.testing.assert_close(a[name], b[name], msg=name)
    torch.testing.assert_close(compiled[2], eager[2])
    torch.testing.assert_close(compiled[3]["ce"], eager[3]["ce"])
    assert model._params["fc.weight"] is model.backbone.fc.weight  # the mapped call put it back


def test_compiled_batched_loss_is_one_graph_over_rounds(data_root, tmp_path, monkeypatch):
    """The stacked step with each client's own facts (``self.client`` rebuilt per slice) compiles to one graph
    (forward, loss, backward, clip, SGD): no graph break, no recompile over 3 rounds (FedRCL, aot_eager on the
    CPU)."""
    from torch._dynamo.utils import counters

    from fedrcl.federated import batched

    monkeypatch.setattr(batched, "COMPILE_BACKEND", "aot_eager")
    counters.clear()
    run_cli(data_root, tmp_path, "--trainer.client_batching", "on", "--trainer.compile_clients", "true",
            "--data.local_iters_per_epoch", "3", rounds=3, model="fedrcl.algorithms.FedRCL")
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
