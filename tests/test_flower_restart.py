"""A localhost deployment survives its nodes: a SuperNode killed mid-round and restarted (as a supervisor
would) costs that node's work again and nothing else; one that does not come back (stopped with SIGTERM, it
ends within 30 s) stops the run with its checkpoint, naming the partition and the clients it owed; started
again, the run resumes from that checkpoint. Either way the final weights are those of a ``fedrcl fit`` run
that never stopped. And a run that fails is reported as failed (``flwr run`` exits with 0 either way). Real
processes (one SuperLink and 2 SuperNodes for the module's runs, ``flwr run``), each step bounded by a
timeout; every process group is ended on leaving, whatever happens.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
pytest.importorskip("flwr", reason="Flower is an optional extra: pip install -e '.[flower]'")

from conftest import run_cli  # noqa: E402
from flower_fixtures import started  # noqa: E402
from test_flower import FLOWER_ENV, flower_args, last_weights  # noqa: E402

from fedrcl.flower.localhost import LocalDeployment  # noqa: E402

ROUNDS = 3


def wait_for_round(deployment: LocalDeployment, server_round: int, run: threading.Thread, outcome: dict,
                   timeout: float) -> int:
    """The partition of the first SuperNode whose current log shows Flower's round ``server_round``; fails at
    once, with the run's error, if the run (``in_background``) ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for log in sorted(deployment.workdir.glob("supernode*.log")):
            if f"ROUND {server_round}]" in log.read_text(errors="replace"):
                return int(log.name.removeprefix("supernode").split(".")[0])
        if not run.is_alive():
            pytest.fail(f"the run ended before round {server_round}: {outcome.get('error', outcome.get('out'))}")
        time.sleep(0.2)
    raise AssertionError(f"no SuperNode received round {server_round} within {timeout} s\n{deployment.logs()}")


def in_background(deployment: LocalDeployment, args: list[str]) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["out"] = deployment.run(args, timeout=900)
        except Exception as error:  # the test reads it
            outcome["error"] = error
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> Iterator[LocalDeployment]:
    """The module's deployment: a SuperLink and 2 SuperNodes, started once (seconds of process starts) for
    its runs; a lost node waits 20 s for its node to come back."""
    deployment = started("the module's SuperLink and 2 SuperNodes", lambda attempt: LocalDeployment(
        nodes=2, workdir=tmp_path_factory.mktemp(f"deployment{attempt}"), env=FLOWER_ENV,
        run_config={"node-restart-wait": 20}).__enter__())  # its start ends its processes if it fails
    try:
        yield deployment
    finally:
        if isinstance(deployment, LocalDeployment):
            deployment.__exit__()


@pytest.mark.slow
def test_a_killed_supernode_is_survived_or_named_and_the_weights_are_fits(nodes, data_root, tmp_path):
    """The module docstring's story; the run stopped by a lost node is also the failed run that
    ``LocalDeployment.run`` reports: ``flwr run --stream`` exits with 0 even when the ServerApp fails, so it
    asks the SuperLink for the run's status and raises."""
    args = flower_args(data_root, tmp_path / "flower", "fedavg")
    args[args.index("--model") + 1] = "fedrcl.algorithms.FedRCL"
    args[args.index("--trainer.rounds") + 1] = str(ROUNDS)
    thread, outcome = in_background(nodes, args)
    run_cli(data_root, tmp_path / "fit", rounds=ROUNDS)  # the same run by fedrcl fit, while Flower's starts
    # round 2: a SuperNode killed as it trains and started again a second later: the round sends its
    # message again to the new node, as soon as it answers which partition it serves (its start may outlast
    # the restart wait: Flower may learn of the loss from the heartbeat 36-60 s later; it has node_wait, 600 s)
    victim = wait_for_round(nodes, 2, thread, outcome, timeout=600)
    nodes.stop_node(victim)
    time.sleep(1)
    nodes.start_node(victim)
    # round 3: a SuperNode stopped for good (SIGTERM: it ends within 30 s, and Flower knows it at once);
    # the run stops after the restart wait, with round 2's checkpoint
    victim = wait_for_round(nodes, ROUNDS, thread, outcome, timeout=600)
    nodes.stop_node(victim, signal.SIGTERM)
    thread.join(900)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), RuntimeError), outcome
    error = str(outcome["error"])
    assert "did not complete" in error, error
    assert f"of partition {victim} went away and no node came back for it within 20 s; it owed clients" in error, \
        f"{error}\n{nodes.logs()}"
    checkpoints = tmp_path / "flower" / "quickstart" / "version_0" / "checkpoints"
    assert f"The run stopped after round {ROUNDS - 1}, checkpoint {checkpoints / 'last.ckpt'}" in error
    # back, and resumed from that checkpoint
    nodes.start_node(victim)
    nodes.run([*args, "--ckpt_path", "last"], timeout=900)
    resumed = sorted((tmp_path / "flower" / "quickstart").glob("version_*"))[-1]
    fit, flower = last_weights(tmp_path / "fit" / "quickstart" / "version_0"), last_weights(resumed)
    for key in fit:
        assert torch.equal(fit[key], flower[key]), key


@pytest.mark.slow
def test_sigterm_to_the_serverapp_stops_the_run_after_the_round_checkpointed(nodes, data_root, tmp_path):
    """A deployment's ServerApp (``flwr-serverapp``, the ServerApp in its process's main thread) stopped by SIGTERM
    ends the run after the round in progress, as ``fedrcl fit`` does: the line that says where it stopped and how to
    resume (streamed by ``flwr run``: before, a bare exit lost it), the run's status says why, and that round's
    checkpoint has the weights of a ``fedrcl fit`` of as many rounds."""
    rounds = 30
    args = flower_args(data_root, tmp_path / "flower", "fedavg")
    args[args.index("--trainer.rounds") + 1] = str(rounds)
    args += ["--trainer.checkpoint_every", "100"]  # the stop's checkpoint is not a due one

    def round_two_lines() -> int:  # the SuperNodes' logs hold the module's earlier runs too: count, do not search
        return sum(log.read_text(errors="replace").count("ROUND 2]") for log in nodes.workdir.glob("supernode*.log"))

    before = round_two_lines()
    thread, outcome = in_background(nodes, args)
    deadline = time.monotonic() + 600
    while round_two_lines() == before:  # this run's round 2 has begun
        assert thread.is_alive() and time.monotonic() < deadline, f"{outcome}\n{nodes.logs()}"
        time.sleep(0.2)
    # the newest ServerApp process: this run's (the Flower files share one worker, so no other deployment runs)
    app = subprocess.run(["pgrep", "-n", "-f", "flwr-serverapp"], capture_output=True, text=True).stdout.split()
    assert len(app) == 1, app
    os.kill(int(app[0]), signal.SIGTERM)
    thread.join(300)
    assert not thread.is_alive()
    error = str(outcome.get("error", outcome.get("out")))
    stops = re.findall(r"SIGTERM: The run stopped after round (\d+), checkpoint (\S+);", error)
    assert stops and "did not complete" in error and "SIGTERM after a round" in error, f"{error}\n{nodes.logs()}"
    done = int(stops[0][0])
    assert 2 <= done < rounds
    ckpt = torch.load(tmp_path / "flower" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["epoch"] == done - 1
    straight = run_cli(data_root, tmp_path / "fit", rounds=done, model="fedrcl.algorithms.FedAvg")
    for key, value in straight.model.state_dict().items():
        assert torch.equal(ckpt["state_dict"][key], value), key
