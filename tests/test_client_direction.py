"""The client-step hook (``FedAvg.client_direction``): a step that is not the gradient of the loss, written for one
client and mapped by every engine (clients one after another, batched clients, seeds together), with the engine's
lr, weight decay, momentum and clipping; and server state that changes when a round begins
(``begin_server_round``, ``extra_download``) giving seeds together each seed's own fit."""
from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from fedrcl import seeds
from test_together import args, last, relative_difference

FLOAT64 = ("--trainer.precision", "64-true")


def test_sam_direction_is_the_gradient_at_the_perturbed_point(monkeypatch):
    """``SharpnessAware.client_direction`` (torch.func inside) equals the plain autograd computation of SAM's step
    (float64): ``g = grad L(w)``, ``w' = w + rho g / ||g||``, direction ``grad L(w')``, loss ``L(w)``."""
    from types import SimpleNamespace

    import torch.nn.functional as F
    from step_methods import SharpnessAware

    from fedrcl.contract.context import ClientContext
    from fedrcl.models import SmallCNN
    from fedrcl.server import FedAvg as FedAvgServer

    torch.manual_seed(0)
    model = SharpnessAware(rho=0.3, backbone=lambda c, i, s: SmallCNN(c, i, s, conv_padding=2), num_classes=10,
                           in_channels=1, image_size=8).double()
    monkeypatch.setattr(SharpnessAware, "trainer", property(
        lambda self: SimpleNamespace(federation=SimpleNamespace(server=FedAvgServer()))))
    sent = {k: v.detach().clone() for k, v in model.backbone.state_dict().items()}
    model.client, model._params = ClientContext(0, 0, 10, 1, 0, sent), dict(model.backbone.named_parameters())
    x, y = torch.randn(12, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (12,))
    params = dict(model.backbone.named_parameters())
    direction, loss, parts = model.client_direction(params, x, y)

    names, weights = list(params), [p.detach().clone().requires_grad_() for p in params.values()]

    def ce_at(ws):
        out = torch.func.functional_call(model.backbone, dict(zip(names, ws)), (x,))
        return F.cross_entropy(out.logits, y)

    reference_loss = ce_at(weights)
    g = torch.autograd.grad(reference_loss, weights)
    norm = torch.sqrt(sum((t ** 2).sum() for t in g))
    perturbed = [(w + 0.3 * t / norm).detach().requires_grad_() for w, t in zip(weights, g)]
    g2 = torch.autograd.grad(ce_at(perturbed), perturbed)
    assert float(loss) == pytest.approx(float(reference_loss), rel=1e-12)
    assert float(parts["ce"]) == pytest.approx(float(reference_loss), rel=1e-12)
    for name, expected in zip(names, g2):
        torch.testing.assert_close(direction[name], expected, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(direction["fc.weight"], g[names.index("fc.weight")])  # SAM's step is not SGD's


def weights(cli) -> dict:
    return {k: v.detach().clone() for k, v in cli.model.backbone.state_dict().items()}


def test_hook_path_equals_the_loss_path(data_root, tmp_path):
    """A step through ``client_direction`` with the default direction equals the plain loss's step: clients one
    after another and batched, float64, momentum and clipping on (1e-12)."""
    common = (*FLOAT64, "--data.local_iters_per_epoch", "3", "--model.init_args.momentum", "0.5",
              "--model.init_args.grad_clip_norm", "0.5")
    plain = run_cli(data_root, tmp_path / "plain", *common, model="fedrcl.algorithms.FedAvg")
    plain.trainer.fit(plain.model, plain.datamodule)
    for batching in ("off", "on"):
        hook = run_cli(data_root, tmp_path / batching, *common, "--trainer.client_batching", batching,
                       model="step_methods.GradientThroughHook")
        hook.trainer.fit(hook.model, hook.datamodule)
        assert hook.trainer.global_step == plain.trainer.global_step
        assert relative_difference(weights(hook), weights(plain)) <= 1e-12, batching


def test_sam_step_agrees_on_every_engine(data_root, tmp_path, capsys):
    """The SAM-style step gives the same weights sequentially, batched and with seeds together (seed 0 beside seed
    1, no fallback), float64, within 1e-9; and differs from FedAvg's."""
    common = (*FLOAT64, "--data.local_iters_per_epoch", "3", "--model.init_args.rho", "0.1")
    sequential = run_cli(data_root, tmp_path / "seq", *common, model="step_methods.SharpnessAware")
    sequential.trainer.fit(sequential.model, sequential.datamodule)
    batched = run_cli(data_root, tmp_path / "batched", *common, "--trainer.client_batching", "on",
                      model="step_methods.SharpnessAware")
    batched.trainer.fit(batched.model, batched.datamodule)
    assert relative_difference(weights(batched), weights(sequential)) <= 1e-9
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path / "together", *FLOAT64,
                "--model.init_args.rho", "0.1", rounds=2, model="step_methods.SharpnessAware")])
    assert "--together:" not in capsys.readouterr().out  # trained together
    seeds.main(["--seeds", "0", *args(data_root, tmp_path / "alone", *FLOAT64, "--model.init_args.rho", "0.1",
                                      rounds=2, model="step_methods.SharpnessAware")])
    together, alone = last(tmp_path / "together", 0), last(tmp_path / "alone", 0)
    assert relative_difference(together["state_dict"], alone["state_dict"]) <= 1e-9
    sgd = run_cli(data_root, tmp_path / "sgd", *common[:-2], model="fedrcl.algorithms.FedAvg")
    sgd.trainer.fit(sgd.model, sgd.datamodule)
    assert relative_difference(weights(sgd), weights(sequential)) > 1e-6


