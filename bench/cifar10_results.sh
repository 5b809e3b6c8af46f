#!/usr/bin/env bash
# The CPU-scale CIFAR-10 runs of docs/results.md (real CIFAR-10 copy in ../shared/data).
# Usage: bench/cifar10_results.sh cnn|resnet8 RUN...
#   RUN = CLIENT or CLIENT+SERVER, e.g. fedavg, moon, fedrcl+fedacg
#   CLIENT: fedavg fedscl fedrcl fedrcl_last, or any configs/methods/<name>.yaml (fedprox moon fedlc ...)
#   SERVER: any configs/server/<name>.yaml (fedavgm fedadam fedacg); FedAvg's server when left out
# Each run logs to runs/cifar10_a01_<model>_<RUN with + as _>/ ; one thread per run (two 1-thread runs side
# by side beat one 2-thread run on 2 cores). MONITOR=1 adds the RepresentationMonitor callback (every 5
# rounds, global and last local model) and the suffix _monitor to the run name.
set -euo pipefail
model=$1; shift
for run in "$@"; do
  client=${run%%+*}; server=; [[ $run == *+* ]] && server=${run#*+}
  case $client in
    fedavg) args=(--model fedrcl.algorithms.FedAvg) ;;
    fedscl) args=(--model fedrcl.algorithms.FedSCL) ;;
    fedrcl) args=(--model fedrcl.algorithms.FedRCL) ;;
    fedrcl_last) args=(--model fedrcl.algorithms.FedRCL --model.init_args.levels '[-1]') ;;
    *) [[ -f configs/methods/$client.yaml ]] || { echo "unknown client $client" >&2; exit 2; }
       args=(--config "configs/methods/$client.yaml") ;;
  esac
  if [[ -n $server ]]; then
    [[ -f configs/server/$server.yaml ]] || { echo "unknown server $server" >&2; exit 2; }
    args+=(--config "configs/server/$server.yaml")
  fi
  name="cifar10_a01_${model}_${run/+/_}"
  if [[ ${MONITOR:-0} == 1 ]]; then
    args+=(--trainer.callbacks+=fedrcl.analysis.RepresentationMonitor); name+=_monitor
  fi
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} fedrcl fit --config "configs/cpu/cifar10_a01_${model}.yaml" "${args[@]}" \
    --trainer.logger.init_args.name "$name" ${EXTRA_ARGS:-}
done
