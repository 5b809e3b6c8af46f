"""The 2026 baselines (issue 52): each rule pinned by hand and at random, and one round of ``fedrcl fit`` (float64,
three clients) replayed by a reference written from the paper's algorithm in plain loops, to 1e-9 relative."""
from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from conftest import REPO, run_cli
from fedrcl.algorithms import FedRCL, FedSAM
from fedrcl.losses.client_momentum import global_update_direction, momentum_direction
from fedrcl.losses.normalized_averaging import effective_mean, normalized_model, update_norm
from fedrcl.losses.sharpness import asam_scale, sam_perturbation
from fedrcl.server import FedAdam, FedAvg, FedAvgM, SCAFFOLD
from fedrcl.server import FedACG, FedNova as FedNovaServer

CONFIGS = REPO / "configs" / "methods"
FLOAT64 = ("--trainer.precision", "64-true", "--trainer.client_batching", "off")


# -- FedNova's rules ----------------------------------------------------------------------------------------
def test_update_norm_by_hand_and_in_the_papers_closed_forms():
    assert update_norm([0.1, 0.1, 0.05]) == pytest.approx(0.25)  # SGD: the sum of the step lrs
    # momentum 0.5, lr 1: B = 1, 1.5, 1.75 -> D = 4.25
    assert update_norm([1.0, 1.0, 1.0], momentum=0.5) == pytest.approx(4.25)
    # proximal mu 0.5, lr 1: B = 1, 0.5, 0.25 (D = 1, 1.5, 1.75)
    assert update_norm([1.0, 1.0, 1.0], mu=0.5) == pytest.approx(1.75)
    eta, tau = 0.05, 17
    for rho in (0.0, 0.5, 0.9):  # the paper's ||a_i||_1 of local momentum SGD, times eta
        paper = (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)
        assert update_norm([eta] * tau, momentum=rho) == pytest.approx(eta * paper, rel=1e-12)
    mu = 0.3  # of the proximal solver: a_i = [(1 - eta mu)^(tau - 1), ..., 1]
    assert update_norm([eta] * tau, mu=mu) == pytest.approx(eta * (1 - (1 - eta * mu) ** tau) / (eta * mu),
                                                             rel=1e-12)
    with pytest.raises(ValueError, match="at least one local step"):
        update_norm([])


def test_update_norm_is_the_coefficient_sum_of_momentum_proximal_sgd():
    """Random lrs, momentum and mu: run torch.optim.SGD (momentum) on the linear-plus-proximal objective
    <g_k, w> + mu/2 ||w - x||^2 with a fresh random g_k per step; x - y is then linear in the g_k, and the
    coefficients found by least squares over many draws sum to update_norm."""
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for _ in range(3):
        steps, rho, mu = rng.randint(2, 6), rng.uniform(0, 0.9), rng.uniform(0, 0.5)
        lrs = [rng.uniform(0.05, 0.3) for _ in range(steps)]
        draws, dim = 40, 3
        g = torch.randn(draws, steps, dim, dtype=torch.float64, generator=gen)
        deltas = []
        for n in range(draws):
            w = torch.zeros(dim, dtype=torch.float64, requires_grad=True)
            opt = torch.optim.SGD([w], lr=lrs[0], momentum=rho)
            for k in range(steps):
                opt.param_groups[0]["lr"] = lrs[k]
                opt.zero_grad()
                ((g[n, k] * w).sum() + mu / 2 * w.pow(2).sum()).backward()
                opt.step()
            deltas.append(-w.detach())
        # delta[n, d] = sum_k a_k g[n, k, d]: solve for a
        a = torch.linalg.lstsq(g.permute(0, 2, 1).reshape(-1, steps), torch.stack(deltas).reshape(-1)).solution
        assert a.sum().item() == pytest.approx(update_norm(lrs, rho, mu), rel=1e-10)


def test_normalized_model_and_effective_mean_by_hand():
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0])
    torch.testing.assert_close(normalized_model(x, y, 4.0), torch.tensor([0.75, 2.5]))  # x - (x - y) / 4
    torch.testing.assert_close(effective_mean(x, torch.tensor([0.75, 2.5]), 2.0), torch.tensor([0.5, 3.0]))
    with pytest.raises(ValueError, match="norm must be > 0"):
        normalized_model(x, y, 0.0)


