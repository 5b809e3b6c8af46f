"""A Flower deployment on this machine: a SuperLink and N SuperNodes as real processes, then ``flwr run``.

    python -m fedrcl.flower.localhost --nodes 2 --config configs/quickstart.yaml [fedrcl fit flags ...]

does what docs/flower.md's deployment commands do by hand: ``flower-superlink --insecure`` on a free port,
``flower-supernode --insecure --node-config "partition-id=i num-partitions=N"`` for each node (node i serves
clients i, i + N, ...), a Flower config (``FLWR_HOME``) naming that SuperLink, and ``flwr run
examples/flower_app localhost --stream`` with the fedrcl arguments (made absolute) as the run config. Every
process is started in its own session and its whole process group is ended on exit, whatever happens.
Telemetry and the update check are off (``FLWR_TELEMETRY_ENABLED=0``, ``FLWR_DISABLE_UPDATE_CHECK=1``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from fedrcl.flower.config import Args, as_args

APP = Path(__file__).resolve().parents[2] / "examples" / "flower_app"
QUIET = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
PROMPT = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"}  # a node's ClientApp starts within 0.1 s of a message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def absolute(args: list[str]) -> list[str]:
    """``args`` with every existing relative path made absolute (the ServerApp runs in another folder)."""
    return [str(Path(a).resolve()) if not a.startswith("-") and Path(a).exists() else a for a in args]


class LocalDeployment:
    """A SuperLink and ``nodes`` SuperNodes on localhost (a context manager; ``run`` submits a fedrcl run).

    Args:
        nodes: SuperNodes; node i serves clients i, i + nodes, ...
        workdir: folder of the processes' logs and the Flower config (default: a new temporary folder).
        env: extra environment of every process (e.g. ``OMP_NUM_THREADS``).
        run_config: Flower run config of every run besides ``fedrcl-args`` (e.g. ``{"node-restart-wait": 60}``).
    """

    def __init__(self, nodes: int = 2, workdir: Optional[Path] = None, env: Optional[dict] = None,
                 run_config: Optional[dict] = None):
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self.nodes, self.run_config = nodes, dict(run_config or {})
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="fedrcl-flower-"))
        self.port = free_port()
        self.env = {**os.environ, **QUIET, **PROMPT, **(env or {}), "FLWR_HOME": str(self.workdir / "flwr_home")}
        self.processes: list[subprocess.Popen] = []
        self.supernodes: dict[int, subprocess.Popen] = {}  # partition -> its SuperNode now

    def _start(self, name: str, command: list[str]) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "w") as log:
            self.processes.append(subprocess.Popen(command, cwd=self.workdir, env=self.env, stdout=log,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
        return self.processes[-1]

    def start_node(self, partition: int) -> None:
        """Start the SuperNode of ``partition`` (again, after ``stop_node``: as a supervisor would); each start
        logs to its own file, ``supernode<partition>.log``, then ``supernode<partition>.1.log``, ..."""
        starts = len(list(self.workdir.glob(f"supernode{partition}.*log")))
        name = f"supernode{partition}" + (f".{starts}" if starts else "")
        self.supernodes[partition] = self._start(name, [
            "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{self.port}", "--port", str(free_port()),
            "--node-config", f"partition-id={partition} num-partitions={self.nodes}"])

    def stop_node(self, partition: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the SuperNode of ``partition`` and the processes it started (its process group), and
        wait for the SuperNode to end (``subprocess.TimeoutExpired`` after 30 s)."""
        _end(self.supernodes.pop(partition), sig)

    def __enter__(self) -> "LocalDeployment":
        home = self.workdir / "flwr_home"
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(f'[superlink]\ndefault = "localhost"\n\n[superlink.localhost]\n'
                                          f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')
        try:
            self._start("superlink", ["flower-superlink", "--insecure", "--port", str(self.port),
                                      "--disable-runtime-dependency-installation"])
            deadline = time.monotonic() + 60
            while socket.socket().connect_ex(("127.0.0.1", self.port)) != 0:
                if time.monotonic() > deadline or self.processes[0].poll() is not None:
                    raise RuntimeError(f"the SuperLink did not start: {self.logs()}")
                time.sleep(0.2)
            for i in range(self.nodes):
                self.start_node(i)
        except BaseException:
            self.__exit__()
            raise
        return self

    def run(self, args: Args, timeout: float = 3600.0) -> str:
        """``flwr run`` the fedrcl arguments ``args`` on these nodes and wait for the end; returns its output."""
        fedrcl_args = shlex.join(absolute(as_args(args)))
        config = " ".join(f"{key}={json.dumps(value)}" for key, value in {**self.run_config,
                                                                          "fedrcl-args": fedrcl_args}.items())
        command = ["flwr", "run", str(APP), "localhost", "--stream", "--run-config", config]
        proc = subprocess.Popen(command, cwd=self.workdir, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"flwr run did not finish in {timeout} s; {self.logs()}") from None
        finally:
            _end(proc)
        started = re.search(r"Successfully started run (\d+)", out)
        if proc.returncode != 0 or started is None:
            raise RuntimeError(f"flwr run failed ({proc.returncode}):\n{out[-4000:]}\n{self.logs()}")
        # `flwr run --stream` exits with 0 whether the run completed or failed: ask the SuperLink.
        status = subprocess.run(["flwr", "ls", "localhost", "--run-id", started.group(1)], cwd=self.workdir,
                                env=self.env, capture_output=True, text=True, timeout=120).stdout
        if "finished:completed" not in status:
            raise RuntimeError(f"run {started.group(1)} did not complete:\n{status}\n{out[-4000:]}\n{self.logs()}")
        return out

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {p.name}:\n{p.read_text()[-chars:]}" for p in sorted(self.workdir.glob("*.log")))

    def __exit__(self, *exc: object) -> None:
        for proc in self.processes:
            _end(proc)
        self.processes = []


def _end(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """End ``proc``'s whole process group (the apps a SuperLink or SuperNode started with it)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedrcl.flower.localhost", description=__doc__.split("\n")[0],
                                     epilog="Every other argument is fedrcl fit's (--config, --trainer.*, ...).")
    parser.add_argument("--nodes", type=int, default=2, help="SuperNodes (default 2)")
    parser.add_argument("--timeout", type=float, default=24 * 3600.0, help="seconds before the run is stopped")
    known, rest = parser.parse_known_args(argv)
    with LocalDeployment(known.nodes) as deployment:
        print(deployment.run(rest, timeout=known.timeout))


if __name__ == "__main__":
    main()
