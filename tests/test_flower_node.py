"""A deployed node: its light ClientApp, its worker (the built run kept between messages), its configuration.

- The ClientApp ``flwr run`` loads (``fedrcl.flower.clientapp``) imports no torch and refuses a bad node
  configuration, naming the key, before starting or building anything.
- The worker's socket takes only its protocol (bytes: protobuf and JSON, never pickles) from a peer that knows
  its key; it exits with its SuperNode, on SIGTERM and when idle; a node's error comes back named.
- On a localhost deployment (SuperLink and SuperNodes as processes): a node with a bad configuration stops
  the run at its query within 30 s, named. (That a deployed node's weights are ``fedrcl fit``'s and that each
  node's worker builds the run once for all rounds is checked on the docs' deployment block,
  ``tests/test_flower_docs.py``.)

Every process is started in a session of its own with a timeout, and ended whatever happens.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is imported
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
pytest.importorskip("flwr", reason="Flower is an optional extra: pip install -e '.[flower]'")

from conftest import REPO, run_in_process_group  # noqa: E402
from flower_fixtures import NotStarted, started  # noqa: E402
from fedrcl.flower import worker  # noqa: E402
from fedrcl.flower.localhost import APP, QUIET, absolute, free_port  # noqa: E402

ENV = {**QUIET, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
BAD = {  # node config -> what the refusal must name
    "partition-id=2 num-partitions=2": "partition-id=2: must be in 0..1 (num-partitions=2)",
    "partition-id=-1 num-partitions=2": "partition-id=-1: must be in 0..1",
    "partition-id=0 num-partitions=0": "num-partitions=0: must be at least 1",
    "partition-id='a' num-partitions=2": "partition-id='a': must be an integer",
    "data-root='{tmp}/missing'": "data-root='{tmp}/missing': does not exist",
    "data-root='{tmp}/file'": "data-root='{tmp}/file': is not a folder",
    "state-dir='{tmp}/file/state'": "state-dir='{tmp}/file/state': cannot be created or written",
    "worker-idle=0": "worker-idle=0: must be a number of seconds above 0",
    "worker='maybe'": "worker='maybe': must be true or false",
}


def args_for(data_root: Path, save_dir: Path, rounds: int, model: str = "fedrcl.algorithms.FedRCL"
             ) -> list[str]:
    """``conftest.run_cli``'s fit arguments (without the subcommand)."""
    return ["--config", str(REPO / "configs" / "quickstart.yaml"), "--model", model,
            "--data.root", str(data_root), "--data.num_clients", "10", "--trainer.accelerator", "cpu",
            "--trainer.logger.init_args.save_dir", str(save_dir), "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.rounds", str(rounds),
            "--trainer.local_epochs", "1", "--trainer.clients_per_round", "3"]


def node_config(text: str) -> dict:
    """``--node-config``'s text as a SuperNode parses it."""
    from flwr.common.config import parse_config_args

    return parse_config_args([text])


# -- the light ClientApp -----------------------------------------------------------------------------------
def test_a_bad_node_config_is_refused_by_the_light_clientapp_naming_the_key(tmp_path):
    """Each bad configuration is refused at the ``query``, named, with no worker started, no state written,
    and torch never imported (a fresh process: the ClientApp's)."""
    (tmp_path / "file").write_text("")
    cases = {config.format(tmp=tmp_path): expected.format(tmp=tmp_path) for config, expected in BAD.items()}
    script = f"""
import json, sys
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from fedrcl.flower.clientapp import client_app
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
errors = {{}}
for text, config in json.loads(sys.argv[1]).items():
    config.setdefault("state-dir", {str(tmp_path / "state")!r})
    content = RecordDict({{"fedrcl.run": ConfigRecord({{"args": []}})}})
    context = Context(run_id=1, node_id=1, state=RecordDict(), run_config={{}}, node_config=config)
    try:
        client_app(Message(content, dst_node_id=1, message_type="query"), context)
    except Exception as error:
        errors[text] = f"{{type(error).__name__}}: {{error}}"
print(json.dumps({{"errors": errors, "torch": "torch" in sys.modules}}))
"""
    configs = {text: node_config(text) for text in cases}
    out = run_in_process_group([sys.executable, "-c", script, json.dumps(configs)], 120, tmp_path,
                               {**os.environ, **ENV})
    result = json.loads(out.strip().splitlines()[-1])
    assert not result["torch"]
    for text, expected in cases.items():
        assert text in result["errors"], f"{text} was not refused"
        error = result["errors"][text]
        assert error.startswith(f"NodeConfigError: node config {expected}"), error
    assert not list((tmp_path / "state").glob("worker-*"))


