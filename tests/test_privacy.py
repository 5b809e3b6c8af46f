"""Differential privacy (``fedrcl.privacy``): clipping and adaptive clipping pinned to their definitions, the
accountant against dp-accounting and a published value, and DP-FedAvg through ``fedrcl fit``."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import assert_same_state, run_cli

dp_accounting = pytest.importorskip("dp_accounting")  # the extra ``fedrcl[dp]``, in ``dev``

from dp_accounting.rdp import RdpAccountant  # noqa: E402

from fedrcl.contract.exchange import ClientExchange  # noqa: E402
from fedrcl.privacy import DPFedAvg  # noqa: E402
from fedrcl.privacy.accounting import ORDERS, RoundMechanism, epsilon, rounds_within  # noqa: E402
from fedrcl.privacy.clipping import adaptive_clip_norm, clip_update, update_norm  # noqa: E402

DP = ("--trainer.privacy", "fedrcl.privacy.DPFedAvg")


# -- clipping: pure functions ---------------------------------------------------------------------------------
def test_clip_update_hand_case():
    sent = {"w": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.0]), "count": torch.tensor(7)}
    weights = {"w": torch.tensor([4.0, 1.0]), "b": torch.tensor([4.0]), "count": torch.tensor(9)}  # delta (3, 0, 4)
    assert update_norm(weights, sent) == 5.0  # integer buffers are not part of the update
    clipped, norm = clip_update(weights, sent, 1.0)
    assert norm == 5.0
    assert torch.equal(clipped["w"], torch.tensor([1.6, 1.0])) and torch.equal(clipped["b"], torch.tensor([0.8]))
    assert torch.equal(clipped["count"], torch.tensor(9))
    same, _ = clip_update(weights, sent, 5.0)
    assert same is weights  # within the norm: what the client sent, bit for bit


def test_clip_update_random_case_against_float64():
    g = torch.Generator().manual_seed(0)
    sent = {k: torch.randn(s, generator=g) for k, s in (("a", (3, 4)), ("b", (5,)))}
    weights = {k: v + torch.randn(v.shape, generator=g) for k, v in sent.items()}
    delta = torch.cat([(weights[k].double() - sent[k].double()).flatten() for k in sent])
    clip = 0.3 * float(delta.norm())
    clipped, norm = clip_update(weights, sent, clip)
    assert norm == pytest.approx(float(delta.norm()), rel=1e-12)
    after = torch.cat([(clipped[k].double() - sent[k].double()).flatten() for k in sent])
    torch.testing.assert_close(after, delta * clip / float(delta.norm()), rtol=1e-6, atol=1e-6)
    assert float(after.norm()) == pytest.approx(clip, rel=1e-6)


def test_adaptive_clip_norm_hand_case():
    # Andrew et al. (2021), geometric update: C exp(-eta (b - gamma)); more unclipped than the target lowers C
    assert adaptive_clip_norm(1.0, 1.0, 0.5, 0.2) == pytest.approx(math.exp(-0.1), rel=1e-15)
    assert adaptive_clip_norm(2.0, 0.0, 0.5, 0.2) == pytest.approx(2.0 * math.exp(0.1), rel=1e-15)
    assert adaptive_clip_norm(3.0, 0.5, 0.5, 0.2) == 3.0


def test_adaptive_clipping_converges_to_its_quantile():
    """Update norms uniform on [0, 10] (a client's update: a vector of that norm): C goes to the target quantile
    (10 gamma) from far above and far below, through the component's own clip and noised count."""
    for gamma, start in ((0.5, 50.0), (0.8, 0.1)):
        dp = DPFedAvg(noise_multiplier=0.0, clip_norm=start, adaptive=True, target_quantile=gamma)
        dp.bind(1000, 100, ClientExchange())
        g = torch.Generator().manual_seed(1)
        sent = {"w": torch.zeros(2, dtype=torch.float64)}
        late = []
        for round_idx in range(300):
            norms = torch.rand(100, generator=g, dtype=torch.float64) * 10
            unclipped = sum(dp.clip({"w": torch.stack([n, torch.zeros((), dtype=torch.float64)])}, sent)[1]
                            for n in norms)
            dp.release({"w": torch.zeros(2, dtype=torch.float64)}, unclipped, seed=0, round_idx=round_idx)
            late += [dp.clip_norm] if round_idx >= 200 else []
        assert sum(late) / len(late) == pytest.approx(10 * gamma, rel=0.05), gamma


# -- accounting ---------------------------------------------------------------------------------------------
def test_epsilon_equals_dp_accountings_own_computation():
    """m of N without replacement, replace-one: the Gaussian on the clipped sum has sensitivity 2 C, so noise
    multiplier z / 2 in dp-accounting's terms; adaptive clipping composes the count's Gaussian."""
    for (n, m, z, rounds, delta, count) in ((100, 10, 1.0, 50, 1e-5, 0.0), (1000, 50, 2.0, 300, 1e-6, 2.5)):
        accountant = RdpAccountant(list(ORDERS), dp_accounting.NeighboringRelation.REPLACE_ONE)
        gaussian = dp_accounting.GaussianDpEvent(z / 2)
        if count:
            gaussian = dp_accounting.ComposedDpEvent([gaussian, dp_accounting.GaussianDpEvent(count)])
        accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(n, m, gaussian), rounds)
        expected = accountant.get_epsilon(delta)
        assert epsilon([(RoundMechanism(z, count, m, n), rounds)], delta) == expected
        # fedrcl's 29 orders give dp-accounting's default 156 orders' epsilon (the module docstring's claim)
        full = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        full.compose(dp_accounting.SampledWithoutReplacementDpEvent(n, m, gaussian), rounds)
        assert expected == pytest.approx(full.get_epsilon(delta), abs=1e-4)
    # two segments (a resume that changed the noise) compose in order
    a, b = RoundMechanism(1.0, 0.0, 10, 100), RoundMechanism(2.0, 0.0, 10, 100)
    accountant = RdpAccountant(list(ORDERS), dp_accounting.NeighboringRelation.REPLACE_ONE)
    for z, rounds in ((1.0, 5), (2.0, 7)):
        accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(
            100, 10, dp_accounting.GaussianDpEvent(z / 2)), rounds)
    assert epsilon([(a, 5), (b, 7)], 1e-5) == accountant.get_epsilon(1e-5)
    assert epsilon([(a, 3)], 1e-5) < epsilon([(a, 4)], 1e-5)
    assert epsilon([(RoundMechanism(0.0, 0.0, 10, 100), 1)], 1e-5) == math.inf


