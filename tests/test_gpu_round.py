"""bench/gpu_round.py at a tiny width on the CPU: it runs all three versions and ends in its speedup line."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO


def test_gpu_round_bench_smoke():
    cmd = [sys.executable, str(REPO / "bench" / "gpu_round.py"), "--device", "cpu", "--width", "2",
           "--clients", "2", "--steps", "5", "--batch", "4", "--test", "64", "--eval-batch", "32", "--rounds", "1",
           "--warmup", "0", "--no-compile", "--methods", "FedRCL"]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"speedup=\d+\.\d\d", lines[-1]), lines[-1]
    pattern = (r"FedRCL: \(a\) raw [\d.]+ s/round; \(b\) sequential [\d.]+ s/round = [\d.]+ x \(a\); "
               r"\(c\) batched [\d.]+ s/round")
    assert any(re.match(pattern, line) for line in lines), done.stdout
    assert any("TFLOP/s" in line for line in lines)
