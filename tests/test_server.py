"""Server optimizers: each step against its closed form, FedACG's broadcast and client term, checkpoints,
and every server with several client algorithms through ``fedrcl fit``."""
from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_same_state, run_cli
from fedrcl.server import (FedACG, FedAdagrad, FedAdam, FedAvg, FedAvgM, FedYogi, ServerOptimizer,
                           StatefulServer)
from test_cli import load_ckpt, scalars


def run_rounds(server: ServerOptimizer, w0: dict, deltas: list[list[float]]) -> list[torch.Tensor]:
    """Feed ``server`` rounds whose client mean is ``sent + delta``; the global "w" after each round.

    The state also holds an integer buffer that must come out untouched.
    """
    state, history = dict(w0), []
    for delta in deltas:
        sent = server.broadcast(state)
        client_mean = {"w": sent["w"] + torch.tensor(delta)}
        state = server.step(state, sent, client_mean)
        assert torch.equal(state["count"], w0["count"]) and state["count"].dtype == torch.long
        history.append(state["w"])
    return history


def start(*values: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(values), "count": torch.tensor(7)}


# -- closed forms, by hand ------------------------------------------------------------------------------------
def test_fedavgm_hand_case():
    # beta 0.5, eta 1: M = 0.5 M + delta, w = w + M.
    #   round 1: delta [1, 0]  -> M [1, 0]        -> w [2, 2]
    #   round 2: delta [0, 2]  -> M [0.5, 2]      -> w [2.5, 4]
    #   round 3: delta [-1, 0] -> M [-0.75, 1]    -> w [1.75, 5]
    history = run_rounds(FedAvgM(beta=0.5, eta=1.0), start(1.0, 2.0), [[1, 0], [0, 2], [-1, 0]])
    expected = [[2.0, 2.0], [2.5, 4.0], [1.75, 5.0]]
    for got, want in zip(history, expected):
        torch.testing.assert_close(got, torch.tensor(want))
    # eta scales the step: w = w + 0.5 M with the same momenta.
    history = run_rounds(FedAvgM(beta=0.5, eta=0.5), start(1.0, 2.0), [[1, 0], [0, 2], [-1, 0]])
    torch.testing.assert_close(history[-1], torch.tensor([1.0 + 0.5 * (1 + 0.5 - 0.75), 2.0 + 0.5 * (0 + 2 + 1)]))


def test_fedavgm_without_momentum_is_fedavg():
    a = run_rounds(FedAvgM(beta=0.0, eta=1.0), start(1.0, 2.0), [[1, 0], [0, 2], [-1, 3]])
    b = run_rounds(FedAvg(), start(1.0, 2.0), [[1, 0], [0, 2], [-1, 3]])
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_fedadam_hand_case():
    # beta1 0.5, beta2 0.5, tau 1, eta 1; m starts at 0, v at tau^2 = 1:
    #   m = 0.5 m + 0.5 delta, v = 0.5 v + 0.5 delta^2, w = w + m / (sqrt(v) + 1).
    # entry a, deltas 1, 7, 5: m 0.5, 3.75, 4.375; v 1, 25, 25; steps 0.5/2, 3.75/6, 4.375/6
    # entry b, deltas -1, -1, 1: m -0.5, -0.75, 0.125; v 1, 1, 1; steps -0.25, -0.375, 0.0625
    history = run_rounds(FedAdam(eta=1.0, beta1=0.5, beta2=0.5, tau=1.0), start(0.0, 0.0),
                         [[1, -1], [7, -1], [5, 1]])
    expected = [[0.25, -0.25], [0.25 + 0.625, -0.625], [0.875 + 4.375 / 6, -0.5625]]
    for got, want in zip(history, expected):
        torch.testing.assert_close(got, torch.tensor(want))