def test_fednova_server_step_by_hand():
    """Two clients, n = 1 and 3 of 8 samples: tau_eff = (1 * 0.2 + 3 * 0.6) / 4 = 0.5; the mean of the normalised
    models 3 -> x_eff = 1 + 0.5 (3 - 1) = 2; FedAvgM (beta 0.5) steps from there and keeps its momentum."""
    x = {"w": torch.tensor([1.0]), "count": torch.tensor(7)}
    server = FedNovaServer()
    server.receive(torch.tensor(0.2, dtype=torch.float64), 1, 8)
    server.receive(torch.tensor(0.6, dtype=torch.float64), 3, 8)
    new = server.step(x, x, {"w": torch.tensor([3.0])})
    assert new["w"].item() == pytest.approx(2.0) and new["count"].item() == 7
    momentum = FedNovaServer(base=FedAvgM(beta=0.5))
    for _ in range(2):
        momentum.receive(torch.tensor(0.2, dtype=torch.float64), 1, 8)
        momentum.receive(torch.tensor(0.6, dtype=torch.float64), 3, 8)
        x = momentum.step(x, x, {"w": x["w"] + 2.0})  # the update x_eff - x = 1 each round
    assert x["w"].item() == pytest.approx(1.0 + 1.0 + 1.5)  # M = 1, then 0.5 + 1
    restored = FedNovaServer(base=FedAvgM(beta=0.5))
    restored.load_state_dict(momentum.state_dict())
    assert restored.state_dict().keys() == momentum.state_dict().keys() and momentum.state_dict()
    with pytest.raises(RuntimeError, match="no client reported"):
        server.step(x, x, {"w": torch.tensor([3.0])})


@pytest.mark.parametrize("base", [SCAFFOLD(), FedNovaServer(), FedACG()])
def test_fednova_refuses_a_base_it_cannot_normalise(base):
    with pytest.raises(ValueError, match="trainer.server.init_args.base"):
        FedNovaServer(base=base)
    assert isinstance(FedNovaServer(base=FedAdam()).base, FedAdam) and isinstance(FedNovaServer().base, FedAvg)


# -- one round of fedrcl fit against a plain-loop reference ----------------------------------------------------
@pytest.fixture
def round_seen(monkeypatch):
    """Every local step's batch, by (round, client) in training order, and each client's received weights and
    sample count, captured at ``training_step`` (clients one after another)."""
    from fedrcl.algorithms import FedAvg as FedAvgClient

    seen: dict[tuple[int, int], dict] = {}
    original = FedAvgClient.training_step

    def training_step(self, batch, batch_idx):
        client = self.client
        entry = seen.setdefault((client.round_idx, client.client_id), {
            "batches": [], "num_samples": client.num_samples, "num_steps": client.num_steps,
            "sent": {k: v.detach().clone() for k, v in client.global_state.items()}})
        entry["batches"].append((batch[0].detach().clone(), batch[1].detach().clone()))
        return original(self, batch, batch_idx)

    monkeypatch.setattr(FedAvgClient, "training_step", training_step)
    return seen


def clients_of(seen: dict, round_idx: int) -> list[dict]:
    return [entry for (r, _), entry in seen.items() if r == round_idx]


def reference_local_sgd(net, start, batches, lr, weight_decay, momentum, clip, direction):
    """Plain local SGD as ``torch.optim.SGD`` defines it, on the step ``direction(params, x, y)`` (the gradient,
    or a method's), clipped to ``clip`` as ``clip_grad_norm_``: returns the final parameters."""
    w = {k: v.clone() for k, v in start.items()}
    buf: dict = {}
    for x, y in batches:
        d = direction(w, x, y)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in d.values()))
        scale = min(1.0, clip / (norm.item() + 1e-6))
        for k in w:
            step = d[k] * scale + weight_decay * w[k]
            if momentum:
                buf[k] = step if k not in buf else momentum * buf[k] + step
                step = buf[k]
            w[k] = w[k] - lr * step
    return w


