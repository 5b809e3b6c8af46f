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
import shlex
import signal
import subprocess
import sys

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
        # fedrcl fit on the block's settings (FedRCL, the quickstart's method) while the block starts
        run_cli(data_root, tmp_path / "fit", rounds=2)
        out, _ = proc.communicate(timeout=600)
        left = still_running("superlink 127.0.0.1:39092")  # what the block's own stop step left, before ours
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the deployment block did not finish in 600 s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:  # the fit failed: the block's processes end here
            os.killpg(proc.pid, signal.SIGKILL)
        for pattern in ("superlink 127.0.0.1:39092", "flower-superlink --insecure --port 39092"):
            subprocess.run(["pkill", "-9", "-f", pattern])
    assert proc.returncode == 0, out[-4000:]
    fit = last_weights(tmp_path / "fit" / "quickstart" / "version_0")
    flower = last_weights(root / "deploy" / "runs" / "quickstart" / "version_0")
    for key in fit:
        assert torch.equal(fit[key], flower[key]), key
    assert not left, f"the stop step left SuperNodes running: {left}"
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


def node_configs_in_the_docs() -> list[str]:
    """Every ``--node-config`` argument and every ``python -m fedrcl.flower.node`` argument in docs/flower.md (its
    code blocks and inline code), as the shell passes it (a loop's ``$i`` as 0)."""
    commands = re.findall(r"`([^`\n]*--node-config[^`\n]*)`", (REPO / "docs" / "flower.md").read_text())
    code = (REPO / "docs" / "flower.md").read_text().replace("\\\n", " ")
    commands += [line for line in code.splitlines() if "`" not in line and (  # a code block's command line
        "--node-config" in line or "fedrcl.flower.node '" in line or 'fedrcl.flower.node "' in line)]
    found = []
    for command in commands:
        words = shlex.split(command.replace("$i", "0"), comments=True)
        found += [words[k + 1] for k, word in enumerate(words[:-1])
                  if word == "--node-config" or words[k - 1:k + 1] == ["-m", "fedrcl.flower.node"]]
    return found


def test_every_node_config_in_the_docs_is_read_by_flowers_parser():
    """As pasted: ``flower-supernode`` reads ``--node-config`` with Flower's ``parse_config_args`` (TOML
    values); an unquoted path (``data-root=/its/data``) made the SuperNode die at its start."""
    from flwr.common.config import parse_config_args

    configs = node_configs_in_the_docs()
    assert len(configs) >= 4 and any("data-root" in c for c in configs), configs
    for config in configs:
        parsed = parse_config_args([config])
        assert parsed["num-partitions"] == 2 and parsed["partition-id"] in (0, 1), config
        assert isinstance(parsed.get("data-root", ""), str), config


def test_the_docs_node_config_check_is_one_line_for_what_flower_cannot_read(tmp_path):
    """``python -m fedrcl.flower.node CONFIG`` (the deployment block runs it before each SuperNode's loop):
    exit status 2 and one line for a string Flower cannot read or a node cannot serve with, 0 for a good one."""
    def check(config: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "TMPDIR": str(tmp_path)}  # its default state-dir
        return subprocess.run([sys.executable, "-m", "fedrcl.flower.node", config], capture_output=True,
                              text=True, timeout=60, env=env)

    unquoted = check(f"partition-id=1 num-partitions=2 data-root={tmp_path}")
    assert unquoted.returncode == 2 and len(unquoted.stderr.strip().splitlines()) == 1, unquoted.stderr
    assert unquoted.stderr.startswith(f"python -m fedrcl.flower.node: error: node config 'partition-id=1 "
                                      f"num-partitions=2 data-root={tmp_path}': not in Flower's format")
    assert 'a string in double quotes, e.g. \'partition-id=0 num-partitions=2 data-root="/its/data"\'' in \
        unquoted.stderr
    missing = check(f'partition-id=1 num-partitions=2 data-root="{tmp_path}/missing"')
    assert missing.returncode == 2 and "data-root=" in missing.stderr and "does not exist" in missing.stderr
    out_of_range = check("partition-id=2 num-partitions=2")
    assert out_of_range.returncode == 2 and "partition-id=2: must be in 0..1" in out_of_range.stderr
    good = check(f'partition-id=1 num-partitions=2 data-root="{tmp_path}"')
    assert good.returncode == 0 and not good.stderr, good.stderr
