#!/usr/bin/env bash
# Prepares on this CPU machine, before the first device call, what bench/gpu_check.sh carries to the GPU:
#   .whl/         the wheels the device image lacks (jsonargparse[signatures]: jsonargparse, typeshed-client,
#                 docstring-parser; pure Python), at the versions installed here;
#   .gpudata1-3/  the real CIFAR-10 npz (170 MB) in three parts of at most 60 MB, since one call carries at
#                 most 64 MiB.
# Both are ignored by git (.gitignore), so a call carries them only when it names them in `carry`.
# Usage: bench/gpu_prepare.sh [PATH/TO/cifar10.npz]        (default ../shared/data/cifar10.npz)
# Then, back to back on the warm machine (run tool):
#   1) carry [".whl", ".gpudata1"]  bash bench/gpu_check.sh
#   2) carry [".gpudata2"]          bash bench/gpu_check.sh
#   3) carry [".gpudata3"]          bash bench/gpu_check.sh       (starts the paper-scale runs)
#   then  WAIT_SECONDS=500 bash bench/gpu_check.sh  to poll and collect, as often as the lease allows.
set -euo pipefail
data=${1:-../shared/data/cifar10.npz}
[[ -f $data ]] || { echo "no CIFAR-10 npz at $data (see ../shared/data/README.md)" >&2; exit 2; }
rm -rf .whl .gpudata1 .gpudata2 .gpudata3
wheels=()
for name in jsonargparse typeshed-client docstring-parser; do
  version=$(python3 -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [[ -n $version ]] || { echo "$name is not installed here: pip install -e \".[dev]\" first" >&2; exit 2; }
  wheels+=("$name==$version")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"
tmp=$(mktemp -d)
split -b 60000000 "$data" "$tmp/c10.part."
parts=("$tmp"/c10.part.*)
[[ ${#parts[@]} -eq 3 ]] || { echo "expected 3 parts of $data, got ${#parts[@]}" >&2; exit 2; }
for i in 1 2 3; do mkdir -p ".gpudata$i" && mv "${parts[i - 1]}" ".gpudata$i/"; done
rmdir "$tmp"
ls -l .whl .gpudata1 .gpudata2 .gpudata3