def ce_gradient(net, extra=None):
    """The gradient of CE (plus ``extra(params)``) at ``params`` on ``(x, y)``, by autograd."""
    def direction(params, x, y):
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        loss = F.cross_entropy(functional_call(net, leaves, (x,)).logits, y)
        if extra is not None:
            loss = loss + extra(leaves)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        return dict(zip(leaves, grads))
    return direction


def relative_difference(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max()).item() for k in a)


def fednova_fit(data_root, tmp_path, *extra):
    return run_cli(data_root, tmp_path, "--config", str(CONFIGS / "fednova.yaml"), *FLOAT64, "--data.partition",
                   "dirichlet_unbalanced", *extra, rounds=1, model="fedrcl.algorithms.FedNova")


@pytest.mark.parametrize("momentum, mu", [(0.5, 0.0), (0.0, 0.05)])
def test_fednova_round_is_the_papers_algorithm(data_root, tmp_path, round_seen, momentum, mu):
    """Clients of different sizes take different step counts (local_iters_per_epoch null); the paper's rule:
    x+ = x - tau_eff sum_i p_i (x - y_i) / ||a_i||_1, its closed-form ||a_i|| of momentum SGD and of the
    proximal solver, p_i = n_i / sum n_j, tau_eff = sum_i p_i ||a_i||_1."""
    cli = fednova_fit(data_root, tmp_path, "--model.init_args.momentum", str(momentum), "--model.init_args.mu",
                      str(mu), "--trainer.local_epochs", "2")
    model = cli.model
    clients = clients_of(round_seen, 0)
    steps = [c["num_steps"] for c in clients]
    assert len(clients) == 3 and len(set(steps)) > 1, steps  # the setting where FedNova is not FedAvg
    net = copy.deepcopy(model.backbone)
    names = [n for n, _ in net.named_parameters()]
    lr = model.client_lr(0, 0)
    n_total = sum(c["num_samples"] for c in clients)
    x0 = {k: clients[0]["sent"][k] for k in names}
    tau_eff, normalized = 0.0, {k: torch.zeros_like(v) for k, v in x0.items()}
    for c in clients:
        prox = (lambda p: mu / 2 * sum((p[k] - x0[k]).pow(2).sum() for k in p)) if mu else None
        y = reference_local_sgd(net, x0, c["batches"], lr, model.weight_decay, momentum, model.grad_clip_norm,
                                ce_gradient(net, prox))
        tau = len(c["batches"])
        a_norm = ((tau - momentum * (1 - momentum ** tau) / (1 - momentum)) / (1 - momentum) if momentum else
                  (1 - (1 - lr * mu) ** tau) / (lr * mu) if mu else float(tau))
        p = c["num_samples"] / n_total
        tau_eff += p * a_norm
        for k in names:
            normalized[k] += p * (x0[k] - y[k]) / a_norm
    expected = {k: x0[k] - tau_eff * normalized[k] for k in names}
    got = dict(model.backbone.named_parameters())
    assert relative_difference(expected, {k: got[k].detach() for k in names}) <= 1e-9
    assert next(iter(got.values())).dtype == torch.float64
    # bytes: FedAvg's both ways, plus one float64 per client up
    model_bytes = sum(p.numel() * p.element_size() for p in model.backbone.state_dict().values())
    assert cli.trainer.federation.ledger.cumulative == {"down": 3 * model_bytes, "up": 3 * model_bytes + 3 * 8}


def test_fednova_needs_its_server_half(data_root, tmp_path):
    with pytest.raises(ValueError, match="needs trainer.server fedrcl.server.FedNova"):
        run_cli(data_root, tmp_path, rounds=1, model="fedrcl.algorithms.FedNova")


