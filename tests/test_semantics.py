"""One semantics on every backend: methods the shipped ones do not resemble (``semantics_methods``) give the
same weights with clients one after another and batched, or are refused, in one line, before any step.

Flower's simulation runs the agreeing ones too (``test_flower.py``'s ``METHODS``: bitwise to ``fedrcl fit``).
"""
from __future__ import annotations

import pytest

from conftest import assert_same_state, run_cli
from test_batched import assert_equal_runs, fit

AGREEING = ["RunningPrior", "StepsWeightedPrior", "ClientFactsLoss", "PerClientTensor", "CountsOwnSteps"]
REFUSED = {  # method: what the refusal names
    "PerClientScale": "on_client_start sets self.scale differently per client",
    "KeepsLoss": "client_loss stores self.last_loss",
    "BranchesOnClient": "client_loss cannot run batched",
    "DataInLoss": "client_loss reads client.data.labels, which batched clients cannot map",
    "UnevenTensors": "the clients' client.tensors differ \\('extra'",
    "LossReplacesTensor": "client_loss replaces client.tensors\\['scale'\\]; a loss keeps no state",
}


@pytest.mark.parametrize("name", AGREEING)
def test_batched_clients_give_the_sequential_weights(data_root, tmp_path, name):
    model = f"semantics_methods.{name}"
    seq = fit(data_root, tmp_path / "seq", "off", model)
    assert_equal_runs(seq, fit(data_root, tmp_path / "bat", "on", model))


def test_what_clients_receive_is_fixed_before_any_upload(data_root, tmp_path):
    """``RunningPrior`` changes its prior in place in ``receive_upload``: each client of a round still trains
    from the prior of the round's start (the second client's downlink is not the first one's upload)."""
    cli = run_cli(data_root, tmp_path, rounds=1, model="semantics_methods.RunningPrior")
    round_ = cli.trainer.federation  # the round is over; replay its configure phase on a fresh round
    from fedrcl.contract import RoundPlan
    from fedrcl.federated.round import ServerRound

    server_round = ServerRound(round_.server, cli.model, 1, cli.model.backbone.state_dict())
    plan = RoundPlan(round_idx=1, client_ids=(0, 1), num_samples=(10, 10), steps_per_epoch=(1, 1), local_epochs=1)
    (_, first), (_, second) = server_round.configure(plan)
    before = cli.model.prior.clone()
    from fedrcl.federated.round import ClientResult
    bias = {"bias": list(cli.model.backbone.parameters())[-1].detach() + 1.0}
    server_round.add(0, ClientResult(dict(cli.model.backbone.state_dict()), bias, None))
    assert not cli.model.prior.equal(before)  # the server's state changed in place ...
    assert_same_state(second.extras["download"], {"prior": before})  # ... what client 1 receives did not
    assert_same_state(first.extras["download"], second.extras["download"])


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_batched_clients_cannot_share_is_refused_before_any_step(data_root, tmp_path, name):
    with pytest.raises(ValueError, match=REFUSED[name]) as refused:
        fit(data_root, tmp_path, "on", f"semantics_methods.{name}")
    assert "\n" not in str(refused.value)
    assert not list(tmp_path.rglob("*.ckpt"))
    fit(data_root, tmp_path / "seq", "off", f"semantics_methods.{name}")  # sequential runs it as written


def test_what_is_per_client_and_what_a_loss_kept_by_hand():
    """The pure checks behind the refusals: values compared by content (a fresh but equal tensor or list is the
    same), a handed-on container reset to an equal one is not kept, a new or rebound attribute is."""
    import torch

    from fedrcl.federated.batched import per_client_attributes, stored_attributes

    shared = torch.ones(3)
    views = [{"anchors": [shared], "scale": 1.0, "counts": torch.tensor([1, 2]), "mu": 0.1},
             {"anchors": [shared.clone()], "scale": 1.01, "counts": torch.tensor([1, 3]), "mu": 0.1}]
    assert per_client_attributes(views) == ["counts", "scale"]
    assert per_client_attributes([{"a": 1}, {"a": 1, "b": 2}]) == ["b"]
    maps: list = []
    before = {"maps": maps, "client": None, "mu": 0.1, "t": shared}
    assert stored_attributes(before, {"maps": [], "client": "another", "mu": 0.1, "t": shared}) == []
    assert stored_attributes(before, {"maps": [], "mu": 0.2, "t": shared.clone(), "last": 1}) == ["last", "mu", "t"]


def test_what_a_step_replaced_in_its_clients_tensors():
    """A tensor rebound, or a dict of tensors with any entry rebound (in place too), is what the step replaced;
    one added or removed is refused, naming it."""
    import torch

    from fedrcl.federated.batched import replaced_tensors

    a, b = torch.zeros(2), {"w": torch.ones(1)}
    given = {"a": a, "b": b}
    assert replaced_tensors("M", "client_direction", given, {"a": a, "b": dict(b)}) == {}
    inner = dict(b)
    inner["w"] = inner["w"] + 1  # the step changed the dict it was handed in place
    assert list(replaced_tensors("M", "client_direction", given, {"a": a + 0, "b": inner})) == ["a", "b"]
    with pytest.raises(ValueError, match=r"model M: client_direction adds client.tensors\['c'\]"):
        replaced_tensors("M", "client_direction", given, {**given, "c": a})
    with pytest.raises(ValueError, match=r"removes client.tensors\['b'\]"):
        replaced_tensors("M", "client_loss", given, {"a": a})