# -- the worker's socket -----------------------------------------------------------------------------------
@contextmanager
def watched() -> Iterator[subprocess.Popen]:
    """A process for a worker to watch (a stand-in SuperNode), ended on leaving."""
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def worker_pid(folder: Path) -> int:
    return int(re.findall(r"worker pid (\d+) serves", (folder / "worker.log").read_text())[-1])


def ended(pid: int, within: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie: ``worker.start`` made it this process's child) within
    ``within`` seconds."""
    deadline = time.monotonic() + within
    while worker.alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@contextmanager
def a_worker(folder: Path, watch: int, idle: float = 120.0) -> Iterator[int]:
    """A worker for ``folder`` watching ``watch``: its pid; SIGKILLed on leaving if still there."""
    folder.mkdir(mode=0o700, parents=True)
    worker.start(folder, watch, idle).close()
    pid = worker_pid(folder)
    try:
        yield pid
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Unpickled:
    """A pickle that makes a folder when loaded: the worker must never load it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_the_worker_takes_only_its_protocol_from_a_peer_with_its_key(tmp_path):
    folder = tmp_path / "worker-1"
    with watched() as node, a_worker(folder, node.pid) as pid:
        assert folder.stat().st_mode & 0o777 == 0o700
        assert (folder / "authkey").stat().st_mode & 0o777 == 0o600
        with pytest.raises(AuthenticationError):
            Client(str(worker.socket_path(folder)), family="AF_UNIX", authkey=b"not the key")
        marker = tmp_path / "unpickled"
        with worker.connect(folder) as connection:  # a pickle, as Connection.send makes one
            connection.send(Unpickled(marker))
            assert [connection.recv_bytes() for _ in range(2)] == [worker.PROTOCOL, b"error"]
            assert connection.recv_bytes().startswith(b"refused: the first frame is not")
        with worker.connect(folder) as connection:  # the protocol's frames, but not Flower's protobuf
            for frame in (worker.PROTOCOL, b'{"path": [], "age": 1.0}', b"\xff\xfe not a context", b"\x00"):
                connection.send_bytes(frame)
            protocol, status, text = (connection.recv_bytes() for _ in range(3))
            assert (protocol, status) == (worker.PROTOCOL, b"error")
            assert text.startswith(b"refused: not a request of fedrcl-worker/1: DecodeError"), text
        with worker.connect(folder) as connection:  # a header that is not the expected JSON
            for frame in (worker.PROTOCOL, b'{"path": "/x"}', b"", b""):
                connection.send_bytes(frame)
            assert [connection.recv_bytes() for _ in range(3)][1] == b"error"
        assert not marker.exists()
        assert not ended(pid, 0.5)  # it still serves
        log = (folder / "worker.log").read_text()
        assert log.count("refused a request") == 3 and "refused a connection: AuthenticationError" in log


def test_a_peer_that_connects_and_stays_silent_is_dropped_within_seconds(tmp_path):
    """The worker serves one peer at a time: a local process that connects and never answers the key's
    challenge is dropped after ``HANDSHAKE_TIMEOUT`` seconds and the node's ClientApp is served (it waited for
    ever: the node's rounds stopped)."""
    folder = tmp_path / "worker-1"
    with watched() as node, a_worker(folder, node.pid) as pid, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(str(worker.socket_path(folder)))
        time.sleep(0.2)  # the worker takes the silent peer first
        served: list[float] = []

        def clientapp() -> None:
            started = time.monotonic()
            with worker.connect(folder) as connection:
                assert connection is not None
                connection.send_bytes(b"not the protocol")
                assert connection.recv_bytes() == worker.PROTOCOL
            served.append(time.monotonic() - started)

        thread = threading.Thread(target=clientapp, daemon=True)
        thread.start()
        thread.join(timeout=worker.HANDSHAKE_TIMEOUT + 15)
        assert served and served[0] < worker.HANDSHAKE_TIMEOUT + 5, "the ClientApp waited behind a silent peer"
        silent.settimeout(5)
        assert silent.recv(4096)  # the challenge the silent peer never answered ...
        assert silent.recv(4096) == b""  # ... and then the end of its connection
        assert not ended(pid, 0.2)
    assert "dropped a peer: no handshake within 5 s" in (folder / "worker.log").read_text()


def test_a_state_dir_too_long_for_a_unix_socket_gets_a_private_short_one(tmp_path):
    folder = tmp_path / ("long" * 20) / "worker-1"
    with watched() as node, a_worker(folder, node.pid) as pid:
        address = worker.socket_path(folder)
        assert len(str(address)) < 100 and address.is_socket()
        assert address.parent.stat().st_mode & 0o777 == 0o700
        with worker.connect(folder) as connection:
            assert connection is not None
        os.kill(pid, signal.SIGTERM)
        assert ended(pid, 10)
    assert not address.exists()


def test_the_worker_exits_with_its_supernode_on_sigterm_and_when_idle(tmp_path):
    """Its SuperNode's process ends, SIGTERM, ``worker-idle`` seconds without a message: the worker exits and
    removes its socket and key (its log stays)."""
    with watched() as node:
        with a_worker(tmp_path / "worker-a", node.pid) as by_node, \
                a_worker(tmp_path / "worker-b", node.pid) as by_term, \
                a_worker(tmp_path / "worker-c", node.pid, idle=1.0) as by_idle:
            os.kill(by_term, signal.SIGTERM)
            assert ended(by_term, 10)
            assert ended(by_idle, 15)
            node.kill()
            assert ended(by_node, 10)
    for name, reason in (("a", "its SuperNode"), ("b", "SIGTERM"), ("c", "no message for 1 s")):
        folder = tmp_path / f"worker-{name}"
        assert f"exits: {reason}" in (folder / "worker.log").read_text()
        assert not (folder / "socket").exists() and not (folder / "authkey").exists()


def test_a_nodes_error_comes_back_named_and_the_run_is_built_once(data_root, tmp_path, monkeypatch):
    """Through the light ClientApp and a worker: the ``query`` builds the run and answers the node's clients
    and partition; a ``train`` for a client of another node comes back as the node's error, named; a second
    ``train`` (round 2) reuses the built run (one build in the worker's log)."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedrcl.flower.clientapp import client_app
    from fedrcl.flower.config import build

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)
    args = args_for(data_root, tmp_path / "runs", rounds=2, model="fedrcl.algorithms.FedAvg")
    start = build(args).model.backbone.state_dict()
    config = {"partition-id": 1, "num-partitions": 2, "state-dir": str(tmp_path / "state"), "worker-idle": 60}
    context = Context(run_id=3, node_id=1, state=RecordDict(), run_config={}, node_config=config)
    run = ConfigRecord({"args": args})
    folder = worker.folder_of(tmp_path / "state", os.getppid())
    try:
        answer = client_app(Message(RecordDict({"fedrcl.run": run}), dst_node_id=1, message_type="query"),
                            context).content["fedrcl.clients"]
        assert dict(answer) == {"clients": [1, 3, 5, 7, 9], "partition": 1, "partitions": 2}
        broken = {**start, "fc.bias": torch.zeros(3)}  # a shape the model does not have (nor broadcasts to)

        def train(round_idx: int, client: int, sent: dict) -> Message:
            task = ConfigRecord({"round_idx": round_idx, "clients": [client]})
            content = RecordDict({"fedrcl.run": run, "fedrcl.sent": ArrayRecord.from_torch_state_dict(sent),
                                  "fedrcl.round": task})
            return client_app(Message(content, dst_node_id=1, message_type="train"), context)

        with pytest.raises(worker.WorkerError, match=r"ValueError: clients \[0\] are not served by this"):
            train(0, 0, start)
        with pytest.raises(worker.WorkerError, match=r"ClientError: client 1 \(round 1\): ValueError: weights "
                                                     r"'fc.bias': shape \(3,\) does not fit the model's \(10,\)"):
            train(0, 1, broken)
        weights = [train(round_idx, 1, start).content["fedrcl.1.weights"].to_torch_state_dict()
                   for round_idx in (0, 1)]
        assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # round 2 trained again
        log = (folder / "worker.log").read_text()
        assert log.count("built the client run") == 1 and log.count("serves SuperNode") == 1, log
    finally:
        if (folder / "worker.log").exists():
            os.kill(worker_pid(folder), signal.SIGTERM)


# -- localhost deployments --------------------------------------------------------------------------------
def end_group(proc: subprocess.Popen) -> None:
    """End ``proc``'s process group (a SuperNode's SuperExec and ClientApps with it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _reader(stream, lines: list[tuple[float, str]]) -> threading.Thread:
    """A thread that appends each line of ``stream`` with the time it came."""
    def read() -> None:
        for line in stream:
            lines.append((time.monotonic(), line))
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@contextmanager
def superlink_with_nodes(workdir: Path, configs: list[str]
                         ) -> Iterator[tuple[dict, list[list[tuple[float, str]]]]]:
    """A SuperLink and one SuperNode per ``--node-config`` text on localhost: yields the environment of
    ``flwr`` (``FLWR_HOME`` names that SuperLink) and each node's output lines with their times. Every process
    group is ended on leaving."""
    port = free_port()
    home = workdir / "flwr_home"
    home.mkdir(parents=True)
    (home / "config.toml").write_text(f'[superlink]\ndefault = "localhost"\n\n[superlink.localhost]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    env = {**os.environ, **ENV, "FLWR_HOME": str(home)}
    processes, outputs = [], []
    try:
        with open(workdir / "superlink.log", "w") as log:
            command = ["flower-superlink", "--insecure", "--port", str(port),
                       "--disable-runtime-dependency-installation"]
            processes.append(subprocess.Popen(command, cwd=workdir, env=env, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 90
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert time.monotonic() < deadline, (workdir / "superlink.log").read_text()
            time.sleep(0.2)
        for config in configs:
            command = ["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}",
                       "--port", str(free_port()), "--node-config", config]
            node = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            processes.append(node)
            outputs.append([])
            _reader(node.stdout, outputs[-1])
        yield env, outputs
    finally:
        for proc in processes:
            end_group(proc)


BAD_NODES = {  # node config -> what the refusal names; partition 0 is served by a good node beside them
    "partition-id=2 num-partitions=2": "partition-id=2: must be in 0..1 (num-partitions=2)",
    "partition-id=1 num-partitions=2 data-root='{tmp}/missing'": "data-root='{tmp}/missing': does not exist",
}


@pytest.fixture(scope="module")
def refused_run(data_root, tmp_path_factory) -> dict | NotStarted:
    """One SuperLink with a good SuperNode (partition 0) and one SuperNode per ``BAD_NODES`` config (each with
    a state-dir of its own), and one ``flwr run`` on them: its output, each bad node's output lines with their
    times and state-dir, and when ``flwr run`` ended. (One deployment for both bad nodes: the run names every
    node that refused, ``Fleet.discover``.)"""
    def deploy_and_run(attempt: int) -> dict:
        tmp = tmp_path_factory.mktemp(f"bad_nodes{attempt}")
        states = {bad: tmp / f"bad-state{i}" for i, bad in enumerate(BAD_NODES)}
        configs = [f"partition-id=0 num-partitions=2 state-dir='{tmp}/state'",
                   *(bad.format(tmp=tmp) + f" state-dir='{state}'" for bad, state in states.items())]
        with superlink_with_nodes(tmp, configs) as (env, outputs):
            deadline = time.monotonic() + 90  # every node registered, so the run asks all three at its start
            while not all(any("SuperNode ID:" in line for _, line in output) for output in outputs):
                assert time.monotonic() < deadline, "".join(line for output in outputs for _, line in output)
                time.sleep(0.2)
            fedrcl_args = shlex.join(absolute(args_for(data_root, tmp / "runs", 1)))
            command = ["flwr", "run", str(APP), "localhost", "--stream", "--run-config",
                       f"fedrcl-args={json.dumps(fedrcl_args)}"]
            proc = subprocess.Popen(command, cwd=tmp, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            lines: list[tuple[float, str]] = []
            reader = _reader(proc.stdout, lines)
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                pytest.fail("flwr run did not end in 300 s:\n" + "".join(line for _, line in lines[-60:]))
            finally:
                end_group(proc)
            reader.join(timeout=10)
            ended_at = time.monotonic()
        return {"out": "".join(line for _, line in lines), "ended_at": ended_at, "tmp": tmp,
                "nodes": {bad: (outputs[i + 1], states[bad]) for i, bad in enumerate(BAD_NODES)}}

    return started("the module's SuperLink, SuperNodes and flwr run", deploy_and_run)


@pytest.mark.slow
@pytest.mark.parametrize("bad", list(BAD_NODES))
def test_a_bad_node_is_refused_at_its_query_within_30_s_named(refused_run, bad):
    """Beside a good SuperNode, one with a partition id out of range and one with a data root that does not
    exist (``refused_run``): the run stops at their ``query``, within 30 s of each receiving it (no worker
    started, nothing built), and ``flwr run``'s output names each key and its value."""
    out, tmp = refused_run["out"], refused_run["tmp"]
    output, state = refused_run["nodes"][bad]
    node_out = "".join(line for _, line in output)
    received = [t for t, line in output if "Receiving: query message" in line]
    assert received, node_out
    named = BAD_NODES[bad].format(tmp=tmp)
    assert named in out, out[-4000:] + node_out[-4000:]
    ended_in = refused_run["ended_at"] - received[0]
    assert ended_in < 30, f"refused {ended_in:.1f} s after the query"
    assert not list(state.glob("worker-*"))