# -- the sharpness-aware family and FedCM ----------------------------------------------------------------------
def test_sam_and_asam_perturbations_by_hand():
    g = {"w": torch.tensor([3.0, 4.0]), "bias": torch.tensor([0.0])}
    eps = sam_perturbation(g, rho=0.5)  # 0.5 g / 5
    torch.testing.assert_close(eps["w"], torch.tensor([0.3, 0.4]))
    torch.testing.assert_close(eps["bias"], torch.tensor([0.0]))
    params = {"w": torch.tensor([1.0, -0.5]), "bias": torch.tensor([2.0])}
    scale = asam_scale(params, eta=0.5)  # |w| + 0.5 on weights, 1 on biases
    torch.testing.assert_close(scale["w"], torch.tensor([1.5, 1.0]))
    torch.testing.assert_close(scale["bias"], torch.tensor([1.0]))
    g = {"w": torch.tensor([2.0, 1.0]), "bias": torch.tensor([1.0])}
    # T g = [3, 1, 1], ||T g|| = sqrt(11); eps = rho T^2 g / sqrt(11) = rho [4.5, 1, 1] / sqrt(11)
    eps = sam_perturbation(g, rho=1.0, scale=scale)
    torch.testing.assert_close(eps["w"], torch.tensor([4.5, 1.0]) / 11 ** 0.5)
    torch.testing.assert_close(eps["bias"], torch.tensor([1.0]) / 11 ** 0.5)
    zero = sam_perturbation({"w": torch.zeros(3)}, rho=1.0)
    assert torch.equal(zero["w"], torch.zeros(3))


def test_momentum_direction_and_global_update_by_hand():
    v = momentum_direction({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([-1.0, 0.0])}, alpha=0.25)
    torch.testing.assert_close(v["w"], torch.tensor([0.25 - 0.75, 0.5]))
    torch.testing.assert_close(global_update_direction(torch.tensor([1.0]), torch.tensor([0.5]), 0.25),
                               torch.tensor([2.0]))
    with pytest.raises(ValueError, match="lr_sum"):
        global_update_direction(torch.zeros(1), torch.zeros(1), 0.0)


def reference_asam_eps(g, w, rho, eta, adaptive):
    """SAM's and ASAM's perturbation written out (Kwon et al.: T = |w| + eta on weights, 1 on biases)."""
    t = {k: (torch.ones_like(w[k]) if k.endswith("bias") else w[k].abs() + eta) if adaptive else
         torch.ones_like(w[k]) for k in g}
    norm = torch.sqrt(sum((t[k] * g[k]).pow(2).sum() for k in g))
    return {k: rho * t[k] * t[k] * g[k] / (norm + 1e-12) for k in g}


def sam_direction(net, rho, eta=0.0, adaptive=False):
    """FedSAM's local step direction: the CE gradient at w + eps(grad at w)."""
    gradient = ce_gradient(net)

    def direction(w, x, y):
        eps = reference_asam_eps(gradient(w, x, y), w, rho, eta, adaptive)
        return gradient({k: w[k] + eps[k] for k in w}, x, y)
    return direction


def reference_rounds(net, seen, rounds, lr_of, model, direction_of):
    """FedAvg's server over ``rounds`` rounds of captured clients, each client's local SGD along
    ``direction_of(round, delta)`` (``delta``: FedCM's last global update over its local steps' lrs)."""
    names = [n for n, _ in net.named_parameters()]
    x = {k: clients_of(seen, 0)[0]["sent"][k] for k in names}
    delta = {k: torch.zeros_like(v) for k, v in x.items()}
    for r in range(rounds):
        clients = clients_of(seen, r)
        n_total = sum(c["num_samples"] for c in clients)
        mean = {k: torch.zeros_like(v) for k, v in x.items()}
        for c in clients:
            y = reference_local_sgd(net, x, c["batches"], lr_of(r), model.weight_decay, model.momentum,
                                    model.grad_clip_norm, direction_of(r, delta))
            for k in names:
                mean[k] += c["num_samples"] / n_total * y[k]
        steps = clients[0]["num_steps"]
        delta = {k: (x[k] - mean[k]) / (steps * lr_of(r)) for k in names}
        x = mean
    return x


def fit_float64(data_root, tmp_path, config, model, *extra, rounds=1):
    return run_cli(data_root, tmp_path, "--config", str(CONFIGS / f"{config}.yaml"), *FLOAT64,
                   "--data.local_iters_per_epoch", "3", *extra, rounds=rounds, model=f"fedrcl.algorithms.{model}")