def test_rdp_of_the_sampled_gaussian_reproduces_a_published_epsilon():
    """TensorFlow Privacy's ``compute_dp_sgd_privacy.py`` (its docstring's example): N=60000, batch 256, noise
    multiplier 1.12, 60 epochs, delta 1e-5 "satisfies (2.92, 1e-5)-DP", with RDP orders 1.1..10.9, 12..63 and
    the classic conversion eps = min_a rdp(a) + log(1/delta) / (a - 1). The same RDP from dp-accounting, which
    fedrcl's accountant is built on, gives 2.92; its own (tighter) conversion gives less. Poisson sampling: the
    published example is DP-SGD's; no DP-FedAvg figure under sampling without replacement was found to pin."""
    orders = [1 + x / 10 for x in range(1, 100)] + list(range(12, 64))
    accountant = RdpAccountant(orders)
    steps = math.ceil(60 * 60000 / 256)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(256 / 60000, dp_accounting.GaussianDpEvent(1.12)), steps)
    rdp = accountant._rdp  # the RDP curve itself, for the classic conversion of the published figure
    classic = min(r + math.log(1 / 1e-5) / (a - 1) for a, r in zip(orders, rdp))
    assert round(classic, 2) == 2.92
    assert accountant.get_epsilon(1e-5) < classic


def test_rounds_within_the_budget():
    mechanism = RoundMechanism(1.0, 0.0, 10, 100)
    budget = epsilon([(mechanism, 20)], 1e-5) + 1e-9
    assert rounds_within(mechanism, 1e-5, budget, [], 100) == 20
    assert rounds_within(mechanism, 1e-5, budget, [(mechanism, 5)], 100) == 15
    assert rounds_within(mechanism, 1e-5, 1e9, [], 100) == 100


def test_noise_is_seeded_per_seed_and_round_not_by_the_global_rng():
    mean = {"w": torch.zeros(1000)}

    def noised(seed, round_idx):
        dp = DPFedAvg(noise_multiplier=2.0, clip_norm=0.5)
        dp.bind(100, 10, ClientExchange())
        return dp.release(mean, 0, seed, round_idx)["w"]

    torch.manual_seed(0)
    a = noised(3, 7)
    torch.manual_seed(1)
    assert torch.equal(a, noised(3, 7))
    assert not torch.equal(a, noised(3, 8)) and not torch.equal(a, noised(4, 7))
    assert float(a.std()) == pytest.approx(2.0 * 0.5 / 10, rel=0.1)  # z C / m


