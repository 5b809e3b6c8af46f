#!/usr/bin/env bash
# One GPU lease, one command (docs/gpu.md). On the device machine, in one call:
#   set up (the carried wheels, if its image lacks them) -> decode the carried CIFAR-10 mosaics -> probe the
#   execution modes and one seed against three seeds together (or reuse the last lease's decision on the same
#   GPU and torch) -> train seeds 0, 1, 2 of FedAvg and of FedRCL at width 64 (one `fedrcl seeds --together`
#   process per method, side by side; each seed from its own checkpoint if carried), stopped by SIGTERM on a
#   whole round before the deadline, every seed checkpointed -> collect into $OUT (summary.json, logs.tar.gz,
#   the probe's profile, checkpoint parts, then the compile cache; what does not fit waits in /tmp for
#   --collect).
#
#   bash bench/gpu_lease.sh --prepare [--from DIR ...]  here: fill .lease/ (and .lease2/, ...) for carry,
#                                                      DIR: the last lease's returned files, to continue it
#   bash bench/gpu_lease.sh --stash                      device: stash a carried .leaseN/ (checkpoint parts)
#   LEASE_LIMIT_S=540 bash bench/gpu_lease.sh            device: the lease (LEASE_LIMIT_S = the call's timeout_s)
#   bash bench/gpu_lease.sh --collect                    device: the files the last call could not return
#
# Environment: LEASE_LIMIT_S (600) the call's limit; LEASE_COLLECT_S (45) kept for collecting; LEASE_PROBE_S
# (150) the probe's limit; LEASE_PROBE=always probes even where the last decision could be reused;
# LEASE_ROUND_MARGIN_S (1.5 x 2 x the probe's FedRCL round of three seeds, else 30) how long before the
# deadline the runs get SIGTERM; LEASE_WORK (/tmp/lease); LEASE_CARRY (.lease); LEASE_DATA
# (../shared/data/cifar10_jpeg, for --prepare).
# GPU_LEASE_REHEARSAL=1: the same steps on this CPU at toy scale (width 4, 3 rounds; tests/test_gpu_lease.py),
# with GPU_LEASE_BREAK (default batched+compiled=error) breaking a mode on purpose (MODE=error or
# MODE=unequal, comma-separated) and LEASE_TOY_WIDTH (4) the ResNet-18 width.
set -uo pipefail
cd "$(dirname "$0")/.."
export LEASE_T0=${LEASE_T0:-$(date +%s.%N)} PYTHONUNBUFFERED=1
if [[ ${GPU_LEASE_REHEARSAL:-0} == 1 ]]; then
  export GPU_LEASE_BREAK=${GPU_LEASE_BREAK-batched+compiled=error}
fi
carry=${LEASE_CARRY:-.lease}

case ${1:-} in
  --prepare)
    shift
    data=${LEASE_DATA:-../shared/data/cifar10_jpeg}
    wheels=()
    if [[ ${GPU_LEASE_REHEARSAL:-0} != 1 ]]; then  # the rehearsal has its packages (and no network in tests)
      tmp=$(mktemp -d)
      for name in jsonargparse typeshed-client docstring-parser; do  # jsonargparse[signatures]: absent there
        version=$(python3 -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
        [[ -n $version ]] || { echo "$name is not installed here: pip install -e \".[dev]\" first" >&2; exit 2; }
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
          --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$tmp" "$name==$version" || exit 2
      done
      wheels=(--wheels "$tmp")
    fi
    python3 bench/gpu_lease_run.py prepare --data "$data" "${wheels[@]}" "$@"
    status=$?
    [[ -n ${tmp:-} ]] && rm -rf "$tmp"
    exit $status ;;
  --stash) exec python3 bench/gpu_lease_run.py stash ;;
  --collect) exec python3 bench/gpu_lease_run.py collect ;;
  "") ;;
  *) echo "usage: bash bench/gpu_lease.sh [--prepare [--from DIR ...] | --stash | --collect]" >&2; exit 2 ;;
esac

# Set up: the device image has torch, Lightning, torchmetrics, tensorboard and Pillow, not jsonargparse.
if ! python3 -c "import jsonargparse, typeshed_client, docstring_parser" 2>/dev/null; then
  wheel_dir=$(ls -d "$carry"*/wheels 2>/dev/null | head -1)
  [[ -n $wheel_dir ]] || { echo "no wheels carried ($carry/wheels): run --prepare here first" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "${LEASE_WORK:-/tmp/lease}/site" "$wheel_dir"/*.whl || exit 2
  export PYTHONPATH=${LEASE_WORK:-/tmp/lease}/site${PYTHONPATH:+:$PYTHONPATH}
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L
mkdir -p "${LEASE_WORK:-/tmp/lease}/logs"
python3 bench/gpu_lease_run.py lease 2>&1 | tee -a "${LEASE_WORK:-/tmp/lease}/logs/lease.log"
