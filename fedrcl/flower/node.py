"""A node's own configuration (Flower's ``--node-config``), read and checked without importing torch.

Keys: ``partition-id`` and ``num-partitions`` (node ``i`` of ``N`` serves clients ``i, i + N, ...``; Flower's
simulation sets both), ``data-root`` (the node's data folder, overriding ``data.root``), ``state-dir`` (where
per-client state files and the node's worker live; default ``<temp>/fedrcl-flower``), ``worker`` (``true``:
a deployed node keeps its built run in a worker process between messages, ``fedrcl.flower.worker``; default
true except in Flower's simulation, whose Ray actors live for the run) and ``worker-idle`` (seconds a worker
waits for its next message before it exits; default 3600).

``check`` refuses a configuration the node cannot serve with, naming the key, its value and what is allowed,
before anything heavy is built: the node's ``query`` handler calls it first, so a bad node fails the run's
start within seconds.

A string Flower's own parser cannot read (``data-root=/its/data``: a string value needs quotes,
``data-root="/its/data"``) never gets that far: ``flower-supernode`` dies at its start with a traceback, and a
loop that restarts it dies again every time. ``python -m fedrcl.flower.node 'CONFIG'`` reads ``CONFIG`` as
``flower-supernode --node-config 'CONFIG'`` will (``parse``) and checks it as the node's query will
(``check``): one line and exit status 2 for a bad one, before a SuperNode is started.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Mapping
from typing import Any, Optional
from pathlib import Path

DEFAULT_IDLE = 3600.0  # seconds a worker waits for a message before it exits


class NodeConfigError(ValueError):
    """A node configuration this node cannot serve with; the message names the key, its value and what is
    allowed."""


def _integer(node_config: Mapping, key: str, default: int) -> int:
    value = node_config.get(key, default)
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise NodeConfigError(f"node config {key}={value!r}: must be an integer") from None


def partition(node_config: Mapping) -> tuple[int, int]:
    """``(partition-id, num-partitions)``, checked: ``num-partitions >= 1`` and ``0 <= partition-id <
    num-partitions``."""
    parts = _integer(node_config, "num-partitions", 1)
    if parts < 1:
        raise NodeConfigError(f"node config num-partitions={parts}: must be at least 1")
    part = _integer(node_config, "partition-id", 0)
    if not 0 <= part < parts:
        raise NodeConfigError(f"node config partition-id={part}: must be in 0..{parts - 1} "
                              f"(num-partitions={parts})")
    return part, parts


def served_clients(node_config: Mapping, num_clients: int) -> list[int]:
    """The clients of a node: ``range(partition-id, num_clients, num-partitions)``."""
    part, parts = partition(node_config)
    return list(range(part, num_clients, parts))


def state_base(node_config: Mapping) -> Path:
    """The node's ``state-dir`` (default: ``<temp>/fedrcl-flower``)."""
    return Path(str(node_config.get("state-dir", Path(tempfile.gettempdir()) / "fedrcl-flower"))).expanduser()


def uses_worker(node_config: Mapping) -> bool:
    """``worker`` if set, else true unless this process runs in Flower's simulation (a Ray actor)."""
    value = node_config.get("worker")
    if value is None:
        ray = sys.modules.get("ray")
        return not (ray is not None and ray.is_initialized())
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise NodeConfigError(f"node config worker={value!r}: must be true or false")


def idle_seconds(node_config: Mapping) -> float:
    """``worker-idle``: seconds a worker waits for its next message (default 3600)."""
    value = node_config.get("worker-idle", DEFAULT_IDLE)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0:
        raise NodeConfigError(f"node config worker-idle={value!r}: must be a number of seconds above 0")
    return seconds


def check(node_config: Mapping) -> None:
    """Refuse a node configuration this node cannot serve with (``NodeConfigError``, named): the partition,
    a ``data-root`` that is not a folder it can read, a ``state-dir`` it cannot create or write, a bad
    ``worker`` or ``worker-idle``. Creates the ``state-dir`` if missing."""
    partition(node_config)
    uses_worker(node_config)
    idle_seconds(node_config)
    if "data-root" in node_config:
        root = Path(str(node_config["data-root"])).expanduser()
        problem = ("does not exist" if not root.exists() else "is not a folder" if not root.is_dir()
                   else "cannot be read by this node" if not os.access(root, os.R_OK | os.X_OK) else "")
        if problem:
            value = str(node_config["data-root"])
            raise NodeConfigError(f"node config data-root={value!r}: {problem}; it must be an existing "
                                  "folder this node can read, holding the run's data set")
    base = state_base(node_config)
    try:
        base.mkdir(parents=True, exist_ok=True)
        writable = os.access(base, os.W_OK | os.X_OK)
    except OSError as error:
        writable, base_error = False, f" ({error.strerror})"
    else:
        base_error = ""
    if not writable:
        raise NodeConfigError(f"node config state-dir={str(base)!r}: cannot be created or written by this "
                              f"node{base_error}; it must be a folder this node can write (per-client state, "
                              "its worker's socket)")


def parse(text: str) -> dict[str, Any]:
    """``text`` read as ``flower-supernode --node-config TEXT`` reads it (Flower's ``parse_config_args``: TOML
    values, space-separated ``key=value`` pairs); ``NodeConfigError`` naming it if Flower cannot read it."""
    from flwr.common.config import parse_config_args

    try:
        return parse_config_args([text])
    except Exception as error:  # noqa: BLE001  # click's ClickException, tomli's, a ValueError: all alike
        raise NodeConfigError(
            f"node config {text!r}: not in Flower's format ({type(error).__name__}): space-separated key=value "
            "pairs with TOML values, a string in double quotes, e.g. "
            "'partition-id=0 num-partitions=2 data-root=\"/its/data\"'") from None


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m fedrcl.flower.node CONFIG``: exit status 0 if a SuperNode can serve with ``CONFIG``, else
    one line and exit status 2."""
    parser = argparse.ArgumentParser(prog="python -m fedrcl.flower.node",
                                     description="Check a node config as flower-supernode --node-config reads "
                                                 "it and as a fedrcl node checks it.")
    parser.add_argument("config", help="the --node-config string, e.g. 'partition-id=0 num-partitions=2'")
    args = parser.parse_args(argv)
    try:
        check(parse(args.config))
    except NodeConfigError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