# -- bad input ---------------------------------------------------------------------------------------------
def test_bad_privacy_config_is_refused_in_one_line(data_root, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="trainer.privacy.init_args.clip_norm must be > 0"):
        DPFedAvg(clip_norm=0)
    with pytest.raises(ValueError, match="max_epsilon needs noise_multiplier > 0"):
        DPFedAvg(noise_multiplier=0, max_epsilon=3)
    with pytest.raises(ValueError, match="SCAFFOLD's server half"):
        run_cli(data_root, tmp_path / "scaffold", *DP, "--trainer.server", "fedrcl.server.SCAFFOLD", rounds=1,
                model="fedrcl.algorithms.SCAFFOLD")
    with pytest.raises(ValueError, match="max_epsilon 0.5: the first round already spends epsilon"):
        run_cli(data_root, tmp_path / "budget", *DP, "--trainer.privacy.max_epsilon", "0.5", rounds=1)
    monkeypatch.setitem(sys.modules, "dp_accounting", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[dp\]"'):
        DPFedAvg()


# -- through fedrcl fit -------------------------------------------------------------------------------------
def weights(cli) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in cli.model.backbone.state_dict().items()}


def scalars(cli, tag: str) -> list[float]:
    acc = EventAccumulator(str(cli.trainer.logger.log_dir))
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


def test_dp_without_noise_or_clipping_equals_fedavg_bitwise(data_root, tmp_path):
    """Three clients of 479 samples (digits' 1437 split evenly): uniform weights are FedAvg's sample weights."""
    three = ("--data.num_clients", "3", "--model.init_args.lr", "0.05")
    plain = run_cli(data_root, tmp_path / "plain", *three, rounds=2)
    private = run_cli(data_root, tmp_path / "dp", *three, *DP, "--trainer.privacy.noise_multiplier", "0",
                      "--trainer.privacy.clip_norm", "1e6", rounds=2)
    dm = plain.datamodule
    assert len({dm.client_num_samples(k) for k in range(3)}) == 1
    assert_same_state(weights(plain), weights(private))
    assert scalars(private, "privacy/epsilon") == [math.inf, math.inf]
    clipped = run_cli(data_root, tmp_path / "clipped", *three, *DP, "--trainer.privacy.noise_multiplier", "0",
                      "--trainer.privacy.clip_norm", "0.01", rounds=2)
    assert not torch.equal(weights(plain)["fc.weight"], weights(clipped)["fc.weight"])  # the clip does act


def test_clipping_is_per_client_when_clients_are_batched(data_root, tmp_path):
    """Batched clients fold each client's own weights into the round: clipped one by one, as sequentially."""
    args = (*DP, "--trainer.privacy.noise_multiplier", "1.0", "--trainer.privacy.clip_norm", "0.05",
            "--trainer.precision", "64-true", "--data.local_iters_per_epoch", "3",
            "--model", "fedrcl.algorithms.FedAvg")
    seq = run_cli(data_root, tmp_path / "seq", *args, "--trainer.client_batching", "off", rounds=2)
    bat = run_cli(data_root, tmp_path / "bat", *args, "--trainer.client_batching", "on", rounds=2)
    assert bat.trainer.federation.plan(1).batched and not seq.trainer.federation.plan(1).batched
    for key, value in weights(seq).items():
        torch.testing.assert_close(weights(bat)[key], value, rtol=1e-9, atol=1e-11, msg=key)
    assert seq.trainer.federation.privacy.epsilon == bat.trainer.federation.privacy.epsilon


