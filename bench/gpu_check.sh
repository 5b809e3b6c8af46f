#!/usr/bin/env bash
# One-shot GPU check for the device tool: the test suite on CUDA, the round-overhead bench on CUDA, and
# the CIFAR-10 alpha 0.1 curves of docs/results.md (ResNet-18-GN width 8: FedAvg/FedSCL/FedRCL, 100
# rounds; width 64: FedAvg vs FedRCL for as many rounds as fit in RUN_SECONDS).
# Needs, carried beside the tree: .whl/ (jsonargparse wheels; that machine lacks them) and the real
# CIFAR-10 npz split into parts in .gpudata*/ (split -b 60000000; each device call carries at most 64 MiB). Everything lands in $OUT.
set -u
out=${OUT:-/tmp/out}; mkdir -p "$out"
limit=${RUN_SECONDS:-400}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, lightning, jsonargparse; print('torch', torch.__version__, 'lightning', lightning.__version__)"
mkdir -p /tmp/data && cat .gpudata*/cifar10.npz.part* > /tmp/data/cifar10.npz || exit 1

run() {  # name, extra args...
  local name=$1; shift
  timeout -s INT "$limit" python3 -m fedrcl.cli fit --config configs/cpu/cifar10_a01_resnet8.yaml \
    --data.root /tmp/data --trainer.accelerator ${ACCEL:-gpu} --trainer.logger.init_args.save_dir /tmp/runs \
    --trainer.logger.init_args.name "$name" "$@" > "/tmp/$name.log" 2>&1
}
run r8_fedavg --model fedrcl.algorithms.FedAvg &
run r8_fedscl --model fedrcl.algorithms.FedSCL &
run r8_fedrcl --model fedrcl.algorithms.FedRCL &
run r64_fedavg --model fedrcl.algorithms.FedAvg --model.init_args.backbone.init_args.width 64 --trainer.rounds 1000 &
run r64_fedrcl --model fedrcl.algorithms.FedRCL --model.init_args.backbone.init_args.width 64 --trainer.rounds 1000 &

FEDRCL_TEST_ACCELERATOR=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider > "$out/pytest_cuda.log" 2>&1
tail -3 "$out/pytest_cuda.log"
timeout 120 python3 bench/round_overhead.py --device cuda --blocks 2 > "$out/overhead_cuda.log" 2>&1
tail -3 "$out/overhead_cuda.log"
wait
for name in r8_fedavg r8_fedscl r8_fedrcl r64_fedavg r64_fedrcl; do
  cp /tmp/runs/$name/version_0/events.out.tfevents.* "$out/$name.tfevents" 2>/dev/null
  echo "== $name"; grep -v -i "warn\|tip" "/tmp/$name.log" | tail -4
done > "$out/runs.log" 2>&1
cat "$out/runs.log"
