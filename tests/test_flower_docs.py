"""docs/flower.md's deployment block runs as pasted and gives ``fedrcl fit``'s weights.

The ``bash`` block of "A deployment on localhost" is run with bash in a scratch folder that looks like the
repository root (``configs`` and ``examples`` linked), with a timeout; every process it started is ended
on leaving, whatever happens. Its run (FedRCL, the shrunk quickstart, 2 rounds, two SuperNodes under their
restart loops) must end with the final weights of ``fedrcl fit`` on the same arguments, bitwise; each node
must have run one worker (the same process in every round) that built the run once, at the query, and
answered one ``train`` message per round in which the node had clients; the stop step must leave no process
behind.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest
import torch

pytest.importorskip("flwr", reason="Flower is an optional extra: pip install -e '.[flower]'")

from conftest import REPO, run_cli  # noqa: E402
from test_flower import FLOWER_ENV, last_weights  # noqa: E402

from fedrcl.federated.sampling import sample_clients  # noqa: E402


def deployment_block() -> str:
    text = (REPO / "docs" / "flower.md").read_text()
    section = text[text.index("## A deployment on localhost"):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def still_running(pattern: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


@pytest.mark.slow
def test_the_deployment_block_runs_as_pasted_with_fits_weights_and_one_worker_per_node(data_root, tmp_path):
    run_cli(data_root, tmp_path / "fit", rounds=2)  # FedRCL, the quickstart's method, the block's settings
    root = tmp_path / "repo"
    root.mkdir()
    for name in ("configs", "examples"):
        (root / name).symlink_to(REPO / name)
    script = root / "deploy.sh"
    script.write_text("set -e\n" + deployment_block())
    temp = tmp_path / "temp"  # the nodes' temp folder: their default state-dir, their workers' folders
    temp.mkdir()
    env = {**os.environ, **FLOWER_ENV, "TMPDIR": str(temp)}
    proc = subprocess.Popen(["bash", str(script)], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the deployment block did not finish in 600 s:\n{out[-4000:]}")
    finally:
        for pattern in ("superlink 127.0.0.1:39092", "flower-superlink --insecure --port 39092"):
            subprocess.run(["pkill", "-9", "-f", pattern])
    assert proc.returncode == 0, out[-4000:]
    fit = last_weights(tmp_path / "fit" / "quickstart" / "version_0")
    flower = last_weights(root / "deploy" / "runs" / "quickstart" / "version_0")
    for key in fit:
        assert torch.equal(fit[key], flower[key]), key
    assert not still_running("superlink 127.0.0.1:39092"), "the stop step left SuperNodes running"
    workers = sorted((temp / "fedrcl-flower").glob("worker-*/worker.log"))
    assert len(workers) == 2, out[-4000:]
    sampled = [sample_clients(10, 3, 0, r) for r in range(2)]
    for log in workers:
        text = log.read_text()
        assert text.count("serves SuperNode") == 1 and text.count("built the client run") == 1, text
        assert text.count("query message of run") == 1, text
        partition = int(re.findall(r"partition (\d) of 2", text)[0])
        with_clients = sum(any(k % 2 == partition for k in clients) for clients in sampled)
        assert text.count("train message of run") == with_clients, text
