#!/usr/bin/env bash
# Issue 55's CPU sweep: FedAvg, FedProx, FedLC and FedRCL on configs/cpu/cifar10_a01_cnn.yaml with 10% of each
# client's samples held out for validation, 3 client learning rates x (for the three with one) 3 values of the
# method's own weight, 2 seeds, 100 rounds; then each method's setting chosen on validation and its test
# accuracy (docs/tuning.md, docs/results.md "Tuned on validation").
# Usage: bench/tuning_sweep.sh [METHOD...]    METHOD: fedavg fedprox fedlc fedrcl (default all), "report" only
#        reports. A cut sweep goes on with EXTRA_ARGS="--ckpt_path last" (each run resumes its own last.ckpt).
# On 2 cores, one lane per method: bench/tuning_sweep.sh fedavg fedprox & bench/tuning_sweep.sh fedlc fedrcl &
# Environment: SAVE_DIR [docs/sweep_runs]  SEEDS ["0 1"]  ROUNDS [100]  EXTRA_ARGS [none]
# Runs one after another (no --together): on one CPU thread the stacked CIFAR-10 step is no faster
# (docs/performance.md, "Seeds together on the CPU").
set -euo pipefail
save_dir=${SAVE_DIR:-docs/sweep_runs}
lrs=0.03,0.1,0.3
# A method's grid (the lr, and its own weight) and its arguments after the base config.
grid() {
  case $1 in
    fedavg) echo "model.init_args.lr=$lrs" ;;
    fedprox) echo "model.init_args.lr=$lrs model.init_args.mu=0.001,0.01,0.1" ;;
    fedlc) echo "model.init_args.lr=$lrs model.init_args.tau=0.5,1,2" ;;
    fedrcl) echo "model.init_args.lr=$lrs model.init_args.beta=0.5,1,2" ;;
    *) return 1 ;;
  esac
}
method_args() {
  case $1 in
    fedavg) echo "--model fedrcl.algorithms.FedAvg" ;;
    fedrcl) echo "--model fedrcl.algorithms.FedRCL" ;;
    *) echo "--config configs/methods/$1.yaml" ;;
  esac
}
methods=("$@"); [[ ${#methods[@]} -gt 0 ]] || methods=(fedavg fedprox fedlc fedrcl)
for method in "${methods[@]}"; do
  [[ $method == report ]] && continue
  axes=$(grid "$method") || { echo "unknown method $method: fedavg fedprox fedlc fedrcl or report" >&2; exit 2; }
  # shellcheck disable=SC2086  # word lists
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} fedrcl sweep --grid $axes --seeds ${SEEDS:-0 1} --rounds "${ROUNDS:-100}" \
    --config configs/cpu/cifar10_a01_cnn.yaml $(method_args "$method") --data.val_fraction 0.1 \
    --trainer.logger.init_args.save_dir "$save_dir" --trainer.logger.init_args.name "tuning_$method" ${EXTRA_ARGS:-}
done
fedrcl report "$save_dir" --select val
fedrcl report "$save_dir" --select val --format latex
