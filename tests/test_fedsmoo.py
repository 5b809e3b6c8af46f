"""FedSMOO (Sun et al., ICML 2023, issue 52): its rules by hand and at random, two rounds of ``fedrcl fit`` (float64,
four clients, three a round) replayed by a reference written from the paper's Algorithm 1 in plain loops to 1e-9
relative, its bytes, its bad options, batched clients and seeds together (its duals as per-client step state) equal to
clients one after another, and resume."""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import REPO, run_cli
from fedrcl import seeds
from fedrcl.losses.perturbation_correction import corrected_perturbation, fedsmoo_direction, global_perturbation, \
    perturbation_dual_update
from fedrcl.server import FedSMOO as FedSMOOServer
from test_bad_input import assert_short, fedrcl
from test_baselines_2026 import ce_gradient, clients_of, fit_float64, reference_local_sgd, relative_difference
from test_baselines_2026 import round_seen  # noqa: F401 (the fixture that captures every client's batches)
from test_together import args as together_args
from test_together import last as together_last

CONFIG = REPO / "configs" / "methods" / "fedsmoo.yaml"


# -- the rules -------------------------------------------------------------------------------------------------
def test_corrected_perturbation_and_duals_by_hand():
    g = {"w": torch.tensor([4.0, 1.0]), "b": torch.tensor([2.0])}
    mu = {"w": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0])}
    s = {"w": torch.tensor([0.0, 1.0]), "b": torch.tensor([-2.0])}
    s_hat = corrected_perturbation(g, mu, s, rho=0.5)  # g - mu - s = [3, 0, 4], norm 5: 0.5 [3, 0, 4] / 5
    torch.testing.assert_close(s_hat["w"], torch.tensor([0.3, 0.0]))
    torch.testing.assert_close(s_hat["b"], torch.tensor([0.4]))
    torch.testing.assert_close(perturbation_dual_update(mu["w"], s_hat["w"], s["w"]), torch.tensor([1.3, -1.0]))
    zero = corrected_perturbation({"w": torch.tensor([1.0])}, {"w": torch.tensor([0.5])}, {"w": torch.tensor([0.5])},
                                  rho=1.0)
    assert torch.equal(zero["w"], torch.zeros(1))  # g = mu + s: no perturbation
    # grad F(w + s_hat) - lam + alpha (w - x): [1, 2] - [0.5, -1] + 0.1 ([3, 3] - [1, 5]) = [0.7, 2.8]
    d = fedsmoo_direction({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.5, -1.0])},
                          {"w": torch.tensor([3.0, 3.0])}, {"w": torch.tensor([1.0, 5.0])}, alpha=0.1)
    torch.testing.assert_close(d["w"], torch.tensor([0.7, 2.8]))
    s_new = global_perturbation({"w": torch.tensor([0.0, -3.0]), "b": torch.tensor([4.0])}, rho=0.1)
    torch.testing.assert_close(s_new["w"], torch.tensor([0.0, -0.06]))
    torch.testing.assert_close(s_new["b"], torch.tensor([0.08]))


def test_corrected_perturbation_at_random_is_its_definition():
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (3, 4), "b": (5,)}
    g, mu, s = ({k: torch.randn(shape, dtype=torch.float64, generator=gen) for k, shape in shapes.items()}
                for _ in range(3))
    flat = torch.cat([(g[k] - mu[k] - s[k]).reshape(-1) for k in shapes])
    expected = 0.37 * flat / flat.norm()
    got = corrected_perturbation(g, mu, s, rho=0.37)
    torch.testing.assert_close(torch.cat([got[k].reshape(-1) for k in shapes]), expected, rtol=1e-12, atol=0)
    assert float(torch.cat([t.reshape(-1) for t in got.values()]).norm()) == pytest.approx(0.37, rel=1e-12)


def test_server_step_by_hand():
    """Clients of 1 and 3 of 8 samples (the round's half of all samples): v = (1 [2, 0] + 3 [0, 2]) / 8, s = rho v /
    ||v||; h = -alpha 0.5 (mean - x) = -0.25 [2, 2] (alpha 0.5), the model mean - h / alpha = [3, 3] + [1, 1]."""
    server = FedSMOOServer(alpha=0.5, rho=0.2)
    x = {"w": torch.tensor([1.0, 1.0]), "count": torch.tensor(3)}
    assert server.broadcast(x) is x and torch.equal(server.extra_broadcast(None)["w"], torch.zeros(2))
    server.receive(1, 8, {"w": torch.tensor([2.0, 0.0])})
    server.receive(3, 8, {"w": torch.tensor([0.0, 2.0])})
    new = server.step(x, x, {"w": torch.tensor([3.0, 3.0])})
    torch.testing.assert_close(new["w"], torch.tensor([4.0, 4.0]))
    assert new["count"].item() == 3
    torch.testing.assert_close(server.extra_broadcast(None)["w"], 0.2 * torch.tensor([1.0, 3.0]) / 10 ** 0.5)
    restored = FedSMOOServer(alpha=0.5, rho=0.2)
    restored.load_state_dict(server.state_dict())
    assert set(restored.state_dict()) == {"h", "perturbation"}
    torch.testing.assert_close(restored.extra_broadcast(None)["w"], server.extra_broadcast(None)["w"])


