#!/usr/bin/env bash
# The CPU-scale CIFAR-10 runs of docs/results.md (real CIFAR-10 copy in ../shared/data).
# Usage: bench/cifar10_results.sh cnn|resnet8 METHOD...   (METHOD: fedavg fedscl fedrcl fedrcl_last)
# Each run logs to runs/cifar10_a01_<model>_<method>/ ; one thread per run (two 1-thread runs side by side
# beat one 2-thread run on 2 cores).
set -euo pipefail
model=$1; shift
for method in "$@"; do
  case $method in
    fedavg) args=(--model fedrcl.algorithms.FedAvg) ;;
    fedscl) args=(--model fedrcl.algorithms.FedSCL) ;;
    fedrcl) args=(--model fedrcl.algorithms.FedRCL) ;;
    fedrcl_last) args=(--model fedrcl.algorithms.FedRCL --model.init_args.levels '[-1]') ;;
    *) echo "unknown method $method" >&2; exit 2 ;;
  esac
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} fedrcl fit --config "configs/cpu/cifar10_a01_${model}.yaml" "${args[@]}" \
    --trainer.logger.init_args.name "cifar10_a01_${model}_${method}" ${EXTRA_ARGS:-}
done
