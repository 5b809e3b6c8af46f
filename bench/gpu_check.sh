#!/usr/bin/env bash
# GPU session script for the device tool: the same command at every call, on a warm machine (calls back to
# back: a machine idle for 30 s goes back). Each call:
#   1. stashes the CIFAR-10 part(s) it carries (.gpudata1/, .gpudata2/, .gpudata3/: one part each, since one
#      call carries at most 64 MiB) under /tmp/parts;
#   2. first call only: installs the carried wheels (.whl/: jsonargparse and its needs, absent there), runs the
#      CUDA tests of the batched path and bench/gpu_round.py (the paper round, bf16, batched + compiled);
#   3. once all parts are there: assembles /tmp/data/cifar10.npz and starts, in the background (setsid), the
#      paper-scale runs: FedAvg, FedSCL, FedRCL on configs/cifar10_a01.yaml (ResNet-18-GN width 64), batched +
#      compiled, bf16-mixed, each stopped after RUN_SECONDS;
#   4. waits WAIT_SECONDS (default 0), then copies the runs' logs and event files into $OUT.
# Prepare here first: bench/gpu_prepare.sh (the wheels in .whl/, the real CIFAR-10 npz in three parts; both
# ignored by git, or every call would carry them all).
# Calls (run tool), back to back:  1) carry [.whl, .gpudata1]  2) carry [.gpudata2]  3) carry [.gpudata3]
#   then  WAIT_SECONDS=500 bash bench/gpu_check.sh  as often as the lease allows; give_back at the end.
set -u
out=${OUT:-/tmp/out}; mkdir -p "$out" /tmp/parts /tmp/data /tmp/runs
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for part in .gpudata*/*.part.*; do [ -f "$part" ] && cp "$part" /tmp/parts/; done
ls /tmp/parts

if [ ! -f /tmp/checked ]; then
  touch /tmp/checked
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  nvidia-smi -L
  python3 -c "import torch, lightning, jsonargparse; print('torch', torch.__version__, lightning.__version__)"
  FEDRCL_TEST_ACCELERATOR=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_batched.py \
    > "$out/pytest_cuda.log" 2>&1
  tail -3 "$out/pytest_cuda.log"
  timeout 330 python3 bench/gpu_round.py --device cuda --precision bf16-mixed > "$out/gpu_round.log" 2>&1
  grep -v -i "warn\|tip\|available" "$out/gpu_round.log" | tail -8
fi

if [ "$(ls /tmp/parts | wc -l)" -ge 3 ] && [ ! -f /tmp/started ]; then
  touch /tmp/started
  cat /tmp/parts/*.part.* > /tmp/data/cifar10.npz || exit 1
  for method in FedAvg FedSCL FedRCL; do
    setsid timeout -s INT "${RUN_SECONDS:-1500}" python3 -m fedrcl.cli fit --config configs/cifar10_a01.yaml \
      --model "fedrcl.algorithms.$method" --data.root /tmp/data --data.download false \
      --data.eval_batch_size 5000 --trainer.accelerator gpu --trainer.precision bf16-mixed \
      --trainer.client_batching on --trainer.compile_clients true --trainer.enable_progress_bar false \
      --trainer.logger.init_args.save_dir /tmp/runs --trainer.logger.init_args.name "r64_${method,,}" \
      > "/tmp/runs/r64_${method,,}.log" 2>&1 < /dev/null &
  done
  echo "started the paper-scale runs"
fi

sleep "${WAIT_SECONDS:-0}"
for name in r64_fedavg r64_fedscl r64_fedrcl; do
  [ -f "/tmp/runs/$name.log" ] || continue
  cp "/tmp/runs/$name.log" "$out/$name.log"
  event=$(ls -t /tmp/runs/$name/version_*/events.out.tfevents.* 2>/dev/null | head -1)
  [ -n "$event" ] && cp "$event" "$out/$name.tfevents"
  echo "== $name"; grep -v -i "warn\|tip" "/tmp/runs/$name.log" | tail -2
done
