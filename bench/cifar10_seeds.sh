#!/usr/bin/env bash
# Client methods over 3 seeds at CPU scale (FedAvg and FedRCL by default; small CNN, CIFAR-10 alpha 0.1,
# 200 rounds), with per-client evaluation every 5 rounds: the runs, the report (mean ± std, n, 95%
# interval; per-client spread) and the figure (mean curve, band of one std) for docs/results.md.
# Usage: bench/cifar10_seeds.sh [METHOD...]        METHOD: fedavg fedrcl (default both), or any
#        configs/methods/<name>.yaml (fedscl fedlc moon ...) with its paper hyperparameters; "report" only
#        writes the report and the figure of every method already under SAVE_DIR. On 2 cores, one lane
#        per method packs best (3 waves of 2 one-thread runs):
#          PARALLEL=1 bench/cifar10_seeds.sh fedavg & PARALLEL=1 bench/cifar10_seeds.sh fedrcl & wait
#          bench/cifar10_seeds.sh report
# Environment (defaults in brackets):
#   SEEDS ["0 1 2"]  PARALLEL [2: one 1-thread process per core]  CONFIG [configs/cpu/cifar10_a01_cnn.yaml]
#   SAVE_DIR [runs/seeds]  OUT [docs/results_cnn_seeds] (report OUT.md, figure OUT.png)  EXTRA_ARGS [none]
# Each run logs to $SAVE_DIR/<config name>_<method>/seed<k>/version_*; a cut run goes on with
# EXTRA_ARGS="--ckpt_path last" (each seed resumes its own last.ckpt).
# Smoke test at tiny size (digits, 2 rounds, a few seconds per run):
#   CONFIG=configs/quickstart.yaml SAVE_DIR=/tmp/seeds_smoke OUT=/tmp/seeds_smoke/report \
#     EXTRA_ARGS="--trainer.rounds 2 --trainer.local_epochs 1 --data.num_clients 10 \
#     --trainer.clients_per_round 3 --trainer.callbacks.init_args.every_n_rounds 1" bench/cifar10_seeds.sh
set -euo pipefail
config=${CONFIG:-configs/cpu/cifar10_a01_cnn.yaml}
save_dir=${SAVE_DIR:-runs/seeds}
out=${OUT:-docs/results_cnn_seeds}
base=$(basename "$config" .yaml)
methods=("$@"); [[ ${#methods[@]} -gt 0 ]] || methods=(fedavg fedrcl)
# A method's arguments: FedRCL is the experiment config's own model; the others have a configs/methods file.
method_args() {
  if [[ $1 == fedrcl ]]; then echo --model fedrcl.algorithms.FedRCL
  elif [[ -f configs/methods/$1.yaml ]]; then echo --config "configs/methods/$1.yaml"
  else return 1; fi
}
# Its label in the figure: the class name it trains.
label() {
  if [[ $1 == fedrcl ]]; then echo FedRCL
  else sed -n 's/^ *class_path: fedrcl\.algorithms\.//p' "configs/methods/$1.yaml"; fi
}
for method in "${methods[@]}"; do
  [[ $method == report ]] && continue
  margs=$(method_args "$method") || {
    echo "unknown method $method: fedrcl, report or one of: $(ls configs/methods | sed 's/\.yaml$//' | paste -sd ' ')" >&2; exit 2; }
  # shellcheck disable=SC2086  # SEEDS, EXTRA_ARGS and the method's arguments are word lists
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} fedrcl seeds --seeds ${SEEDS:-0 1 2} --parallel "${PARALLEL:-2}" \
    --config "$config" $margs \
    --trainer.logger.init_args.save_dir "$save_dir" --trainer.logger.init_args.name "${base}_$method" \
    --trainer.callbacks+=fedrcl.analysis.ClientEvaluation --trainer.callbacks.init_args.every_n_rounds 5 \
    ${EXTRA_ARGS:-}
done
labels=()
for run in "$save_dir/${base}"_*; do
  method=${run##*/"${base}"_}
  method_args "$method" >/dev/null && labels+=("$(label "$method")=$run")
done
mkdir -p "$(dirname "$out")"
fedrcl report "$save_dir" --out "$out.md" --tags val/acc_ema val/acc clients/global_mix_acc_mean \
  clients/global_mix_acc_worst10 clients/global_mix_acc_std clients/local_test_acc_mean comm/cumulative_bytes
python bench/plot_results.py "${labels[@]}" --out "$out.png" --rounds 25 50 100 200 --band std
echo "report: $out.md (section Seeds), figure: $out.png"