@pytest.mark.parametrize("config", ["fedsam", "fedasam"])
def test_fedsam_round_is_the_papers_algorithm(data_root, tmp_path, round_seen, config):
    """w <- w - lr grad F(w + eps), eps = rho g / ||g|| (ASAM: rho T^2 g / ||T g||), through fedrcl fit's clip,
    weight decay and momentum (0.5 here), one round of three clients, float64, to 1e-9."""
    cli = fit_float64(data_root, tmp_path, config, "FedSAM", "--model.init_args.momentum", "0.5")
    model = cli.model
    net = copy.deepcopy(model.backbone)
    expected = reference_rounds(net, round_seen, 1, lambda r: model.client_lr(r, 0), model,
                                lambda r, delta: sam_direction(net, model.rho, model.eta, model.adaptive))
    got = {k: v.detach() for k, v in model.backbone.named_parameters()}
    assert relative_difference(expected, got) <= 1e-9
    sgd = reference_rounds(net, round_seen, 1, lambda r: model.client_lr(r, 0), model,
                           lambda r, delta: ce_gradient(net))
    assert relative_difference(sgd, got) > 1e-6  # SAM's step is not SGD's


@pytest.mark.parametrize("method", ["FedCM", "MoFedSAM"])
def test_fedcm_rounds_are_the_papers_algorithm(data_root, tmp_path, round_seen, method):
    """Two rounds (the second mixes round 1's update): v = alpha g + (1 - alpha) Delta, Delta = (x_0 - x_1) /
    (K lr_0), g the gradient (MoFedSAM: SAM's); float64, to 1e-9. Delta is sent with the weights: twice FedAvg's
    download."""
    cli = fit_float64(data_root, tmp_path, method.lower(), method, "--model.init_args.alpha", "0.3", rounds=2)
    model = cli.model
    net = copy.deepcopy(model.backbone)
    alpha = model.alpha

    def direction_of(r, delta):
        g_of = sam_direction(net, model.rho) if method == "MoFedSAM" else ce_gradient(net)
        return lambda w, x, y: {k: alpha * g + (1 - alpha) * delta[k] for k, g in g_of(w, x, y).items()}

    expected = reference_rounds(net, round_seen, 2, lambda r: model.client_lr(r, 0), model, direction_of)
    got = {k: v.detach() for k, v in model.backbone.named_parameters()}
    assert relative_difference(expected, got) <= 1e-9
    model_bytes = sum(p.numel() * p.element_size() for p in model.backbone.parameters())
    assert cli.trainer.federation.ledger.cumulative == {"down": 2 * 3 * 2 * model_bytes, "up": 2 * 3 * model_bytes}


def test_fedcm_refuses_clients_of_different_step_counts(data_root, tmp_path):
    with pytest.raises(ValueError, match="needs data.local_iters_per_epoch set"):
        run_cli(data_root, tmp_path, "--data.local_iters_per_epoch", "null", rounds=1,
                model="fedrcl.algorithms.FedCM")


class FedRCLSAM(FedSAM, FedRCL):
    """FedRCL's loss through FedSAM's step (the combination the FedSAM docstring describes)."""


def test_any_client_loss_takes_the_sam_step(data_root, tmp_path):
    """FedSAM before a loss's method: with rho 0 its step is that method's (FedRCL's RCL loss, 1e-12), with rho > 0
    it is not; its options are both classes' (jsonargparse reads them through the MRO)."""
    runs = {}
    for name, model, extra in (("rcl", "fedrcl.algorithms.FedRCL", ()),
                               ("rho0", "test_baselines_2026.FedRCLSAM", ("--model.init_args.rho", "0")),
                               ("sam", "test_baselines_2026.FedRCLSAM", ("--model.init_args.rho", "0.1",
                                                                         "--model.init_args.beta", "1.0"))):
        runs[name] = run_cli(data_root, tmp_path / name, *FLOAT64, "--data.local_iters_per_epoch", "2", *extra,
                             rounds=1, model=model)
    weights = {n: {k: v.detach() for k, v in cli.model.backbone.named_parameters()} for n, cli in runs.items()}
    assert relative_difference(weights["rcl"], weights["rho0"]) <= 1e-12
    assert relative_difference(weights["rcl"], weights["sam"]) > 1e-6
    assert "train/loss_ce" in runs["sam"].trainer.callback_metrics
    assert len(runs["sam"].trainer.callback_metrics) == len(runs["rcl"].trainer.callback_metrics)