def test_fedyogi_and_fedadagrad_hand_case():
    # beta1 0.5, tau 1 (v starts at 1), eta 1; deltas 3, 1, 2 on one entry: m = 1.5, 1.25, 1.625.
    # FedAdagrad, v = v + delta^2: v = 10, 11, 15.
    history = run_rounds(FedAdagrad(eta=1.0, beta1=0.5, tau=1.0), start(0.0), [[3], [1], [2]])
    steps = [1.5 / (10 ** 0.5 + 1), 1.25 / (11 ** 0.5 + 1), 1.625 / (15 ** 0.5 + 1)]
    torch.testing.assert_close(torch.cat(history), torch.tensor(steps).cumsum(0))
    # FedYogi, beta2 0.5, v = v - 0.5 delta^2 sign(v - delta^2):
    #   v = 1 - 4.5 * sign(1 - 9) = 5.5;  5.5 - 0.5 * sign(4.5) = 5;  5 - 2 * sign(1) = 3.
    history = run_rounds(FedYogi(eta=1.0, beta1=0.5, beta2=0.5, tau=1.0), start(0.0), [[3], [1], [2]])
    steps = [1.5 / (5.5 ** 0.5 + 1), 1.25 / (5 ** 0.5 + 1), 1.625 / (3 ** 0.5 + 1)]
    torch.testing.assert_close(torch.cat(history), torch.tensor(steps).cumsum(0))


@pytest.mark.parametrize("name", ["adam", "yogi", "adagrad"])
def test_fedopt_random_case_against_float64_formula(name):
    """Paper defaults, random updates over 5 rounds, against Reddi et al.'s Algorithm 2 in float64."""
    server = {"adam": FedAdam(), "yogi": FedYogi(), "adagrad": FedAdagrad()}[name]
    gen = torch.Generator().manual_seed(0)
    deltas = [(0.05 * torch.randn(6, generator=gen)).tolist() for _ in range(5)]
    history = run_rounds(server, {"w": torch.zeros(6), "count": torch.tensor(7)}, deltas)
    w, m, v = torch.zeros(6, dtype=torch.float64), 0.0, torch.full((6,), 1e-3 ** 2, dtype=torch.float64)
    for delta, got in zip(deltas, history):
        d = torch.tensor(delta, dtype=torch.float64)
        m = 0.9 * m + 0.1 * d
        if name == "adam":
            v = 0.99 * v + 0.01 * d ** 2
        elif name == "yogi":
            v = v - 0.01 * d ** 2 * torch.sign(v - d ** 2)
        else:
            v = v + d ** 2
        w = w + 1e-2 * m / (v.sqrt() + 1e-3)
        torch.testing.assert_close(got.double(), w, rtol=1e-5, atol=1e-6)


def test_fedacg_hand_case_broadcast_and_step():
    # lam 0.5: sent = w + 0.5 M; delta = mean - sent; M = 0.5 M + delta; w = mean.
    server = FedACG(lam=0.5, beta=0.1)
    w = start(1.0, 2.0)
    sent = server.broadcast(w)
    assert sent is w  # no momentum yet: the global model itself
    w = server.step(w, sent, {"w": torch.tensor([2.0, 2.0])})  # delta [1, 0] -> M [1, 0]
    torch.testing.assert_close(w["w"], torch.tensor([2.0, 2.0]))
    sent = server.broadcast(w)
    torch.testing.assert_close(sent["w"], torch.tensor([2.5, 2.0]))
    assert torch.equal(sent["count"], torch.tensor(7))
    w = server.step(w, sent, {"w": torch.tensor([3.5, 3.0])})  # delta [1, 1] -> M [1.5, 1]
    torch.testing.assert_close(w["w"], torch.tensor([3.5, 3.0]))
    torch.testing.assert_close(server.memory["momentum"]["w"], torch.tensor([1.5, 1.0]))
    sent = server.broadcast(w)
    torch.testing.assert_close(sent["w"], torch.tensor([4.25, 3.5]))
    w = server.step(w, sent, {"w": torch.tensor([4.0, 4.0])})  # delta [-0.25, 0.5] -> M [0.5, 1]
    torch.testing.assert_close(w["w"], torch.tensor([4.0, 4.0]))
    torch.testing.assert_close(server.memory["momentum"]["w"], torch.tensor([0.5, 1.0]))
    assert torch.equal(w["count"], torch.tensor(7)) and set(server.memory["momentum"]) == {"w"}


