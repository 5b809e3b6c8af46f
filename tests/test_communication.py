"""Bytes and seconds per round (fedrcl.federated.communication): hand-computed sizes, end to end on digits."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_cli
from fedrcl.analysis import load_scalars
from fedrcl.federated.communication import PARTS, RoundLedger, client_traffic, state_bytes

# SmallCNN on 8x8 digits (1 channel, conv padding 2, 10 classes), parameters by layer:
# conv1 1->32 5x5: 800 + 32; conv2 32->64 5x5: 51200 + 64; fc 256->384: 98304 + 384; fc 384->192: 73728 + 192;
# fc 192->10: 1920 + 10.
CNN_PARAMS = 832 + 51264 + 98688 + 73920 + 1930
CNN_BYTES = 4 * CNN_PARAMS  # all float32
CLIENTS, CLASSES, LAST_LEVEL = 3, 10, 192


def test_state_bytes_by_dtype():
    state = {"w": torch.zeros(2, 3), "h": torch.zeros(4, dtype=torch.float16), "n": torch.tensor(7),
             "mask": torch.zeros(5, dtype=torch.bool), "v": torch.zeros(3, dtype=torch.float32)}
    assert state_bytes(state) == {"float32": 36, "float16": 8, "int64": 8, "bool": 5}


def test_client_traffic_adds_what_the_method_and_the_server_send():
    """A client's bytes: the weights and, through the round's downlink and result, every extra."""
    from fedrcl.federated.round import ClientResult, ServerRound
    from fedrcl.contract.exchange import ClientExchange
    from fedrcl.contract.plan import RoundPlan
    from fedrcl.server import FedAvg as FedAvgServer

    class Method(ClientExchange):
        def extra_download(self, client):
            return {"prototypes": torch.zeros(10, 4)}

        def load_download(self, client, extra):
            pass

    class Server(FedAvgServer):
        def extra_broadcast(self, client):
            return {"control": torch.zeros(6, dtype=torch.float64)}

        def load_broadcast(self, client, extra):
            pass

    weights = {"w": torch.zeros(5)}
    upload = {"sums": torch.zeros(10, 4), "counts": torch.zeros(10, dtype=torch.int32)}
    ledger = RoundLedger()
    server_round = ServerRound(Server(), Method(), 0, weights, ledger)  # begins the ledger's round
    plan = RoundPlan(round_idx=0, client_ids=(3,), num_samples=(7,), steps_per_epoch=(1,), local_epochs=1)
    ((client, downlink),) = server_round.configure(plan)
    assert set(downlink.extras) == {"broadcast", "download"}
    server_round.add(client.client_id, ClientResult(weights, upload, None))
    metrics = ledger.comm_metrics()
    assert metrics["comm/down_bytes_float32"] == 20 + 160 and metrics["comm/down_bytes_float64"] == 48
    assert metrics["comm/up_bytes_float32"] == 20 + 160 and metrics["comm/up_bytes_int32"] == 40
    assert client_traffic([weights], [weights]) == ({"float32": 20}, {"float32": 20})


def comm(save_dir: Path, tag: str) -> list[float]:
    return load_scalars(save_dir / "quickstart")[tag][1].tolist()


def run(data_root: Path, save_dir: Path, *extra: str, rounds: int = 2,
        model: str = "fedrcl.algorithms.FedAvg"):
    """A tiny run of run_cli: 10 clients, 3 per round, 1 local epoch."""
    return run_cli(data_root, save_dir, *extra, rounds=rounds, model=model)


@pytest.mark.slow
def test_fedavg_sends_the_state_dict_down_and_up_per_client(data_root, tmp_path):
    run(data_root, tmp_path)
    per_round = CLIENTS * CNN_BYTES
    assert comm(tmp_path, "comm/down_bytes") == [per_round, per_round]
    assert comm(tmp_path, "comm/up_bytes_float32") == [per_round, per_round]
    assert comm(tmp_path, "comm/cumulative_bytes") == pytest.approx([2 * per_round, 4 * per_round])
    scalars = load_scalars(tmp_path / "quickstart")
    parts = [scalars[f"time/{part}_seconds"][1] for part in PARTS]
    assert all(part.min() >= 0 for part in parts)
    assert sum(parts) == pytest.approx(scalars["time/round_wall_seconds"][1], rel=1e-4)
    assert (scalars["time/evaluation_seconds"][1] > 0).all()  # the validation loop
    for tag in ("comm/down_bytes", "comm/cumulative_bytes", "time/round_wall_seconds",
                "time/local_training_seconds"):
        assert scalars[tag][0].tolist() == scalars["val/acc"][0].tolist() == [1, 2], tag  # at the round's own step


@pytest.mark.slow
def test_fedproc_also_counts_its_prototypes(data_root, tmp_path):
    run(data_root, tmp_path, model="fedrcl.algorithms.FedProc")
    report = CLASSES * LAST_LEVEL * 4 + CLASSES * 4  # class feature sums and counts, float32
    prototypes = CLASSES * LAST_LEVEL * 4 + CLASSES  # prototypes (float32) and which exist (bool)
    assert comm(tmp_path, "comm/up_bytes") == [CLIENTS * (CNN_BYTES + report)] * 2
    assert comm(tmp_path, "comm/down_bytes") == [CLIENTS * CNN_BYTES, CLIENTS * (CNN_BYTES + prototypes)]
    assert comm(tmp_path, "comm/down_bytes_bool") == [CLIENTS * CLASSES]  # no prototypes in round 1


@pytest.mark.slow
def test_fedacg_lookahead_and_moon_state_cost_what_fedavg_does(data_root, tmp_path):
    """FedACG broadcasts its look-ahead instead of the model (same size); MOON keeps its state at home."""
    run(data_root, tmp_path, "--trainer.server", "fedrcl.server.FedACG", model="fedrcl.algorithms.MOON")
    assert comm(tmp_path, "comm/down_bytes") == comm(tmp_path, "comm/up_bytes") == [CLIENTS * CNN_BYTES] * 2


@pytest.mark.slow
def test_cumulative_bytes_survive_a_resume(data_root, tmp_path):
    run(data_root, tmp_path, rounds=1)
    run(data_root, tmp_path, "--ckpt_path", "last", rounds=2)
    assert comm(tmp_path, "comm/cumulative_bytes") == pytest.approx([2 * CLIENTS * CNN_BYTES,
                                                                     4 * CLIENTS * CNN_BYTES])
