"""MOON, FedMLB, FedProc, FedCL, FedRCL last level: losses against their definitions, the per-client state
store, the backbones' level-by-level forward, and each method for 2 rounds through ``fedrcl fit``."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, assert_same_state, run_cli
from fedrcl.algorithms.fedmlb import forward_from, forward_with_maps
from fedrcl.algorithms.fedproc import PrototypeServer
from fedrcl.algorithms.client_state import ClientStateStore, state_nbytes
from fedrcl.losses.branch_distillation import hybrid_branch_losses
from fedrcl.losses.info_nce import info_nce
from fedrcl.losses.model_contrastive import model_contrastive_loss
from fedrcl.losses.prototype_contrastive import class_feature_sums, prototype_contrastive_loss
from fedrcl.models import ResNet18, SmallCNN


def cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


# -- the per-client state store ---------------------------------------------------------------------------
def test_store_round_trips_exactly_and_reads_back_from_disk(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g).double(),
             "h": torch.randn(2, generator=g).bfloat16(), "n": torch.tensor([7, -1], dtype=torch.int64)}
    store = ClientStateStore(tmp_path / "s", max_in_memory=0)  # no cache: every read is from disk
    assert store.get(3) is None and 3 not in store
    original = {k: v.clone() for k, v in state.items()}
    store.put(3, state, round_idx=0)
    state["w"].add_(1.0)  # the store holds a copy
    got = store.get(3)
    assert set(got) == set(state) and store.bytes_in_memory == 0
    for k, v in got.items():
        assert v.dtype == original[k].dtype and torch.equal(v, original[k]), k


def test_store_versions_and_resume_from_a_manifest(tmp_path):
    run1 = ClientStateStore(tmp_path / "run1", max_in_memory=2)
    run1.put(0, {"w": torch.zeros(2)}, round_idx=0)
    run1.put(0, {"w": torch.ones(2)}, round_idx=1)  # nothing committed: the old version goes
    assert [p.name for p in (tmp_path / "run1").iterdir()] == ["client00000_round00001.safetensors"]
    manifest = run1.state_dict()  # a checkpoint after round 1
    run1.put(0, {"w": torch.full((2,), 2.0)}, round_idx=2)  # after the checkpoint: both versions kept
    assert len(list((tmp_path / "run1").iterdir())) == 2
    run2 = ClientStateStore(tmp_path / "run2", max_in_memory=2)  # the resumed run, new folder
    run2.load_state_dict(manifest)
    assert torch.equal(run2.get(0)["w"], torch.ones(2))  # the committed version, not the newer one
    run2.put(0, {"w": torch.full((2,), 3.0)}, round_idx=2)
    assert (tmp_path / "run1" / "client00000_round00001.safetensors").exists()  # never cleans another run
    run2.state_dict()
    assert torch.equal(run2.get(0)["w"], torch.full((2,), 3.0))


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_store_keeps_what_a_checkpoint_elsewhere_refers_to_and_forgets_on_request(tmp_path):
    """A Flower node's store: a superseded version is deleted unless a server checkpoint refers to it
    (``keep``); ``adopt`` with ``None`` follows a manifest in which the client has no state."""
    store = ClientStateStore(tmp_path, max_in_memory=1)
    state = {"w": torch.ones(3)}
    first = store.put(4, state, round_idx=0)
    store.keep([first])
    second = store.put(4, state, round_idx=1)
    third = store.put(4, state, round_idx=2)
    assert first.is_file() and not second.exists() and third.is_file()
    store.adopt({4: None})
    assert store.file(4) is None and store.get(4) is None and third.is_file()


def test_store_follows_a_servers_manifest_keeping_the_named_file_until_another_is_named(tmp_path):
    """A Flower node's store: the version a message names stays when the client trains (its reply may be lost
    and the message sent again); it goes when a later message names the newer one, unless a checkpoint kept
    it; ``None`` (a run resumed from before the client had state) forgets it, the same way."""
    store = ClientStateStore(tmp_path, max_in_memory=1)
    state = {"w": torch.ones(3)}
    first = store.put(4, state, round_idx=0)
    store.follow({4: first})  # round 2's message names round 1's file
    second = store.put(4, state, round_idx=1)
    assert first.is_file() and store.file(4) == second
    store.follow({4: first})  # the same message again: its file is read, not the lost reply's
    assert store.file(4) == first and torch.equal(store.get(4)["w"], state["w"])
    second = store.put(4, state, round_idx=1)
    store.keep([second])  # a server checkpoint took round 2's version
    store.follow({4: second})  # round 3's message: round 1's file goes
    assert not first.exists() and second.is_file()
    third = store.put(4, state, round_idx=2)
    store.follow({4: third})  # round 2's goes no further: the checkpoint refers to it
    assert second.is_file() and third.is_file()
    store.follow({4: None})
    assert store.file(4) is None and store.get(4) is None and not third.exists() and second.is_file()


def test_store_memory_stays_bounded_with_many_clients(tmp_path):
    """500 clients x 1 MiB of state with at most 8 in memory: the cache and the process stay small."""
    store = ClientStateStore(tmp_path / "many", max_in_memory=8)
    one = {"a": torch.randn(192, 1024), "b": torch.randn(64, 1024)}  # 1 MiB
    size = state_nbytes(one)
    before, peak = rss_bytes(), 0
    for client in range(500):
        store.put(client, {k: v + client for k, v in one.items()}, round_idx=0)
        if client % 50 == 0:
            assert store.get(client // 2) is not None
        assert store.bytes_in_memory <= 8 * size
        peak = max(peak, rss_bytes() - before)
    assert len(store) == 500 and len(list((tmp_path / "many").iterdir())) == 500
    assert torch.equal(store.get(123)["b"], one["b"] + 123)
    assert peak < 64 * size, f"RSS grew by {peak / 2**20:.0f} MiB for 500 MiB of client state"


# -- MOON -------------------------------------------------------------------------------------------------
def test_model_contrastive_hand_case():
    z = torch.tensor([[1.0, 0.0]])
    # sim to global 1, to previous 0; t = 0.5: -log(e^2 / (e^2 + 1)) = log(1 + e^-2) = 0.126928
    got = model_contrastive_loss(z, torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 3.0]]), 0.5)
    assert got.item() == pytest.approx(0.126928, abs=1e-6)
    assert model_contrastive_loss(z, z, None).item() == 0.0  # first participation: no negative


def test_model_contrastive_random_against_float64():
    g = torch.Generator().manual_seed(5)
    z, zg, zp = (torch.randn(9, 6, generator=g) for _ in range(3))
    ref = sum(-math.log(math.exp(cos(a, b) / 0.5) / (math.exp(cos(a, b) / 0.5) + math.exp(cos(a, c) / 0.5)))
              for a, b, c in zip(z.double().tolist(), zg.double().tolist(), zp.double().tolist())) / 9
    assert model_contrastive_loss(z, zg, zp, 0.5).item() == pytest.approx(ref, rel=1e-5)


def make(cls, **kwargs):
    model = cls(backbone=lambda c, i, s: SmallCNN(c, i, s, conv_padding=2), num_classes=10, in_channels=1,
                image_size=8, **kwargs)
    model.trainer = SimpleNamespace(optimizers=[])
    return model


def test_moon_uses_the_clients_previous_model_from_the_store(tmp_path):
    from fedrcl.algorithms import MOON
    from fedrcl.contract.context import ClientContext
    from fedrcl.contract.weights import snapshot

    model = make(MOON)
    model.store = ClientStateStore(tmp_path, max_in_memory=1)
    keys = set(model.state_dict())
    ctx = lambda r, k: ClientContext(r, k, 10, 1, 0, snapshot(model.backbone))  # noqa: E731
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    model.on_client_start(ctx(0, 7))
    _, parts = model.client_loss(x, y, model.backbone(x))
    assert not model.has_previous and parts["con"].item() == 0.0
    with torch.no_grad():
        model.backbone.fc2.weight.mul_(0.5)
    model.on_client_end(ctx(0, 7))
    local = snapshot(model.backbone)
    with torch.no_grad():
        model.backbone.fc2.weight.mul_(3.0)  # the next round's global model
    model.on_client_start(ctx(1, 7))
    assert model.has_previous
    for k, v in model.previous.module.state_dict().items():
        assert torch.equal(v, local[k]), k
    out = model.backbone(x)
    _, parts = model.client_loss(x, y, out)
    z_prev = model.previous(x).features[-1]
    expected = model_contrastive_loss(out.features[-1], out.features[-1], z_prev, 0.5)
    assert parts["con"].item() == pytest.approx(expected.item(), rel=1e-6) and parts["con"].item() > 0
    assert set(model.state_dict()) == keys


# -- FedMLB -----------------------------------------------------------------------------------------------
def test_hybrid_branch_losses_hand_case():
    main = torch.tensor([[0.0, 0.0]])
    branch = torch.tensor([[math.log(3.0), 0.0]])  # p_k = [3/4, 1/4], p = [1/2, 1/2]
    ce, kl = hybrid_branch_losses(main, [branch, main], torch.tensor([1]))
    # CE_0 = -log(1/4) = 1.386294, CE_1 = log 2; KL_0 = 3/4 log(3/2) + 1/4 log(1/2) = 0.130812, KL_1 = 0
    assert ce.tolist() == pytest.approx([1.386294, 0.693147], abs=1e-6)
    assert kl.tolist() == pytest.approx([0.130812, 0.0], abs=1e-6)


@pytest.mark.parametrize("t", [1.0, 2.0])
def test_hybrid_branch_losses_random_against_float64(t):
    g = torch.Generator().manual_seed(6)
    main, b1, b2 = (2 * torch.randn(5, 4, generator=g) for _ in range(3))
    y = torch.randint(4, (5,), generator=g)

    def softmax(row, temp=1.0):
        e = [math.exp(v / temp) for v in row]
        return [v / sum(e) for v in e]

    ce_ref, kl_ref = [], []
    for b in (b1, b2):
        ce_ref.append(sum(-math.log(softmax(r)[c]) for r, c in zip(b.double().tolist(), y.tolist())) / 5)
        kl_ref.append(sum(sum(p * math.log(p / q) for p, q in zip(softmax(rb, t), softmax(rm, t)))
                          for rb, rm in zip(b.double().tolist(), main.double().tolist())) / 5)
    ce, kl = hybrid_branch_losses(main, [b1, b2], y, t)
    assert ce.tolist() == pytest.approx(ce_ref, rel=1e-5) and kl.tolist() == pytest.approx(kl_ref, rel=1e-5)


@pytest.mark.parametrize("backbone,x", [(lambda: ResNet18(10, width=8), torch.randn(2, 3, 32, 32)),
                                        (lambda: SmallCNN(10, 1, 8, conv_padding=2), torch.randn(2, 1, 8, 8))])
def test_level_by_level_forward_is_forward_and_grafts(backbone, x):
    torch.manual_seed(0)
    local, other = backbone(), backbone()
    out = local(x)
    stepped, maps = forward_with_maps(local, x)
    assert torch.equal(stepped.logits, out.logits)
    assert all(torch.equal(a, b) for a, b in zip(stepped.features, out.features))
    for k, h in enumerate(maps):  # grafting onto itself at any level gives its own logits
        torch.testing.assert_close(forward_from(local, k, h), out.logits)
    hybrid = forward_from(other, 0, maps[0])  # local stem, then the other network
    h = maps[0]
    for level in range(1, len(other.feature_dims)):
        h = torch.relu(other.forward_level(level, h))
    torch.testing.assert_close(hybrid, other.forward_head(h))


def test_fedmlb_branches_are_zero_kd_at_the_global_weights_and_train_through_the_global_blocks():
    from fedrcl.algorithms import FedMLB
    from fedrcl.contract.context import ClientContext
    from fedrcl.contract.weights import snapshot

    model = make(FedMLB)
    model.on_client_start(ClientContext(0, 0, 10, 1, 0, snapshot(model.backbone)))
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
    loss, parts = model.client_loss(x, y, model.client_forward(x))
    assert parts["hybrid_kd"].item() == pytest.approx(0.0, abs=1e-6)
    assert parts["hybrid_ce"].item() == pytest.approx(parts["ce"].item(), rel=1e-5)
    loss.backward()
    assert model.backbone.conv1.weight.grad is not None
    assert all(p.grad is None for p in model.teacher.module.parameters())


# -- FedProc ----------------------------------------------------------------------------------------------
def test_prototype_contrastive_hand_case_and_missing_classes():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    protos = torch.tensor([[2.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    available = torch.tensor([True, True, False])
    # sample 0: cos [1, 0]; -log(e / (e + 1)) = 0.313262; sample 1 (class 2) has no prototype: left out
    got = prototype_contrastive_loss(z, torch.tensor([0, 2]), protos, available)
    assert got.item() == pytest.approx(0.313262, abs=1e-6)
    assert prototype_contrastive_loss(z, torch.tensor([2, 2]), protos, available).item() == 0.0


def test_prototype_contrastive_random_against_float64():
    g = torch.Generator().manual_seed(7)
    z, protos = torch.randn(8, 5, generator=g), torch.randn(4, 5, generator=g)
    y = torch.randint(4, (8,), generator=g)
    ref = 0.0
    for row, c in zip(z.double().tolist(), y.tolist()):
        s = [cos(row, p) / 0.5 for p in protos.double().tolist()]
        ref += -s[c] + math.log(sum(math.exp(v) for v in s))
    got = prototype_contrastive_loss(z, y, protos, torch.ones(4, dtype=torch.bool), temperature=0.5)
    assert got.item() == pytest.approx(ref / 8, rel=1e-5)


def test_prototype_server_is_the_count_weighted_mean_of_client_means():
    server = PrototypeServer()
    a = class_feature_sums(torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 0, 1]), 3)
    b = class_feature_sums(torch.tensor([[5.0, 0.0]]), torch.tensor([0]), 3)
    server.report(*a)
    server.report(*b)
    server.finish_round()
    # class 0: (1 + 3 + 5) / 3 = 3 (client means 2 and 5, weights 2 and 1); class 1: [0, 2]; class 2: none
    torch.testing.assert_close(server.prototypes[:2], torch.tensor([[3.0, 0.0], [0.0, 2.0]]))
    assert server.available.tolist() == [True, True, False]
    server.report(*class_feature_sums(torch.tensor([[0.0, 4.0]]), torch.tensor([1]), 3))
    server.finish_round()
    torch.testing.assert_close(server.prototypes[:2], torch.tensor([[3.0, 0.0], [0.0, 4.0]]))  # 0 kept


# -- FedCL ------------------------------------------------------------------------------------------------
def test_info_nce_hand_case():
    v1 = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # t = 1; anchor 0: positive (view 2, row 0) cos 1, negatives cos 0 (row 1 of both views):
    # -log(e / (e + 2)) = 0.551445, the same for every anchor by symmetry
    assert info_nce(v1, v1.clone(), temperature=1.0).item() == pytest.approx(0.551445, abs=1e-6)


def test_info_nce_random_against_float64():
    g = torch.Generator().manual_seed(8)
    v1, v2 = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    u = torch.cat([v1, v2]).double().tolist()
    ref = 0.0
    for i in range(10):
        s = {k: cos(u[i], u[k]) / 0.05 for k in range(10) if k != i}
        ref += -s[(i + 5) % 10] + math.log(sum(math.exp(v) for v in s.values()))
    assert info_nce(v1, v2, 0.05).item() == pytest.approx(ref / 10, rel=1e-5)


def test_two_views_keep_the_first_view_and_differ(data_root):
    from fedrcl.data.datamodule import FederatedDataModule

    batches = {}
    for views in (1, 2):
        dm = FederatedDataModule(dataset="digits", root=str(data_root), num_clients=10, batch_size=8, views=views)
        dm.setup("fit")
        batches[views] = next(dm.client_batches(client_id=0, round_idx=0, local_epochs=1, seed=0))
    (x1, y1), (x2, y2) = batches[1], batches[2]
    assert x2.shape[0] == 16 and torch.equal(y2, y1.repeat(2))
    assert torch.equal(x2[:8], x1) and not torch.equal(x2[8:], x1)


# -- end to end -------------------------------------------------------------------------------------------
METHODS = {  # config stem: (class, logged parts)
    "moon": ("MOON", ["ce", "con"]),
    "fedmlb": ("FedMLB", ["ce", "hybrid_ce", "hybrid_kd"]),
    "fedproc": ("FedProc", ["ce", "proto"]),
    "fedcl": ("FedCL", ["ce", "infonce", "infonce_level0", "infonce_level3"]),
    "fedrcl_last_level": ("FedRCL", ["ce", "scl", "penalty", "scl_level3"]),
}


@pytest.mark.parametrize("stem", METHODS)
def test_method_trains_two_rounds(stem, data_root, tmp_path):
    cls, parts = METHODS[stem]
    cli = run_cli(data_root, tmp_path, "--config", str(REPO / "configs" / "methods" / f"{stem}.yaml"),
                  model=f"fedrcl.algorithms.{cls}")
    metrics = cli.trainer.callback_metrics
    assert type(cli.model).__name__ == cls and cli.trainer.current_epoch == 2
    for name in ["train/loss", *(f"train/loss_{p}" for p in parts)]:
        assert name in metrics and torch.isfinite(metrics[name]), name
    assert 0.0 <= metrics["val/acc"].item() <= 1.0
    if stem == "moon":
        assert len(cli.model.store) > 0 and cli.model.store.directory.parent == Path(cli.trainer.log_dir)
    if stem == "fedproc":
        assert cli.model.prototype_server.prototypes.shape == (10, cli.model.backbone.feature_dims[-1])
    if stem == "fedrcl_last_level":
        assert cli.model.levels == [3]


@pytest.mark.parametrize("stem", ["moon", "fedproc"])
def test_stateful_method_resumes_exactly(stem, data_root, tmp_path):
    """MOON reads the interrupted run's client files through its checkpoint; FedProc restores prototypes."""
    cls = METHODS[stem][0]
    extra = ("--config", str(REPO / "configs" / "methods" / f"{stem}.yaml"))
    if stem == "fedproc":  # its schedule depends on T: keep T = 4 in the 2-round first half
        extra += ("--model.anneal_rounds", "4")
    full = run_cli(data_root, tmp_path / "full", *extra, rounds=4, model=f"fedrcl.algorithms.{cls}")
    run_cli(data_root, tmp_path / "split", *extra, rounds=2, model=f"fedrcl.algorithms.{cls}")
    resumed = run_cli(data_root, tmp_path / "split", *extra, "--ckpt_path", "last", rounds=4,
                      model=f"fedrcl.algorithms.{cls}")
    assert_same_state(full.model.state_dict(), resumed.model.state_dict())
    if stem == "moon":  # clients 5 and 6 (round 0 only) are still read from the interrupted run's folder
        folders = {Path(p).parent.parent.name for p in resumed.model.store.state_dict()["files"].values()}
        assert folders == {"version_0", "version_1"}
