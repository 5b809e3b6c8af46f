#!/usr/bin/env bash
# The "Privacy (CPU)" figure's runs (docs/results.md): FedAvg and FedRCL on digits, 479 clients of 3 samples, 48 a
# round (q = 0.1), ResNet-18-GN width 2 (11k weights: the noise's norm grows with the square root of the weights),
# 60 rounds of 3 local epochs, clients batched (trainer.client_batching on), three seeds; without DP, and DP-FedAvg with adaptive clipping (median) at noise
# multipliers 0.5, 1.5 and 4, delta 1e-4. From the repository root: bash docs/privacy_runs/run.sh
set -euo pipefail
common=(--config configs/quickstart.yaml --trainer.callbacks null --trainer.checkpoint_every 1000
        --trainer.rounds 60 --trainer.local_epochs 3 --trainer.clients_per_round 48
        --data.num_clients 479 --data.batch_size 3
        --model.init_args.backbone fedrcl.models.ResNet18 --model.init_args.backbone.init_args.width 2
        --trainer.logger.init_args.save_dir docs/privacy_runs --trainer.enable_progress_bar false --trainer.client_batching on)
for method in FedAvg FedRCL; do
  lower=$(echo "$method" | tr '[:upper:]' '[:lower:]')
  for z in none 0.5 1.5 4; do
    if [ "$z" = none ]; then
      dp=()
    else
      dp=(--trainer.privacy fedrcl.privacy.DPFedAvg --trainer.privacy.noise_multiplier "$z"
          --trainer.privacy.adaptive true --trainer.privacy.delta 1e-4)
    fi
    OMP_NUM_THREADS=1 nice -n 15 fedrcl seeds --seeds 0 1 2 --parallel 2 "${common[@]}" "${dp[@]}" \
      --model "fedrcl.algorithms.$method" --trainer.logger.init_args.name "${lower}_z${z}"
  done
done
