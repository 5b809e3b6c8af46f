"""A ``fedrcl`` command for the GPU lease (``fedrcl seeds --seeds 0 1 2 --together ...``), with torch.compile's
cache carried between leases.

    python3 bench/gpu_lease_fit.py --cache-in DIR --cache-out FILE seeds --seeds 0 1 2 --together --config ...

Before the run: every ``*.bin`` in ``DIR`` (``torch.compiler.save_cache_artifacts()`` of an earlier lease) is
loaded with ``torch.compiler.load_cache_artifacts``, when ``DIR/meta.json`` names this torch and GPU (the
artifacts are valid for nothing else). After it, also when it stops by an exception or a signal, this
process's artifacts go to ``FILE`` with that ``meta.json`` beside it. Nothing else differs from ``fedrcl``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fedrcl.cli import main as fedrcl_main  # noqa: E402


def device_key() -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"torch": torch.__version__, "gpu": gpu}


def load_cache(folder: Path) -> int:
    meta = folder / "meta.json"
    if not meta.exists() or json.loads(meta.read_text()) != device_key():
        return 0
    blobs = sorted(folder.glob("*.bin"))
    for blob in blobs:
        torch.compiler.load_cache_artifacts(blob.read_bytes())
    print(f"gpu_lease_fit: loaded {len(blobs)} compile cache file(s) from {folder}", flush=True)
    return len(blobs)


def save_cache(path: Path) -> None:
    artifacts = torch.compiler.save_cache_artifacts()
    if not artifacts or not artifacts[0]:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(artifacts[0])
    (path.parent / "meta.json").write_text(json.dumps(device_key()))
    print(f"gpu_lease_fit: saved {len(artifacts[0])} bytes of compile cache to {path}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-in", type=Path, required=True)
    parser.add_argument("--cache-out", type=Path, required=True)
    args, rest = parser.parse_known_args()
    load_cache(args.cache_in)
    try:
        fedrcl_main(rest)
    finally:
        save_cache(args.cache_out)


if __name__ == "__main__":
    main()
