"""SCAFFOLD and FedDyn: each update pinned to its rule, their fixed points on quadratic clients, and
end-to-end runs (the rules inside a real round, bytes, batched clients, resume, learning)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_same_state, run_cli
from fedrcl.algorithms import FedDyn, SCAFFOLD
from fedrcl.losses.control_variate import control_variate_delta, linear_term
from fedrcl.losses.dynamic_regularizer import dual_update, dynamic_regularizer
from fedrcl.server import FedDyn as FedDynServer
from fedrcl.server import SCAFFOLD as ScaffoldServer

METHOD = {"scaffold": ("fedrcl.algorithms.SCAFFOLD", str(REPO / "configs" / "methods" / "scaffold.yaml")),
          "feddyn": ("fedrcl.algorithms.FedDyn", str(REPO / "configs" / "methods" / "feddyn.yaml"))}


# -- the pure rules, by hand ---------------------------------------------------------------------------------
def test_linear_term_and_its_gradient():
    w = [torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([[3.0]], requires_grad=True)]
    value = linear_term(w, torch.tensor([0.5, -1.0, 2.0]))
    assert value.item() == pytest.approx(0.5 - 2.0 + 6.0)
    value.backward()
    assert w[0].grad.tolist() == [0.5, -1.0] and w[1].grad.tolist() == [[2.0]]  # the correction itself
    with pytest.raises(ValueError, match="3 entries"):
        linear_term([torch.zeros(2)], torch.zeros(3))


def test_control_variate_delta_option_two():
    # (x - y) / sum eta - c = ([1, 2] - [0.5, 3]) / 0.5 - [0.1, -0.2]
    delta = control_variate_delta(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0]), 0.5,
                                  torch.tensor([0.1, -0.2]))
    torch.testing.assert_close(delta, torch.tensor([0.9, -1.8]))
    with pytest.raises(ValueError, match="lr_sum"):
        control_variate_delta(torch.zeros(1), torch.zeros(1), 0.0, torch.zeros(1))


def test_dynamic_regularizer_and_dual_update():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    value = dynamic_regularizer([w], torch.tensor([0.5, 1.0]), [torch.tensor([0.0, 1.0])], alpha=0.2)
    assert value.item() == pytest.approx(-(0.5 + 2.0) + 0.1 * (1 + 1))
    value.backward()
    torch.testing.assert_close(w.grad, torch.tensor([-0.5 + 0.2, -1.0 + 0.2]))  # -g + alpha (theta - anchor)
    g = dual_update(torch.tensor([0.5, 1.0]), torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0]), alpha=0.2)
    torch.testing.assert_close(g, torch.tensor([0.3, 0.8]))


def test_bad_hyperparameters_name_their_key():
    with pytest.raises(ValueError, match="trainer.server.init_args.global_lr must be > 0"):
        ScaffoldServer(global_lr=0)
    with pytest.raises(ValueError, match="trainer.server.init_args.alpha must be > 0"):
        FedDynServer(alpha=-0.1)


def test_scaffold_server_step():
    server = ScaffoldServer(global_lr=0.5)
    x = {"w": torch.tensor([1.0]), "count": torch.tensor(7)}
    assert server.control({"w": x["w"]})["w"].item() == 0  # c starts at 0
    server.receive({"w": torch.tensor([2.0])}, num_samples=1, total_samples=8)
    server.receive({"w": torch.tensor([-1.0])}, num_samples=3, total_samples=8)
    new = server.step(x, x, {"w": torch.tensor([3.0])})
    assert new["w"].item() == 2.0 and new["count"].item() == 7  # x + 0.5 (3 - 1); integer entry kept
    assert server.control(x)["w"].item() == (1 * 2.0 + 3 * -1.0) / 8  # c + sum n_i/n_all delta c_i
    assert server.extra_broadcast(None)["w"].item() == -0.125
    restored = ScaffoldServer(global_lr=0.5)
    restored.load_state_dict(server.state_dict())
    assert restored.control(x)["w"].item() == -0.125
    with pytest.raises(RuntimeError, match="no client reported"):
        server.step(x, x, {"w": torch.tensor([3.0])})


def test_feddyn_server_step():
    server = FedDynServer(alpha=0.5)
    x = {"w": torch.tensor([1.0])}
    for n in (1, 3):  # the sampled clients hold half of the 8 samples: f = 1/2
        server.receive(n, 8)
    new = server.step(x, x, {"w": torch.tensor([2.0])})
    # h = 0 - 0.5 * 1/2 * (2 - 1) = -0.25; theta = 2 - h / 0.5 = 2.5
    assert server.memory["h"]["w"].item() == -0.25 and new["w"].item() == 2.5
    for n in (1, 3):
        server.receive(n, 8)
    new = server.step(new, new, {"w": torch.tensor([3.0])})
    assert server.memory["h"]["w"].item() == -0.375 and new["w"].item() == 3.75


# -- fixed points on quadratic clients -------------------------------------------------------------------------
# Client i: f_i(theta) = 1/2 sum_d a_id (theta_d - b_id)^2, weight n_i. The optimum of sum_i n_i f_i is
# theta*_d = sum_i n_i a_id b_id / sum_i n_i a_id; FedAvg with many local steps drifts to another point.
A = torch.tensor([[1.0, 4.0], [3.0, 0.5], [0.5, 2.0]], dtype=torch.float64)
B = torch.tensor([[1.0, -2.0], [-1.0, 3.0], [4.0, 0.0]], dtype=torch.float64)
N = [1, 2, 5]
OPTIMUM = (torch.tensor(N, dtype=torch.float64)[:, None] * A * B).sum(0) / \
          (torch.tensor(N, dtype=torch.float64)[:, None] * A).sum(0)


def quadratic(i: int, theta):
    return 0.5 * (A[i] * (theta - B[i]) ** 2).sum()


def local_sgd(i: int, start, steps: int, lr: float, extra):
    theta = start.clone().requires_grad_()
    for _ in range(steps):
        (grad,) = torch.autograd.grad(quadratic(i, theta) + extra(theta), theta)
        theta = (theta - lr * grad).detach().requires_grad_()
    return theta.detach()


def weighted_mean(thetas):
    return sum(n * t for n, t in zip(N, thetas)) / sum(N)


def fedavg_limit(steps: int, lr: float, rounds: int = 20):
    x = torch.zeros(2, dtype=torch.float64)
    for _ in range(rounds):
        x = weighted_mean([local_sgd(i, x, steps, lr, lambda t: 0) for i in range(3)])
    return x


def test_scaffold_converges_to_the_optimum_where_fedavg_drifts():
    steps, lr = 10, 0.1
    server, x = ScaffoldServer(), torch.zeros(2, dtype=torch.float64)
    own = [torch.zeros(2, dtype=torch.float64) for _ in range(3)]
    for _ in range(60):
        c = server.control({"w": x})["w"].clone()
        ends = []
        for i in range(3):
            end = local_sgd(i, x, steps, lr, lambda t, i=i: linear_term([t], c - own[i]))
            delta = control_variate_delta(x, end, steps * lr, c)
            own[i] = own[i] + delta
            server.receive({"w": delta}, N[i], sum(N))
            ends.append(end)
        x = server.step({"w": x}, {"w": x}, {"w": weighted_mean(ends)})["w"]
    torch.testing.assert_close(x, OPTIMUM, rtol=0, atol=1e-8)
    # c is the weighted mean of the c_i (each the client's gradient at the optimum, summing to 0)
    torch.testing.assert_close(server.control({"w": x})["w"], weighted_mean(own), rtol=0, atol=1e-10)
    assert (fedavg_limit(steps, lr) - OPTIMUM).abs().max() > 0.1


def test_feddyn_converges_to_the_optimum_where_fedavg_drifts():
    # Inexact local solves (10 steps) keep the fixed point: there theta_i = theta and grad f_i(theta) = g_i.
    alpha, steps, lr = 1.0, 10, 0.2
    server, theta = FedDynServer(alpha=alpha), torch.zeros(2, dtype=torch.float64)
    dual = [torch.zeros(2, dtype=torch.float64) for _ in range(3)]
    for _ in range(60):
        ends = []
        for i in range(3):
            end = local_sgd(i, theta, steps, lr, lambda t, i=i: dynamic_regularizer([t], dual[i], [theta], alpha))
            dual[i] = dual_update(dual[i], end, theta, alpha)
            server.receive(N[i], sum(N))
            ends.append(end)
        theta = server.step({"w": theta}, {"w": theta}, {"w": weighted_mean(ends)})["w"]
    torch.testing.assert_close(theta, OPTIMUM, rtol=0, atol=1e-6)
    torch.testing.assert_close(server.memory["h"]["w"], weighted_mean(dual), rtol=0, atol=1e-10)  # h = mean g_i
    assert (fedavg_limit(steps, lr) - OPTIMUM).abs().max() > 0.1


# -- inside a real round -----------------------------------------------------------------------------------
@pytest.fixture
def clients_seen(monkeypatch):
    """Each client's received and final weights, captured around the algorithm's ``on_client_end``."""
    seen = {}

    def capture(cls):
        original = cls.on_client_end

        def on_client_end(self, client):
            params = {n: p.detach().clone() for n, p in self.backbone.named_parameters()}
            seen[client.client_id] = (client, {n: client.global_state[n].clone() for n in params}, params)
            original(self, client)
        monkeypatch.setattr(cls, "on_client_end", on_client_end)

    capture(SCAFFOLD)
    capture(FedDyn)
    return seen


def fit(data_root, save_dir, method, *extra, rounds=1):
    model, overlay = METHOD[method]
    return run_cli(data_root, save_dir, "--config", overlay, *extra, rounds=rounds, model=model)


def test_scaffold_round_follows_the_rule_and_counts_twice_the_bytes(data_root, tmp_path, clients_seen):
    """Round 1 (c = c_i = 0): c_i+ = (x - y_i) / sum of the steps' lrs (two local epochs, the second at half
    the lr); c = sum n_i / n_all c_i+; weights and control variates both ways."""
    cli = fit(data_root, tmp_path, "scaffold", "--trainer.local_epochs", "2", "--model.init_args.local_lr_decay",
              "0.5")
    model, server, dm = cli.model, cli.trainer.federation.server, cli.datamodule
    n_all = sum(dm.client_num_samples(k) for k in range(dm.num_clients))
    expected_c = None
    for client_id, (client, start, end) in clients_seen.items():
        lr_sum = client.num_steps / 2 * (model.client_lr(0, 0) + model.client_lr(0, 1))
        assert model.client_lr(0, 1) == 0.5 * model.client_lr(0, 0)
        stored = model.store.get(client_id)
        for n in end:
            torch.testing.assert_close(stored[n], (start[n] - end[n]) / lr_sum, rtol=1e-5, atol=1e-7)
        part = {n: client.num_samples / n_all * stored[n] for n in stored}
        expected_c = part if expected_c is None else {n: expected_c[n] + part[n] for n in part}
    assert len(clients_seen) == 3
    for n, value in expected_c.items():
        torch.testing.assert_close(server.control(expected_c)[n], value, rtol=1e-5, atol=1e-8)
    model_bytes = sum(p.numel() * p.element_size() for p in model.backbone.state_dict().values())
    assert model_bytes == sum(p.numel() * p.element_size() for p in model.backbone.parameters())  # no buffers
    assert cli.trainer.federation.ledger.cumulative == {"down": 3 * 2 * model_bytes, "up": 3 * 2 * model_bytes}


def test_feddyn_round_follows_the_rule(data_root, tmp_path, clients_seen):
    """Round 1 (g_i = h = 0): g_i = -alpha (theta_i - x); h = -alpha f (mean - x); theta = mean - h / alpha."""
    cli = fit(data_root, tmp_path, "feddyn", "--trainer.server.init_args.alpha", "0.1")
    model, server, dm = cli.model, cli.trainer.federation.server, cli.datamodule
    n_all = sum(dm.client_num_samples(k) for k in range(dm.num_clients))
    n_round = sum(client.num_samples for client, _, _ in clients_seen.values())
    x = next(iter(clients_seen.values()))[1]
    mean = {n: sum(c.num_samples * end[n] for c, _, end in clients_seen.values()) / n_round for n in x}
    for client_id, (client, start, end) in clients_seen.items():
        stored = model.store.get(client_id)
        for n in end:
            torch.testing.assert_close(stored[n], -0.1 * (end[n] - start[n]), rtol=1e-5, atol=1e-8)
    weights = model.backbone.state_dict()
    for n in x:
        h = -0.1 * n_round / n_all * (mean[n] - x[n])
        torch.testing.assert_close(server.memory["h"][n], h, rtol=1e-4, atol=1e-8)
        torch.testing.assert_close(weights[n], mean[n] - h / 0.1, rtol=1e-4, atol=1e-6)
    model_bytes = sum(p.numel() * p.element_size() for p in model.backbone.parameters())
    assert cli.trainer.federation.ledger.cumulative == {"down": 3 * model_bytes, "up": 3 * model_bytes}


@pytest.mark.parametrize("method", ["scaffold", "feddyn"])
def test_batched_clients_equal_sequential(data_root, tmp_path, method):
    runs = {}
    for mode in ("off", "on"):
        cli = fit(data_root, tmp_path / mode, method, "--trainer.client_batching", mode, "--trainer.precision",
                  "64-true", "--data.local_iters_per_epoch", "3", rounds=2)
        assert cli.trainer.federation.plan(1).batched == (mode == "on")
        runs[mode] = cli
    for n, value in runs["off"].model.backbone.state_dict().items():
        torch.testing.assert_close(runs["on"].model.backbone.state_dict()[n], value, rtol=1e-5, atol=1e-7)
    assert runs["on"].trainer.federation.ledger.cumulative == runs["off"].trainer.federation.ledger.cumulative
    a, b = (runs[m].trainer.federation.server.state_dict() for m in ("off", "on"))
    for name, memory in a.items():
        for n, value in memory.items():
            torch.testing.assert_close(b[name][n], value, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("method", ["scaffold", "feddyn"])
def test_resume_is_exact(data_root, tmp_path, method):
    """Killed (SIGKILL) while writing round 3's checkpoint and resumed with ``--ckpt_path last`` from round 2's:
    round 3 equals a run that never stopped (model, server memory, every client's state), bitwise on the CPU."""
    from test_reliability import fit_process

    every = ("--trainer.checkpoint_every", "1")
    model, overlay = METHOD[method]
    killed = fit_process(data_root, tmp_path / "cut", "--config", overlay, *every, rounds=3, model=model,
                         fault="kill:last.ckpt:2")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = fit(data_root, tmp_path / "cut", method, *every, "--ckpt_path", "last", rounds=3)
    assert Path(resumed.trainer.ckpt_path).name == "round0001.ckpt"  # round 2, the newest complete one
    full = fit(data_root, tmp_path / "full", method, *every, rounds=3)
    assert resumed.trainer.current_epoch == full.trainer.current_epoch == 3
    assert_same_state(full.model.state_dict(), resumed.model.state_dict())
    a, b = full.trainer.federation.server.state_dict(), resumed.trainer.federation.server.state_dict()
    assert a.keys() == b.keys() and a
    for name in a:
        assert_same_state(a[name], b[name])
    assert sorted(full.model.store._files) == sorted(resumed.model.store._files)
    for client_id in full.model.store._files:
        assert_same_state(full.model.store.get(client_id), resumed.model.store.get(client_id))


def test_each_method_needs_its_server_half(data_root, tmp_path):
    with pytest.raises(ValueError, match="needs trainer.server fedrcl.server.SCAFFOLD"):
        run_cli(data_root, tmp_path, rounds=1, model="fedrcl.algorithms.SCAFFOLD")
    with pytest.raises(ValueError, match="needs trainer.server fedrcl.server.FedDyn"):
        fit(data_root, tmp_path, "feddyn", "--trainer.server", "fedrcl.server.SCAFFOLD")


@pytest.mark.parametrize("method", ["scaffold", "feddyn"])
def test_a_short_run_learns(data_root, tmp_path, method):
    """Ten rounds on the quickstart digits (10 classes): well above chance (FedAvg here: 26%)."""
    cli = fit(data_root, tmp_path, method, "--trainer.local_epochs", "2", rounds=10)
    assert cli.trainer.callback_metrics["val/acc"].item() > 0.25


def test_a_checkpoint_validates_without_the_server_half(data_root, tmp_path):
    cli = fit(data_root, tmp_path / "fit", "scaffold")
    ckpt = Path(cli.trainer.logger.log_dir) / "checkpoints" / "last.ckpt"
    validated = run_cli(data_root, tmp_path / "validate", "--ckpt_path", str(ckpt), subcommand="validate",
                        model="fedrcl.algorithms.SCAFFOLD")
    assert validated.trainer.callback_metrics["val/acc"].item() == pytest.approx(
        cli.trainer.callback_metrics["val/acc"].item())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["scaffold", "feddyn"])
def test_two_processes_give_one_process_results(data_root, tmp_path, method):
    """Five clients per round over two processes (a client of round 1 or 2 trains on the other process in
    round 3, reading the state file the first wrote): the one-process weights and server memory, bitwise."""
    from test_multiprocess import FIVE_CLIENTS, fit_two_processes, last_run

    model, overlay = METHOD[method]
    one = run_cli(data_root, tmp_path / "one", *FIVE_CLIENTS, "--config", overlay, rounds=3, model=model)
    fit_two_processes(data_root, tmp_path / "two", "--config", overlay, rounds=3, model=model)
    ckpt, _ = last_run(tmp_path / "two")
    assert_same_state(one.model.state_dict(), ckpt["state_dict"])
    saved = next(v for k, v in ckpt["callbacks"].items() if "Federation" in k)["server"]
    memory = one.trainer.federation.server.state_dict()
    assert memory.keys() == saved.keys() and memory
    for name, buffers in memory.items():
        assert_same_state(buffers, saved[name])
