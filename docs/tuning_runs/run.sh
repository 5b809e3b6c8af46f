#!/bin/bash
# The runs of docs/tuning.md: FedAvg (client lr 0.03, 0.1) and FedProx (lr 0.03, 0.1 x mu 0.01, 0.1), seeds 0 and 1,
# 40 rounds of the quickstart (digits, 20 clients, Dirichlet 0.3) with 10% of every client's samples held out as the
# validation set. Made on 2026-12-02 on a shared 2-core CPU, 7 minutes for the 12 runs (save_dir /tmp/tuning_runs,
# then each version's config.yaml and event files copied here; checkpoints and split.json are not kept).
set -e
cd "$(dirname "$0")/../.."
for spec in "fedavg fedrcl.algorithms.FedAvg model.init_args.lr=0.03,0.1" \
            "fedprox fedrcl.algorithms.FedProx model.init_args.lr=0.03,0.1 model.init_args.mu=0.01,0.1"; do
  set -- $spec
  name=$1; model=$2; shift 2
  fedrcl sweep --grid "$@" --seeds 0 1 --rounds 40 --together \
    --config configs/quickstart.yaml --model "$model" --data.val_fraction 0.1 \
    --trainer.logger.init_args.save_dir /tmp/tuning_runs --trainer.logger.init_args.name "$name"
done