@pytest.mark.parametrize("key, value, allowed", [("alpha", "0", "> 0, got 0.0"), ("rho", "-0.1", ">= 0, got -0.1")])
def test_bad_options_are_refused_in_one_line(data_root, tmp_path, key, value, allowed):
    code, err = fedrcl(data_root, tmp_path, "--config", str(CONFIG), f"--trainer.server.init_args.{key}", value)
    assert code == 1
    assert_short(err, f"fedrcl: error: trainer.server.init_args.{key} must be {allowed}\n")
    assert not list(tmp_path.rglob("version_*"))  # before training: no run folder


def test_fedsmoo_needs_its_server_half(data_root, tmp_path):
    with pytest.raises(ValueError, match="needs trainer.server fedrcl.server.FedSMOO .* configs/methods/fedsmoo.yaml"):
        run_cli(data_root, tmp_path, rounds=1, model="fedrcl.algorithms.FedSMOO")


# -- two rounds of fedrcl fit against the paper's algorithm ----------------------------------------------------
def test_fedsmoo_rounds_are_the_papers_algorithm(data_root, tmp_path, round_seen):  # noqa: F811
    """Algorithm 1 in plain loops: each step s_hat = rho (g - mu_i - s) / ||g - mu_i - s||, mu_i += s_hat - s, the
    step along grad F(w + s_hat) - lam_i + (w - x) / beta; after the round lam_i -= (y_i - x) / beta, the server's
    s = rho v / ||v||, v the mean of mu_i - s_hat_{i,K}, and x+ = mean y_i - beta * mean over all clients of lam_i
    (means weighted by sample count, fedrcl's aggregation); float64, to 1e-9."""
    cli = fit_float64(data_root, tmp_path, "fedsmoo", "FedSMOO", "--trainer.server.init_args.alpha", "0.5",
                      "--trainer.server.init_args.rho", "0.2", "--data.num_clients", "4", rounds=2)
    model, dm, server = cli.model, cli.datamodule, cli.trainer.federation.server
    net = copy.deepcopy(model.backbone)
    names = [n for n, _ in net.named_parameters()]
    beta, rho = 1 / server.alpha, server.rho
    n_of = {k: dm.client_num_samples(k) for k in range(dm.num_clients)}
    n_all = sum(n_of.values())
    gradient = ce_gradient(net)
    zeros = {k: torch.zeros_like(v) for k, v in clients_of(round_seen, 0)[0]["sent"].items() if k in names}
    x = {k: clients_of(round_seen, 0)[0]["sent"][k] for k in names}
    s = dict(zeros)
    lam: dict[int, dict] = {}
    mu: dict[int, dict] = {}
    for r in range(2):
        entries = [(cid, e) for (rr, cid), e in round_seen.items() if rr == r]
        n_round = sum(e["num_samples"] for _, e in entries)
        mean = dict(zeros)
        v = dict(zeros)
        for cid, e in entries:
            lam_i = lam.get(cid, dict(zeros))
            state = {"mu": dict(mu.get(cid, zeros)), "s_hat": dict(zeros)}

            def direction(w, xb, yb, lam_i=lam_i, state=state, x0=x, s0=s):
                g = gradient(w, xb, yb)
                u = {k: g[k] - state["mu"][k] - s0[k] for k in w}
                norm = torch.sqrt(sum(t.pow(2).sum() for t in u.values()))
                s_hat = {k: rho * u[k] / (norm + 1e-12) for k in w}
                state["mu"] = {k: state["mu"][k] + s_hat[k] - s0[k] for k in w}
                state["s_hat"] = s_hat
                g2 = gradient({k: w[k] + s_hat[k] for k in w}, xb, yb)
                return {k: g2[k] - lam_i[k] + (w[k] - x0[k]) / beta for k in w}

            y = reference_local_sgd(net, x, e["batches"], model.client_lr(r, 0), model.weight_decay, model.momentum,
                                    model.grad_clip_norm, direction)
            lam[cid] = {k: lam_i[k] - (y[k] - x[k]) / beta for k in names}
            mu[cid] = state["mu"]
            for k in names:
                mean[k] = mean[k] + e["num_samples"] / n_round * y[k]
                v[k] = v[k] + e["num_samples"] / n_round * (state["mu"][k] - state["s_hat"][k])
        norm = torch.sqrt(sum(t.pow(2).sum() for t in v.values()))
        s = {k: rho * v[k] / (norm + 1e-12) for k in names}
        lam_mean = {k: sum(n_of[cid] / n_all * lam[cid][k] for cid in lam) for k in names}
        x = {k: mean[k] - beta * lam_mean[k] for k in names}
    returning = {cid for r, cid in round_seen if r == 0} & {cid for r, cid in round_seen if r == 1}
    assert returning  # a client came back with its two duals from round 1
    got = {k: v.detach() for k, v in model.backbone.named_parameters()}
    assert relative_difference(x, got) <= 1e-9
    assert relative_difference(s, {k: server.extra_broadcast(None)[k] for k in names}) <= 1e-9
    for cid in lam:  # every client's stored duals
        stored = model.store.get(cid)
        assert relative_difference(lam[cid], {k: stored["lam." + k] for k in names}) <= 1e-9, cid
        assert relative_difference(mu[cid], {k: stored["mu." + k] for k in names}) <= 1e-9, cid
    # bytes: the weights and s down, the weights and mu_i - s_hat_{i,K} up, for 3 clients in each of 2 rounds
    model_bytes = sum(p.numel() * p.element_size() for p in model.backbone.parameters())
    assert cli.trainer.federation.ledger.cumulative == {"down": 2 * 3 * 2 * model_bytes, "up": 2 * 3 * 2 * model_bytes}