def test_fedacg_client_term_value_and_gradient():
    # beta/2 ||theta - sent||^2 = 0.05 * (0.75^2 + 0.5^2) = 0.040625; gradient beta (theta - sent).
    sent = {"w": torch.tensor([4.25, 3.5]), "b": torch.tensor([1.0]), "count": torch.tensor(7)}
    params = {"w": torch.tensor([5.0, 3.0], requires_grad=True), "b": torch.tensor([1.0], requires_grad=True)}
    term = FedACG(lam=0.5, beta=0.1).client_regularizer(params, sent)
    torch.testing.assert_close(term, torch.tensor(0.040625))
    term.backward()
    torch.testing.assert_close(params["w"].grad, torch.tensor([0.075, -0.05]))
    torch.testing.assert_close(params["b"].grad, torch.tensor([0.0]))
    assert FedACG(beta=0.0).client_regularizer(params, sent) is None


@pytest.mark.parametrize("server", [FedAvg(), FedAvgM(), FedAdam(), FedYogi(), FedAdagrad()])
def test_servers_without_client_side_parts(server):
    state = start(1.0, 2.0)
    assert server.broadcast(state) is state
    assert server.client_regularizer({"w": torch.zeros(2, requires_grad=True)}, state) is None


def test_paper_defaults():
    assert (FedAvgM().beta, FedAvgM().eta) == (0.4, 1.0)
    adam = FedAdam()
    assert (adam.beta1, adam.beta2, adam.tau, adam.eta) == (0.9, 0.99, 1e-3, 1e-2)
    assert (FedACG().lam, FedACG().beta) == (0.85, 0.001)


@pytest.mark.parametrize("make, key", [(lambda: FedAvgM(beta=1.0), "beta"), (lambda: FedAvgM(eta=0.0), "eta"),
                                       (lambda: FedAdam(beta2=-0.1), "beta2"), (lambda: FedYogi(tau=0.0), "tau"),
                                       (lambda: FedACG(lam=1.5), "lam"), (lambda: FedACG(beta=-1.0), "beta")])
def test_bad_arguments_name_the_key(make, key):
    with pytest.raises(ValueError, match=f"trainer.server.init_args.{key} "):
        make()


# -- server memory ----------------------------------------------------------------------------------------
STATEFUL = [lambda: FedAvgM(beta=0.5, eta=0.7), lambda: FedAdam(eta=0.1), lambda: FedYogi(eta=0.1),
            lambda: FedAdagrad(eta=0.1), lambda: FedACG(lam=0.5)]


@pytest.mark.parametrize("make", STATEFUL)
def test_state_dict_round_trip_continues_exactly(make):
    gen = torch.Generator().manual_seed(1)
    deltas = [torch.randn(3, generator=gen).tolist() for _ in range(4)]
    w0 = {"w": torch.randn(3, generator=gen), "count": torch.tensor(7)}
    uninterrupted = run_rounds(make(), w0, deltas)

    first = make()
    assert first.state_dict() == {}  # memory is created at the first step
    half = run_rounds(first, w0, deltas[:2])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = make()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    rest = run_rounds(resumed, {"w": half[-1], "count": torch.tensor(7)}, deltas[2:])
    for a, b in zip(uninterrupted, half + rest):
        assert torch.equal(a, b)
    # state_dict is a copy: later steps do not change a checkpoint already taken
    saved = first.state_dict()
    run_rounds(first, {"w": half[-1], "count": torch.tensor(7)}, deltas[2:])
    assert any(not torch.equal(saved[n]["w"], first.memory[n]["w"]) for n in saved)