def test_scaffold_trains_together_as_its_fit(data_root, tmp_path, capsys):
    """SCAFFOLD's lr sum comes from its context (no per-step hook), so its seeds train together (no fallback),
    each equal to its own fit (float64, 1e-9)."""
    from conftest import REPO

    scaffold = ("--config", str(REPO / "configs" / "methods" / "scaffold.yaml"), *FLOAT64)
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path / "together", rounds=3),
                *scaffold])
    out = capsys.readouterr().out
    assert "--together:" not in out, out
    seeds.main(["--seeds", "0", "1", *args(data_root, tmp_path / "alone", rounds=3), *scaffold])
    for seed in (0, 1):
        together, alone = last(tmp_path / "together", seed), last(tmp_path / "alone", seed)
        assert relative_difference(together["state_dict"], alone["state_dict"]) <= 1e-9, seed


@pytest.mark.parametrize("name,parts", [("DownloadMemory", False), ("BeginMemory", False),
                                        ("DownloadMemoryShared", True), ("BeginMemoryShared", True)])
def test_server_state_at_round_start_together_equals_fit(data_root, tmp_path, capsys, name, parts):
    """A server copy that changes state when a round begins (``begin_server_round``) or is configured
    (``extra_download``): seed 0 trained beside seed 1 ends with its own fit's weights (float64, 1e-9), whether the
    seeds stay together or part (from round 2, each going on alone in its own fit; when seeds together were a loop of
    their own, the checkpoint they went on from was written a round ahead, 0.16 apart)."""
    model = f"step_methods.{name}"
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path / "together", *FLOAT64, rounds=4,
                                                          model=model)])
    out = capsys.readouterr().out
    assert ("each seed goes on alone" in out) == parts, out
    seeds.main(["--seeds", "0", *args(data_root, tmp_path / "alone", *FLOAT64, rounds=4, model=model)])
    together, alone = last(tmp_path / "together", 0), last(tmp_path / "alone", 0)
    assert together["epoch"] == alone["epoch"] == 3
    assert relative_difference(together["state_dict"], alone["state_dict"]) <= 1e-9


def test_a_step_that_reads_its_seeds_downlink_parts_the_seeds(data_root, tmp_path, capsys):
    """A step direction that reads what its seed's downlink installed (not its loss, not its step state): the seeds'
    losses agree, their directions do not from round 2, so they part there; each seed, going on alone, ends with its
    own fit's weights (float64, 1e-9)."""
    model = "step_methods.DirectionMemoryShared"
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path / "together", *FLOAT64, rounds=3,
                                                          model=model)])
    out = capsys.readouterr().out
    assert "each seed goes on alone" in out and "another step direction" in out, out
    seeds.main(["--seeds", "0", "1", *args(data_root, tmp_path / "alone", *FLOAT64, rounds=3, model=model)])
    for seed in (0, 1):
        together, alone = last(tmp_path / "together", seed), last(tmp_path / "alone", seed)
        assert relative_difference(together["state_dict"], alone["state_dict"]) <= 1e-9, seed


HOOKS = ["start", "round_start 0", "round_end 0", "round_start 1", "round_end 1", "end"]