def test_resumed_dp_run_equals_one_that_never_stopped(data_root, tmp_path):
    """Noise, adapted clip norm and epsilon: bitwise on CPU."""
    args = (*DP, "--trainer.privacy.noise_multiplier", "0.8", "--trainer.privacy.clip_norm", "0.5",
            "--trainer.privacy.adaptive", "true")
    full = run_cli(data_root, tmp_path / "full", *args, rounds=4)
    run_cli(data_root, tmp_path / "split", *args, rounds=2)
    resumed = run_cli(data_root, tmp_path / "split", *args, "--ckpt_path", "last", rounds=4)
    assert_same_state(weights(full), weights(resumed))
    a, b = full.trainer.federation.privacy, resumed.trainer.federation.privacy
    assert a.clip_norms == b.clip_norms and len(set(a.clip_norms)) == 4  # adapted every round
    assert a.epsilon == b.epsilon and a.segments == b.segments == [[0.8, 3 / 20, 3, 10, 4]]
    assert scalars(full, "privacy/epsilon")[2:] == scalars(resumed, "privacy/epsilon")
    ckpt = torch.load(Path(resumed.trainer.logger.log_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["callbacks"]["Federation"]["privacy"]["epsilon"] == a.epsilon


def test_max_epsilon_stops_before_the_budget_with_a_checkpoint(data_root, tmp_path, caplog, capsys):
    mechanism = RoundMechanism(1.5, 0.0, 3, 10)
    budget = (epsilon([(mechanism, 2)], 1e-5) + epsilon([(mechanism, 3)], 1e-5)) / 2
    cli = run_cli(data_root, tmp_path / "budget", *DP, "--trainer.privacy.noise_multiplier", "1.5",
                  "--trainer.privacy.max_epsilon", str(budget), rounds=5)
    assert cli.trainer.current_epoch == 2  # rounds done
    ckpt = torch.load(Path(cli.trainer.logger.log_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["callbacks"]["Federation"]["privacy"]["segments"] == [[1.5, 0.0, 3, 10, 2]]
    assert ckpt["callbacks"]["Federation"]["privacy"]["epsilon"] <= budget
    assert "max_epsilon" in caplog.text and "the run stops after round 2" in caplog.text
    printed = capsys.readouterr()
    assert "stopped early after round 2/5: trainer.privacy.init_args.max_epsilon" in printed.out + printed.err
    from fedrcl import report
    report.main([str(tmp_path / "budget"), "--out", str(tmp_path / "report.md")])
    assert "privacy/epsilon mean ± std" in (tmp_path / "report.md").read_text()  # a column for DP runs
    with pytest.raises(ValueError, match="the run stops after round 2"):  # resuming it: the budget is spent
        run_cli(data_root, tmp_path / "budget", *DP, "--trainer.privacy.noise_multiplier", "1.5",
                "--trainer.privacy.max_epsilon", str(budget), "--ckpt_path", "last", rounds=5)


def test_seeds_together_are_each_seeds_own_dp_fit(data_root, tmp_path, capsys):
    """Seeds trained together: each seed's clipping, noise (seeded by its own trainer.seed) and epsilon are those
    of its own ``fedrcl fit`` (float64: the stacked step's rounding stays far below the tolerance)."""
    from fedrcl import seeds
    from conftest import REPO

    common = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--model", "fedrcl.algorithms.FedAvg",
              "--data.root", str(data_root), "--data.num_clients", "10", "--trainer.accelerator", "cpu",
              "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false",
              "--trainer.enable_model_summary", "false", "--trainer.rounds", "2", "--trainer.local_epochs", "1",
              "--data.local_iters_per_epoch", "3", "--trainer.clients_per_round", "3", "--trainer.precision",
              "64-true", *DP, "--trainer.privacy.clip_norm", "0.05", "--trainer.privacy.adaptive", "true"]
    for how in ("together", "alone"):
        seeds.main(["--seeds", "0", "1", *(["--together"] if how == "together" else []), *common,
                    "--trainer.logger.init_args.save_dir", str(tmp_path / how)])
    assert "--together:" not in capsys.readouterr().out  # no fallback
    states = {}
    for how in ("together", "alone"):
        for seed in (0, 1):
            path = tmp_path / how / "quickstart" / f"seed{seed}" / "version_0" / "checkpoints" / "last.ckpt"
            states[how, seed] = torch.load(path, weights_only=True)
    for seed in (0, 1):
        a, b = states["together", seed], states["alone", seed]
        for key, value in b["state_dict"].items():
            torch.testing.assert_close(a["state_dict"][key], value, rtol=1e-9, atol=1e-11, msg=key)
        pa, pb = a["callbacks"]["Federation"]["privacy"], b["callbacks"]["Federation"]["privacy"]
        assert pa["segments"] == pb["segments"] and pa["epsilon"] == pb["epsilon"]
        assert pa["clip_norms"] == pytest.approx(pb["clip_norms"], rel=1e-9)  # adapted from the same counts
    assert not torch.equal(states["alone", 0]["state_dict"]["backbone.fc.weight"],
                           states["alone", 1]["state_dict"]["backbone.fc.weight"])  # seeds differ


def test_a_run_without_dp_is_not_continued_with_it(data_root, tmp_path):
    """Its first rounds would be missing from epsilon: refused, naming trainer.privacy."""
    run_cli(data_root, tmp_path / "plain", rounds=1)
    with pytest.raises(ValueError, match="trainer.privacy"):
        run_cli(data_root, tmp_path / "plain", *DP, "--ckpt_path", "last", rounds=2)
