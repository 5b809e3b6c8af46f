"""The round loop's pieces: sampling, the round plan, aggregation, the FedAvg server step."""
from __future__ import annotations

import pytest
import torch

from fedrcl.federated.aggregation import WeightedSum
from fedrcl.contract.plan import RoundPlan
from fedrcl.federated.sampling import sample_clients
from fedrcl.server import FedAvg


def test_sample_clients_is_seeded_by_round_and_distinct():
    a = sample_clients(100, 5, seed=0, round_idx=3)
    assert a == sample_clients(100, 5, seed=0, round_idx=3)
    assert len(set(a)) == 5 and all(0 <= k < 100 for k in a)
    assert a != sample_clients(100, 5, seed=0, round_idx=4)
    assert a != sample_clients(100, 5, seed=1, round_idx=3)


def test_sample_clients_is_uniform():
    counts = torch.zeros(10)
    for r in range(2000):
        counts[sample_clients(10, 3, seed=0, round_idx=r)] += 1
    assert counts.sum() == 6000
    assert (counts - 600).abs().max() < 90  # about 4 standard deviations of a binomial(2000, 0.3)


def test_sample_clients_rejects_too_many():
    with pytest.raises(ValueError, match="clients_per_round"):
        sample_clients(4, 5, seed=0, round_idx=0)


def test_round_plan_locates_client_boundaries():
    plan = RoundPlan(round_idx=0, client_ids=(7, 2), num_samples=(30, 50), steps_per_epoch=(2, 3), local_epochs=2)
    assert plan.steps == (4, 6) and plan.total_steps == 10
    first = plan.locate(0)
    assert (first.client_id, first.step, first.local_epoch, first.first_step_of_epoch) == (7, 0, 0, True)
    assert plan.locate(2).local_epoch == 1 and plan.locate(2).first_step_of_epoch
    assert plan.locate(3).last_step_of_client and plan.locate(3).client_id == 7
    second = plan.locate(4)
    assert (second.client_id, second.step, second.position) == (2, 0, 1)
    assert plan.locate(7).first_step_of_epoch and plan.locate(7).local_epoch == 1
    assert plan.locate(9).last_step_of_client and not plan.locate(8).last_step_of_client
    with pytest.raises(IndexError):
        plan.locate(10)


def test_weighted_sum_matches_float64_formula():
    gen = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen),
               "count": torch.tensor(k)} for k in range(5)]
    weights = [3.0, 1.0, 7.0, 2.0, 5.0]
    acc = WeightedSum(states[0])
    for state, weight in zip(states, weights):
        acc.add(state, weight)
    mean = acc.mean()
    assert set(mean) == {"w", "b"}  # integer buffers are never averaged
    for key in ("w", "b"):
        expected = sum(w * s[key].double() for s, w in zip(states, weights)) / sum(weights)
        torch.testing.assert_close(mean[key].double(), expected, rtol=1e-6, atol=1e-6)


def test_weighted_sum_hand_case_and_reduce():
    acc = WeightedSum({"w": torch.zeros(2)})
    acc.add({"w": torch.tensor([1.0, 2.0])}, 1.0)
    acc.add({"w": torch.tensor([4.0, 8.0])}, 2.0)
    torch.testing.assert_close(acc.mean()["w"], torch.tensor([3.0, 6.0]))
    # Two processes holding the same partial sums: an all-reduce-sum leaves the mean unchanged.
    torch.testing.assert_close(acc.mean(reduce=lambda t: 2 * t)["w"], torch.tensor([3.0, 6.0]))


def test_weighted_sum_without_clients_is_an_error():
    with pytest.raises(RuntimeError, match="no client"):
        WeightedSum({"w": torch.zeros(2)}).mean()


def test_fedavg_server_takes_client_mean_and_keeps_integer_buffers():
    global_state = {"w": torch.zeros(2), "count": torch.tensor(5)}
    new = FedAvg().step(global_state, global_state, {"w": torch.tensor([1.0, -1.0])})
    torch.testing.assert_close(new["w"], torch.tensor([1.0, -1.0]))
    assert new["count"].item() == 5