def test_memory_follows_the_weights_dtype_and_keys():
    server = FedAvgM()
    state = {"w": torch.zeros(2, dtype=torch.float64), "count": torch.tensor(7)}
    new = server.step(state, state, {"w": torch.ones(2, dtype=torch.float64)})
    assert new["w"].dtype == torch.float64 and server.memory["momentum"]["w"].dtype == torch.float64
    assert isinstance(server, StatefulServer) and set(server.state_dict()["momentum"]) == {"w"}


# -- through the CLI --------------------------------------------------------------------------------------
SERVERS = {
    "fedavg": (), "fedavgm": ("--config", str(REPO / "configs/server/fedavgm.yaml")),
    "fedadam": ("--config", str(REPO / "configs/server/fedadam.yaml")),
    "fedacg": ("--config", str(REPO / "configs/server/fedacg.yaml")),
    "fedyogi": ("--trainer.server", "fedrcl.server.FedYogi"),
    "fedadagrad": ("--trainer.server", "fedrcl.server.FedAdagrad"),
}
CLASSES = {"fedavg": FedAvg, "fedavgm": FedAvgM, "fedadam": FedAdam, "fedacg": FedACG, "fedyogi": FedYogi,
           "fedadagrad": FedAdagrad}


@pytest.mark.parametrize("model", ["FedAvg", "FedRCL", "FedSCL"])
@pytest.mark.parametrize("server", list(SERVERS))
def test_every_server_with_client_algorithms(data_root, tmp_path, server, model):
    cli = run_cli(data_root, tmp_path, *SERVERS[server], rounds=2, model=f"fedrcl.algorithms.{model}")
    used = cli.trainer.federation.server
    assert type(used) is CLASSES[server]
    assert all(torch.isfinite(v).all() for v in cli.model.backbone.state_dict().values())
    log_dir = Path(cli.trainer.logger.log_dir)
    assert len(scalars(log_dir, "val/acc")) == 2
    ckpt = load_ckpt(log_dir / "checkpoints" / "last.ckpt")
    saved = ckpt["callbacks"]["Federation"]["server"]
    if isinstance(used, StatefulServer):
        assert saved.keys() == used.memory.keys() and saved
        names = {n for n, p in cli.model.backbone.named_parameters()}
        assert all(names <= memory.keys() for memory in saved.values())
    assert ("train/loss_server" in scalar_tags(log_dir)) == (server == "fedacg")


def scalar_tags(log_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return set(acc.Tags()["scalars"])


@pytest.mark.parametrize("server", ["fedavgm", "fedacg", "fedadam"])
def test_resume_with_server_memory_gives_the_same_weights(data_root, tmp_path, server):
    full = run_cli(data_root, tmp_path / "full", *SERVERS[server], rounds=4, model="fedrcl.algorithms.FedAvg")
    run_cli(data_root, tmp_path / "split", *SERVERS[server], rounds=2, model="fedrcl.algorithms.FedAvg")
    resumed = run_cli(data_root, tmp_path / "split", *SERVERS[server], "--ckpt_path", "last", rounds=4,
                      model="fedrcl.algorithms.FedAvg")
    full_dir, resumed_dir = Path(full.trainer.logger.log_dir), Path(resumed.trainer.logger.log_dir)
    assert resumed_dir.name == "version_1"
    a, b = load_ckpt(full_dir / "checkpoints" / "last.ckpt"), load_ckpt(resumed_dir / "checkpoints" / "last.ckpt")
    assert_same_state(a["state_dict"], b["state_dict"])
    memory_a, memory_b = a["callbacks"]["Federation"]["server"], b["callbacks"]["Federation"]["server"]
    assert memory_a.keys() == memory_b.keys() and memory_a
    for name in memory_a:
        assert_same_state(memory_a[name], memory_b[name])
    assert scalars(full_dir, "val/acc")[2:] == scalars(resumed_dir, "val/acc")