def test_a_user_callbacks_round_hooks_run_in_fit_and_together(data_root, tmp_path, capsys):
    """A user's Lightning callback sees every round start and end (and the run's start and end) in ``fedrcl fit``
    and in each seed of ``fedrcl seeds --together`` (each seed's own fit), with ``trainer.current_epoch`` the round's
    index."""
    hooks = ("--trainer.callbacks+=round_hooks.RoundHooks", "--trainer.callbacks.path")
    fit = run_cli(data_root, tmp_path / "fit", *hooks, str(tmp_path / "fit.txt"), rounds=2,
                  model="fedrcl.algorithms.FedAvg")
    fit.trainer.fit(fit.model, fit.datamodule)
    assert (tmp_path / "fit.txt").read_text().split("\n")[:-1] == HOOKS
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path / "together", rounds=2),
                "--trainer.callbacks", "[]", *hooks, str(tmp_path / "together.txt")])
    out = capsys.readouterr().out
    assert "--together:" not in out, out
    lines = (tmp_path / "together.txt").read_text().split("\n")[:-1]
    assert sorted(lines) == sorted(HOOKS * 2)  # each seed's own trainer, its rounds in order
    assert [line for line in lines if line.startswith("round")] == [h for h in HOOKS[1:-1] for _ in (0, 1)]


def test_a_user_callbacks_step_hooks_run_in_each_seed_together(data_root, tmp_path, capsys):
    """Seeds together are each seed's own fit: a user's per-step hook runs at every step of every seed's rounds,
    as in that seed's ``fedrcl fit`` with its clients batched (one Lightning step per stacked step)."""
    hooks = ("--trainer.callbacks+=round_hooks.StepHooks", "--trainer.callbacks.path")
    batched = ("--trainer.client_batching", "on")
    seeds.main(["--seeds", "0", *args(data_root, tmp_path / "fit", rounds=2), *batched, "--trainer.callbacks", "[]",
                *hooks, str(tmp_path / "fit.txt")])
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path / "together", rounds=2),
                "--trainer.callbacks", "[]", *hooks, str(tmp_path / "together.txt")])
    assert "--together:" not in capsys.readouterr().out
    alone = (tmp_path / "fit.txt").read_text().split("\n")[:-1]
    assert alone == [f"step {r} {b}" for r in range(2) for b in range(6)]  # 2 local epochs of 3 stacked steps
    assert sorted((tmp_path / "together.txt").read_text().split("\n")[:-1]) == sorted(alone * 2)


def test_a_callbacks_step_hooks_are_named_as_not_run():
    """``not_run`` (Flower's server, whose fit loop takes one step per round) names each user callback's per-step
    hooks, not its round hooks, and every ``RoundCallback``'s ``on_client_end`` (fedrcl's analysis callbacks, a
    user's): the clients' local models are on the nodes."""
    from types import SimpleNamespace

    import lightning as L
    from round_hooks import RoundHooks

    from fedrcl.analysis import RepresentationMonitor
    from fedrcl.federated.federation import RoundCallback
    from fedrcl.flower.server import not_run

    class PerStep(L.Callback):
        def on_train_batch_end(self, *args):
            pass

    class PerClient(RoundCallback):
        def on_client_end(self, *args):
            pass

    callbacks = [RoundHooks("x"), PerStep(), RepresentationMonitor(every_n_rounds=1), PerClient()]
    trainer = SimpleNamespace(callbacks=callbacks)
    assert not_run(trainer) == ["RepresentationMonitor.on_client_end", "PerClient.on_client_end",
                                "PerStep.on_train_batch_end"]


def test_the_quickstart_as_shipped_trains_batched_and_together(data_root, tmp_path, capsys, caplog):
    """``configs/quickstart.yaml`` as shipped (``data.local_iters_per_epoch`` null: its balanced split gives every
    client 71 samples, 3 steps of 24, 24 and 23 images an epoch) trains batched and together, no fallback, equal to
    its clients one after another (float64, 2 rounds, 1e-9)."""
    from conftest import REPO

    shipped = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--data.root", str(data_root),
               "--trainer.rounds", "2", "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false",
               "--trainer.enable_model_summary", "false", *FLOAT64]
    from fedrcl.lightning_cli import build_cli

    def fit(folder, *extra):
        cli = build_cli(["fit", *shipped, "--trainer.logger.init_args.save_dir", str(tmp_path / folder), *extra])
        cli.trainer.fit(cli.model, cli.datamodule)
        return weights(cli)

    sequential = fit("seq", "--trainer.client_batching", "off")
    assert relative_difference(fit("batched", "--trainer.client_batching", "on"), sequential) <= 1e-9
    assert "clients trained one after another" not in caplog.text  # batched, every round
    seeds.main(["--seeds", "0", "1", "--together", *shipped, "--trainer.logger.init_args.save_dir",
                str(tmp_path / "together")])
    assert "--together:" not in capsys.readouterr().out  # trained together
    together = last(tmp_path / "together", 0)["state_dict"]
    assert relative_difference({k.removeprefix("backbone."): v for k, v in together.items()}, sequential) <= 1e-9
