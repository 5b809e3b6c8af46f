"""Shared fixtures: a digits npz built once per session, and a helper that runs the CLI in-process."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from fedrcl.cli import build_cli

REPO = Path(__file__).resolve().parents[1]
# FEDRCL_TEST_ACCELERATOR=cuda runs the end-to-end tests on a GPU; default CPU.
ACCELERATOR = os.environ.get("FEDRCL_TEST_ACCELERATOR", "cpu")


def assert_same_state(a: dict, b: dict) -> None:
    """Resume equality: bitwise on CPU (the reproducibility guarantee); close on CUDA, whose convolution
    and pooling backward kernels are not deterministic."""
    assert a.keys() == b.keys()
    for key, value in a.items():
        if ACCELERATOR == "cpu":
            assert torch.equal(value, b[key]), key
        else:
            torch.testing.assert_close(value, b[key], rtol=1e-3, atol=1e-4, msg=key)


def pytest_configure(config):
    """Each pytest-xdist worker (setup.cfg: ``-n 2``) computes on one thread: two workers on two cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


def work_unit(nodeid: str) -> str:
    """The unit a pytest-xdist worker receives whole: a test file, or all the files that start Flower
    deployments (``test_flower*``, ``test_secagg``) together."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    return "flower" if name.startswith("test_flower") or name == "test_secagg.py" else path


# Seconds each unit of 15 s or more took (2026-11-29, ``pytest -n 0 --durations=0``, one busy core; measured
# again 2026-12-02 the same way, load 2-6: check, gpu_lease, multiprocess, docs, types (mypy from an empty
# cache, as in CI), and together and data_sources from a loaded run's durations divided by its 3x load; 2026-12-07:
# baselines_2026_backends and flower's seven more runs, from a run at load 2): the
# workers take them first, longest first, so that none starts alone near the end (xdist's own order, most
# tests first, left mypy's single test and the notebooks last). Other files follow in xdist's order; a stale
# figure costs time, never a test.
UNIT_SECONDS = {"flower": 490, "tests/test_client_direction.py": 110, "tests/test_check.py": 108,
                "tests/test_baselines_2026_backends.py": 75,
                "tests/test_gpu_lease.py": 95, "tests/test_reliability.py": 84, "tests/test_multiprocess.py": 59,
                "tests/test_scaffold_feddyn.py": 57, "tests/test_batched.py": 55, "tests/test_together.py": 50,
                "tests/test_bad_input.py": 48, "tests/test_types.py": 46, "tests/test_sweep.py": 40,
                "tests/test_first_contact.py": 35, "tests/test_docs.py": 30, "tests/test_backbones.py": 29,
                "tests/test_cli.py": 28, "tests/test_data_sources.py": 25, "tests/test_seeds.py": 22,
                "tests/test_baselines_more.py": 20, "tests/test_docs_pages.py": 17, "tests/test_baselines.py": 15}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Each worker runs whole files, so module fixtures run once; the Flower files share one worker, so their
    SuperLinks, SuperNodes and Ray never run side by side; the longest units go first (``UNIT_SECONDS``).
    (xdist's own ``loadgroup`` marks group by a nodeid suffix that pytest 9.2 no longer reads: every test
    became its own unit.) An explicit ``--dist`` other than xdist's default ``load`` is left to xdist."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not any(self.assigned_work.values()):  # the first assignment: the queue holds every unit
                self.workqueue = OrderedDict(sorted(self.workqueue.items(),
                                                    key=lambda unit: -UNIT_SECONDS.get(unit[0], 0)))
            super()._assign_work_unit(node)

    return FileScheduling(config, log)


@pytest.fixture(autouse=True)
def lightning_logs_reach_caplog(monkeypatch):
    """Lightning's logger propagates to the root logger (where ``caplog`` listens) only if the root had no
    handler when Lightning was imported, which depends on test order; make it always propagate."""
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    from fedrcl.data.datasets import load_dataset

    root = tmp_path_factory.mktemp("data")
    load_dataset("digits", root)
    return root


def run_cli(data_root: Path, save_dir: Path, *extra: str, subcommand: str = "fit", rounds: int = 2,
            model: str = "fedrcl.algorithms.FedRCL"):
    """Run ``fedrcl <subcommand>`` on the quickstart config shrunk to a few seconds; returns the CLI."""
    torch.set_num_threads(1)
    args = [subcommand, "--config", str(REPO / "configs" / "quickstart.yaml"),
            "--model", model,
            "--data.root", str(data_root), "--data.num_clients", "10",
            "--trainer.accelerator", ACCELERATOR,
            "--trainer.logger.init_args.save_dir", str(save_dir),
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    if subcommand == "fit":
        args += ["--trainer.rounds", str(rounds), "--trainer.local_epochs", "1", "--trainer.clients_per_round", "3"]
    return build_cli([*args, *extra])


def run_in_process_group(command: list[str], timeout: float, cwd: Path, env: dict) -> str:
    """Run ``command`` in a session of its own and return its output; a hang past ``timeout`` fails the test,
    and the whole group (Lightning's second process, Ray's workers) is ended whatever happens."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{command[:3]} did not finish in {timeout} s (hang?):\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-6000:]
    return out


def signal_in_round_1(monkeypatch, seed: int = 0) -> None:
    """SIGTERM to this process at the end of ``seed``'s round 1, once the command's handler has recorded it."""
    from fedrcl.federated.preemption import Preemption

    original = Preemption.on_train_epoch_end

    def signalled(self, trainer, pl_module):
        if trainer.federation.seed == seed and trainer.current_epoch == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            stop, deadline = signal.getsignal(signal.SIGTERM).__self__, time.monotonic() + 10
            while stop.signum is None and time.monotonic() < deadline:
                time.sleep(0.01)
        original(self, trainer, pl_module)

    monkeypatch.setattr(Preemption, "on_train_epoch_end", signalled)
