"""The step mask (``fedrcl.contract.step_mask``): clients with different step counts and batch sizes train stacked
(batched clients, seeds together), each equal to its clients one after another."""
from __future__ import annotations

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedrcl import seeds
from fedrcl.contract.step_mask import (RoundMask, StepGroup, client_batch_sizes, client_epochs, client_rows, keep,
                                        masked_batch, split_groups, step_groups, uniform)
from test_together import args, last, relative_difference

# Unequal clients (the classic Dirichlet split of 10 clients of the digits: 51 to 248 samples), one pass over each
# client's data per local epoch (batches of 24, the last one smaller), 2 local epochs; float64, momentum, weight
# decay and a clip that binds: a finished client that moved would show far above 1e-9.
UNEQUAL = ("--data.partition", "dirichlet_unbalanced", "--data.local_iters_per_epoch", "null",
           "--trainer.precision", "64-true", "--model.init_args.momentum", "0.5",
           "--model.init_args.weight_decay", "0.01", "--model.init_args.grad_clip_norm", "1.0")
FALLBACK = "clients trained one after another"


# -- the pure functions, by hand ---------------------------------------------------------------------------------
def test_client_batch_sizes_by_hand():
    assert client_batch_sizes(95, 24, 2, None) == (24, 24, 24, 23) * 2
    assert client_batch_sizes(48, 24, 1, None) == (24, 24)
    assert client_batch_sizes(10, 24, 1, None) == (10,)
    assert client_batch_sizes(95, 24, 2, 3) == (24,) * 6  # fixed steps: full batches, however large the client
    assert uniform([(24, 24), (24, 24)]) and not uniform([(24, 23), (24, 24)]) and not uniform([(24,), (24, 24)])


def test_step_groups_by_hand():
    groups = step_groups([(24, 23), (24, 24, 9), (3,)])
    assert groups == (
        (StepGroup((0, 1), 24), StepGroup((2,), 3)),
        (StepGroup((1,), 24), StepGroup((0,), 23)),
        (StepGroup((1,), 9),),
    )


def test_client_epochs_by_hand():
    # client 0: 2 steps an epoch, client 1: 3; 2 epochs -> 4 and 6 steps
    assert client_epochs([2, 3], 2) == ({0: 0, 1: 0}, {0: 0, 1: 0}, {0: 1, 1: 0}, {0: 1, 1: 1}, {1: 1}, {1: 1})
    assert client_epochs([2, 2], 1) == ({0: 0, 1: 0}, {0: 0, 1: 0})


def test_keep_by_hand_and_random():
    new = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    old = torch.tensor([[7.0, 8.0], [9.0, 10.0], [11.0, 12.0]])
    assert torch.equal(keep(new, old, torch.tensor([True, False, True])),
                       torch.tensor([[1.0, 2.0], [9.0, 10.0], [5.0, 6.0]]))
    gen = torch.Generator().manual_seed(0)
    new, old = torch.randn(4, 3, 2, 2, generator=gen, dtype=torch.float64), torch.randn(4, 3, 2, 2, generator=gen)
    stepping = torch.tensor([False, True, True, False])
    kept = keep(new, old.double(), stepping)
    for k in range(4):  # exactly one or the other, per client
        assert torch.equal(kept[k], new[k] if stepping[k] else old[k].double())


def test_masked_batch_cuts_back_into_each_clients_batch():
    """A masked step's input (the stepping clients' batches, concatenated group after group) cut into its groups'
    ``[G, rows, ...]`` batches gives every client exactly its own batch, with two views too."""
    gen = torch.Generator().manual_seed(1)
    sizes = [(4, 3), (4, 4, 2), (1,)]
    groups = step_groups(sizes)
    for views in (1, 2):
        for t, step in enumerate(groups):
            batches = [(torch.randn(views * s[t], 3, 2, generator=gen), torch.randint(0, 9, (views * s[t],),
                                                                                        generator=gen))
                       if t < len(s) else None for s in sizes]
            x, y = masked_batch(batches, step)
            assert x.shape[0] == sum(views * s[t] for s in sizes if t < len(s))
            for group, (xg, yg) in zip(step, split_groups(x, y, step)):
                assert xg.shape[:2] == (len(group.positions), views * group.batch_size)
                for i, k in enumerate(group.positions):
                    assert torch.equal(xg[i], batches[k][0]) and torch.equal(yg[i], batches[k][1])
                    assert all(torch.equal(a, b) for a, b in zip(client_rows(x, y, step, k), batches[k]))


def test_round_mask_by_hand():
    mask = RoundMask([(24, 23), (24, 24, 9), (24, 24)], torch.device("cpu"))
    assert len(mask) == 3 and mask.steps == (2, 3, 2)
    assert [mask.full(t) for t in range(3)] == [True, False, False]
    assert mask.count == [3, 3, 1]
    assert [g.tolist() for g in mask.index[1]] == [[1, 2], [0]]
    assert mask.stepping[2].tolist() == [False, True, False] and mask.idle[2].tolist() == [0, 2]
    assert mask.idle[0].tolist() == []


# -- end to end --------------------------------------------------------------------------------------------------
def train_scalars(save_dir, seed):
    events = EventAccumulator(str(save_dir / "quickstart" / f"seed{seed}" / "version_0"))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"] if tag.startswith("train/")}


