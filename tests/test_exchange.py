"""The exchange hooks, declared once (``fedrcl.contract.exchange``), checked before training on every backend."""
from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from fedrcl.contract.exchange import ClientExchange, ServerExchange, check_method
from fedrcl.server import FedAvg as FedAvgServer
from fedrcl.server import SCAFFOLD as ScaffoldServer


class Sender(ClientExchange):
    def extra_download(self, client):
        return {"p": torch.zeros(1)}


class Receiver(Sender):
    def load_download(self, client, extra):
        pass


class Misspelt(ClientExchange):
    def recieve_upload(self, client, upload):
        pass


class BroadcastOnly(FedAvgServer):
    def extra_broadcast(self, client):
        return {"c": torch.zeros(1)}


def test_a_sender_needs_its_receiving_end():
    with pytest.raises(ValueError, match="model Sender defines extra_download but not load_download"):
        check_method(Sender(), FedAvgServer())
    check_method(Receiver(), FedAvgServer())
    with pytest.raises(ValueError, match="trainer.server BroadcastOnly defines extra_broadcast but not load_broadcast"):
        check_method(ClientExchange(), BroadcastOnly())


def test_a_name_like_a_hook_is_refused_with_the_hook_it_resembles():
    with pytest.raises(ValueError, match="recieve_upload, which is not an exchange hook: did you mean receive_upload"):
        check_method(Misspelt(), FedAvgServer())


def test_a_receiver_alone_is_allowed():
    """FedDyn's server half needs only the client's facts: ``receive_upload`` without ``extra_upload``."""
    class CountsOnly(ClientExchange):
        def receive_upload(self, client, upload):
            pass

    check_method(CountsOnly(), FedAvgServer())


def test_the_shipped_methods_and_servers_pass_the_check():
    import inspect

    import fedrcl.algorithms as algorithms
    import fedrcl.server as servers

    for _, cls in inspect.getmembers(algorithms, inspect.isclass):
        if issubclass(cls, ClientExchange):
            obj = cls.__new__(cls)  # the check reads the class only
            half = cls.server_half[0]() if cls.server_half else FedAvgServer()
            check_method(obj, half)
    for _, cls in inspect.getmembers(servers, inspect.isclass):
        if issubclass(cls, ServerExchange):
            check_method(ClientExchange(), cls.__new__(cls))


def test_a_method_needs_its_server_half():
    from fedrcl.algorithms import SCAFFOLD

    with pytest.raises(ValueError, match="needs trainer.server fedrcl.server.SCAFFOLD .* configs/methods/scaffold.yaml"):
        check_method(SCAFFOLD.__new__(SCAFFOLD), FedAvgServer())
    check_method(SCAFFOLD.__new__(SCAFFOLD), ScaffoldServer())


@pytest.mark.parametrize("model, message", [
    ("exchange_methods.HalfPair", "HalfPair defines extra_upload but not receive_upload"),
    ("exchange_methods.MisspeltHook", "extra_uplaod, which is not an exchange hook: did you mean extra_upload"),
])
def test_fedrcl_fit_refuses_a_broken_exchange_before_training(data_root, tmp_path, model, message):
    with pytest.raises(ValueError, match=message):
        run_cli(data_root, tmp_path, model=model)
    assert not list(tmp_path.rglob("*.ckpt"))  # no round trained


def test_importing_the_round_facts_and_the_exchange_does_not_load_lightning():
    """What a method's hooks and the round need (``ClientContext``, the exchange, the round, the weights) is
    imported without the Trainer: a fresh interpreter imports them and finds no Lightning module loaded."""
    import subprocess
    import sys

    code = ("import sys, fedrcl.contract.context, fedrcl.contract.exchange, fedrcl.federated.round, "
            "fedrcl.contract.weights; from fedrcl.federated import ClientContext; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