def test_fedgamma_rounds_are_the_papers_algorithm(data_root, tmp_path, round_seen):
    """Two rounds of SCAFFOLD's control variates (option II) around SAM's step: d = grad F(w + eps) + c - c_i, eps
    from F's own gradient; c_i+ = c_i - c + (x - y_i) / (K lr), c += sum_i n_i / n_all (c_i+ - c_i); float64, 1e-9."""
    cli = fit_float64(data_root, tmp_path, "fedgamma", "FedGAMMA", "--model.init_args.rho", "0.2", rounds=2)
    model, dm = cli.model, cli.datamodule
    net = copy.deepcopy(model.backbone)
    names = [n for n, _ in net.named_parameters()]
    n_all = sum(dm.client_num_samples(k) for k in range(dm.num_clients))
    gradient = ce_gradient(net)
    x = {k: clients_of(round_seen, 0)[0]["sent"][k] for k in names}
    c = {k: torch.zeros_like(v) for k, v in x.items()}
    own: dict[int, dict] = {}
    for r in range(2):
        lr = model.client_lr(r, 0)
        mean = {k: torch.zeros_like(v) for k, v in x.items()}
        c_sum = {k: torch.zeros_like(v) for k, v in x.items()}
        entries = [(cid, e) for (rr, cid), e in round_seen.items() if rr == r]
        n_round = sum(e["num_samples"] for _, e in entries)
        for cid, e in entries:
            c_i = own.get(cid, {k: torch.zeros_like(v) for k, v in x.items()})
            corr = {k: c[k] - c_i[k] for k in names}

            def direction(w, xb, yb, corr=corr):
                g = gradient(w, xb, yb)
                eps = reference_asam_eps(g, w, model.rho, 0.0, False)
                g2 = gradient({k: w[k] + eps[k] for k in w}, xb, yb)
                return {k: g2[k] + corr[k] for k in w}

            y = reference_local_sgd(net, x, e["batches"], lr, model.weight_decay, model.momentum,
                                    model.grad_clip_norm, direction)
            new_c_i = {k: c_i[k] - c[k] + (x[k] - y[k]) / (len(e["batches"]) * lr) for k in names}
            for k in names:
                mean[k] += e["num_samples"] / n_round * y[k]
                c_sum[k] += e["num_samples"] / n_all * (new_c_i[k] - c_i[k])
            own[cid] = new_c_i
        x = mean
        c = {k: c[k] + c_sum[k] for k in names}
    got = {k: v.detach() for k, v in model.backbone.named_parameters()}
    assert relative_difference(x, got) <= 1e-9
    server_c = cli.trainer.federation.server.control(got)
    assert relative_difference(c, {k: server_c[k] for k in names}) <= 1e-9