def fits(data_root, tmp_path, capsys, caplog, model, *extra, seed_list=("0",)):
    """The same runs sequential (``fedrcl fit``, clients one after another; seeds ``seed_list``), batched (seed 0),
    and seeds 0 and 1 trained together; asserts no fallback; returns the folders."""
    caplog.set_level("INFO")
    common = (*UNEQUAL, *extra)
    runs = {"seq": ("off", seed_list), "batched": ("on", ("0",))}
    for name, (batching, which) in runs.items():
        seeds.main(["--seeds", *which, *args(data_root, tmp_path / name, *common, "--trainer.client_batching",
                                             batching, rounds=2, model=model)])
    assert FALLBACK not in caplog.text  # batched, every round
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, tmp_path / "together", *common, rounds=2,
                                                         model=model)])
    assert "--together:" not in capsys.readouterr().out  # trained together
    return tmp_path / "seq", tmp_path / "batched", tmp_path / "together"


def assert_runs_equal(a, b, seed, tolerance=1e-9):
    ca, cb = last(a, seed), last(b, seed)
    assert relative_difference(ca["state_dict"], cb["state_dict"]) <= tolerance
    assert ca["global_step"] == cb["global_step"]  # every client's own local steps
    sa, sb = train_scalars(a, seed), train_scalars(b, seed)
    assert sa.keys() == sb.keys() and "train/loss" in sa
    for tag in sa:
        assert sa[tag] == pytest.approx(sb[tag], rel=tolerance), tag


def test_unequal_clients_train_batched_and_together_equal_to_sequential(data_root, tmp_path, capsys, caplog):
    """FedAvg on unequal clients: batched equals sequential, each seed trained together equals its own fit (final
    weights 1e-9 relative, float64; train/loss and the other scalars; global_step), no fallback. The rounds really
    are masked: the clients differ in steps and in last batch sizes."""
    from fedrcl.lightning_cli import build_cli

    seq, batched, together = fits(data_root, tmp_path, capsys, caplog, "fedrcl.algorithms.FedAvg",
                                  seed_list=("0", "1"))
    for seed in (0, 1):
        assert_runs_equal(together, seq, seed)
    assert_runs_equal(batched, seq, 0)
    assert relative_difference(last(together, 0)["state_dict"], last(together, 1)["state_dict"]) > 1e-2
    cli = build_cli(args(data_root, tmp_path / "plan", *UNEQUAL, rounds=2), run=False)
    dm = cli.datamodule
    dm.setup("fit")
    sizes = [dm.client_batch_sizes(k, 2) for k in range(dm.num_clients)]
    assert len({len(s) for s in sizes}) > 1 and len({s[-1] for s in sizes}) > 1
    for k in (0, 1):  # the data module's sizes are its batches'
        assert tuple(len(b[1]) for b in dm.client_batches(k, 0, 2, 0)) == sizes[k]


@pytest.mark.parametrize("method", [("fedrcl.algorithms.FedNova", "--config", "configs/methods/fednova.yaml"),
                                    ("fedrcl.algorithms.FedSAM", "--model.init_args.rho", "0.1"),
                                    ("fedrcl.algorithms.SCAFFOLD", "--config", "configs/methods/scaffold.yaml"),
                                    ("semantics_methods.CountsOwnSteps",)],
                         ids=["FedNova", "FedSAM", "SCAFFOLD", "CountsOwnSteps"])
def test_fednova_and_a_step_hook_method_train_masked(data_root, tmp_path, capsys, caplog, monkeypatch, method):
    """FedNova (it normalises by each client's own step count), FedSAM (``client_direction``: two gradients per
    step), SCAFFOLD (each client's own lr sum in its tensors) and ``CountsOwnSteps`` (a step that changes its
    client's tensors, which its end checks against its planned steps) train batched and together on unequal
    clients, no fallback, equal to sequential (float64, 1e-9)."""
    from conftest import REPO

    monkeypatch.chdir(REPO)
    model, *extra = method
    seq, batched, together = fits(data_root, tmp_path, capsys, caplog, model, *extra)
    assert_runs_equal(batched, seq, 0)
    assert_runs_equal(together, seq, 0)


def test_client_lr_per_local_epoch(data_root, tmp_path, capsys, caplog):
    """A client lr that depends on the local epoch (``local_lr_decay``): clients in different epochs at one step
    need different lrs. The stacked engine gives each client its own, batched and together, no fallback: each
    equal to its fit (1e-9)."""
    decay = ("--model.init_args.local_lr_decay", "0.5")
    seq, batched, together = tmp_path / "seq", tmp_path / "batched", tmp_path / "together"
    common = (*UNEQUAL, *decay)
    seeds.main(["--seeds", "0", *args(data_root, seq, *common, "--trainer.client_batching", "off", rounds=2)])
    caplog.set_level("INFO")
    seeds.main(["--seeds", "0", *args(data_root, batched, *common, "--trainer.client_batching", "on", rounds=2)])
    assert FALLBACK not in caplog.text
    seeds.main(["--seeds", "0", "1", "--together", *args(data_root, together, *common, rounds=2)])
    assert "--together:" not in capsys.readouterr().out
    assert_runs_equal(together, seq, 0)
    assert_runs_equal(batched, seq, 0)
    plain = tmp_path / "plain"  # the decay matters: without it the weights differ
    seeds.main(["--seeds", "0", *args(data_root, plain, *UNEQUAL, rounds=2)])
    assert relative_difference(last(plain, 0)["state_dict"], last(seq, 0)["state_dict"]) > 1e-3