# -- other engines, resume -------------------------------------------------------------------------------------
def smoo_fit(data_root, save_dir, *extra, rounds=2):
    return run_cli(data_root, save_dir, "--config", str(CONFIG), "--trainer.precision", "64-true",
                   "--data.local_iters_per_epoch", "3", *extra, rounds=rounds, model="fedrcl.algorithms.FedSMOO")


def stored_duals(model) -> dict:
    """Every client's stored lam_i and mu_i, by client."""
    return {cid: model.store.get(cid) for cid in range(model.trainer.datamodule.num_clients)
            if model.store.get(cid) is not None}


@pytest.mark.parametrize("unequal", [False, True])
def test_batched_clients_equal_one_after_another(data_root, tmp_path, caplog, unequal):
    """The duals, the received s and the last s_hat are per-client step state: batched clients train FedSMOO, no
    fallback, to the weights and stored duals of clients one after another (float64, 1e-9; three rounds, so clients
    come back to their duals), also under a step mask (unequal clients, one pass over each client's data)."""
    extra = ("--data.partition", "dirichlet_unbalanced", "--data.local_iters_per_epoch", "null") if unequal else ()
    caplog.set_level("INFO")
    runs = {mode: smoo_fit(data_root, tmp_path / mode, "--trainer.client_batching", mode, *extra, rounds=3)
            for mode in ("off", "on")}
    assert runs["on"].trainer.federation.plan(2).batched and "one after another" not in caplog.text
    off, on = runs["off"].model, runs["on"].model
    assert relative_difference(off.backbone.state_dict(), on.backbone.state_dict()) <= 1e-9
    duals_off, duals_on = stored_duals(off), stored_duals(on)
    assert duals_off.keys() == duals_on.keys() and len(duals_off) >= 3
    for cid in duals_off:
        assert relative_difference(duals_off[cid], duals_on[cid]) <= 1e-9, cid


def test_seeds_together_equal_each_seed_alone(data_root, tmp_path, capsys):
    """Seeds 0 and 1 together (each seed's own s handed to its clients' slices) give each seed its own fit's weights
    (float64, 1e-9), trained together (no fallback)."""
    common = ("--config", str(CONFIG), "--trainer.precision", "64-true")
    seeds.main(["--seeds", "0", "1", "--together", *together_args(data_root, tmp_path / "together", *common, rounds=2,
                                                                  model="fedrcl.algorithms.FedSMOO")])
    assert "--together:" not in capsys.readouterr().out
    seeds.main(["--seeds", "0", "1", *together_args(data_root, tmp_path / "alone", *common, rounds=2,
                                                    model="fedrcl.algorithms.FedSMOO")])
    for seed in (0, 1):
        assert relative_difference(together_last(tmp_path / "together", seed)["state_dict"],
                                   together_last(tmp_path / "alone", seed)["state_dict"]) <= 1e-9, seed


def test_resume_equals_a_run_that_never_stopped(data_root, tmp_path):
    """Two rounds, then a third from ``--ckpt_path last`` (the server's h and s in the checkpoint, the clients' lam_i
    and mu_i files in its manifest): round 3 bitwise as three rounds straight."""
    every = ("--trainer.checkpoint_every", "1", "--trainer.client_batching", "off")
    smoo_fit(data_root, tmp_path / "cut", *every)
    ckpt = next((tmp_path / "cut").rglob("last.ckpt"))
    resumed = smoo_fit(data_root, tmp_path / "cut", *every, "--ckpt_path", str(ckpt), rounds=3)
    full = smoo_fit(data_root, tmp_path / "full", *every, rounds=3)
    assert resumed.trainer.current_epoch == full.trainer.current_epoch == 3
    for k, v in full.model.backbone.state_dict().items():
        assert torch.equal(v, resumed.model.backbone.state_dict()[k]), k
    s_full, s_resumed = (cli.trainer.federation.server.extra_broadcast(None) for cli in (full, resumed))
    assert all(torch.equal(s_full[k], s_resumed[k]) for k in s_full) and any(t.abs().sum() > 0 for t in s_full.values())