def test_fedspeed_rounds_are_the_papers_algorithm(data_root, tmp_path, round_seen):
    """Two rounds of four clients, three a round (so that clients come back with their prox-correction): each step
    (1 - alpha) g1 + alpha g2 - g_hat + (w - x) / lam, g2 at w + rho g1 / ||g1||; then g_hat -= (y - x) / lam and the
    client sends y - lam g_hat, the server's FedAvg mean; float64, 1e-9."""
    cli = fit_float64(data_root, tmp_path, "fedspeed", "FedSpeed", "--model.init_args.alpha", "0.7",
                      "--model.init_args.lam", "2.0", "--data.num_clients", "4", rounds=2)
    model = cli.model
    net = copy.deepcopy(model.backbone)
    names = [n for n, _ in net.named_parameters()]
    gradient = ce_gradient(net)
    alpha, rho, lam = model.alpha, model.rho, model.lam
    x = {k: clients_of(round_seen, 0)[0]["sent"][k] for k in names}
    g_hat: dict[int, dict] = {}
    for r in range(2):
        entries = [(cid, e) for (rr, cid), e in round_seen.items() if rr == r]
        n_round = sum(e["num_samples"] for _, e in entries)
        mean = {k: torch.zeros_like(v) for k, v in x.items()}
        for cid, e in entries:
            own = g_hat.get(cid, {k: torch.zeros_like(v) for k, v in x.items()})

            def direction(w, xb, yb, own=own, x0=x):
                g1 = gradient(w, xb, yb)
                norm = torch.sqrt(sum(t.pow(2).sum() for t in g1.values()))
                g2 = gradient({k: w[k] + rho * g1[k] / (norm + 1e-12) for k in w}, xb, yb)
                return {k: (1 - alpha) * g1[k] + alpha * g2[k] - own[k] + (w[k] - x0[k]) / lam for k in w}

            y = reference_local_sgd(net, x, e["batches"], model.client_lr(r, 0), model.weight_decay,
                                    model.momentum, model.grad_clip_norm, direction)
            g_hat[cid] = {k: own[k] - (y[k] - x[k]) / lam for k in names}
            for k in names:
                mean[k] += e["num_samples"] / n_round * (y[k] - lam * g_hat[cid][k])
        x = mean
    returning = {cid for r, cid in round_seen if r == 0} & {cid for r, cid in round_seen if r == 1}
    assert returning  # a client trained with its prox-correction from round 1
    got = {k: v.detach() for k, v in model.backbone.named_parameters()}
    assert relative_difference(x, got) <= 1e-9
    for cid, expected in g_hat.items():  # every client's stored prox-correction
        assert relative_difference(expected, model.store.get(cid)) <= 1e-9, cid


# -- every engine, resume ------------------------------------------------------------------------------------
# (FedNova batched under the step mask: test_step_mask; FedSMOO: test_fedsmoo.)
ENGINE_RUNS = {"FedSAM": ("fedasam",), "MoFedSAM": ("mofedsam",), "FedCM": ("fedcm",), "FedGAMMA": ("fedgamma",),
               "FedSpeed": ("fedspeed",)}


def engine_fit(data_root, save_dir, method, *extra):
    (config,) = ENGINE_RUNS[method]
    return run_cli(data_root, save_dir, "--config", str(CONFIGS / f"{config}.yaml"), "--trainer.precision",
                   "64-true", "--data.local_iters_per_epoch", "3", "--model.init_args.momentum", "0.5", *extra, rounds=2,
                   model=f"fedrcl.algorithms.{method}")


@pytest.mark.parametrize("method", list(ENGINE_RUNS))
def test_batched_clients_train_each_method_as_one_after_another(data_root, tmp_path, method):
    """Two rounds batched (no fallback) and one client after another: the same weights (float64, 1e-9) and bytes."""
    runs = {mode: engine_fit(data_root, tmp_path / mode, method, "--trainer.client_batching", mode)
            for mode in ("off", "on")}
    assert runs["on"].trainer.federation.plan(1).batched
    weights = {m: {k: v.detach() for k, v in cli.model.backbone.state_dict().items()} for m, cli in runs.items()}
    assert relative_difference(weights["off"], weights["on"]) <= 1e-9
    assert runs["on"].trainer.federation.ledger.cumulative == runs["off"].trainer.federation.ledger.cumulative


@pytest.mark.parametrize("method", ["FedCM", "FedSpeed"])
def test_resume_equals_a_run_that_never_stopped(data_root, tmp_path, method):
    """Two rounds, then a third from ``--ckpt_path last`` (FedCM: the previous global model in the checkpoint;
    FedSpeed: the clients' g_hat_i files): round 3 bitwise as three rounds straight."""
    every = ("--trainer.checkpoint_every", "1", "--trainer.client_batching", "off")
    engine_fit(data_root, tmp_path / "cut", method, *every)
    ckpt = next((tmp_path / "cut").rglob("last.ckpt"))
    resumed = engine_fit(data_root, tmp_path / "cut", method, *every, "--ckpt_path", str(ckpt),
                         "--trainer.rounds", "3")
    full = engine_fit(data_root, tmp_path / "full", method, *every, "--trainer.rounds", "3")
    assert resumed.trainer.current_epoch == full.trainer.current_epoch == 3
    for k, v in full.model.backbone.state_dict().items():
        assert torch.equal(v, resumed.model.backbone.state_dict()[k]), k
