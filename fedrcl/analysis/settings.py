"""What a run trains, read from the ``config.yaml`` LightningCLI saved beside its logs.

``run_setting``: the facts the paper's tables are keyed by (data set, split, clients, method, server,
backbone, ...). ``experiment_key``: everything a run trains but its seeds and the keys that only say where and
how it ran (``EXPERIMENT_IGNORES``): runs with equal keys are one experiment under several seeds.
``method_key``: the same with the method set aside, what two methods compared on equal terms share. Plain
dictionaries in, no Lightning or torch.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Optional

__all__ = ["SEED_KEYS", "EXPERIMENT_IGNORES", "ROUND_LOOP_VALUES", "ADDED_KEYS", "lookup", "run_setting",
           "experiment_key", "method_key"]

SEED_KEYS = ("seed_everything", "trainer.seed", "data.seed")
# Keys that say where and how a run executes, is logged, checkpointed or stopped, not what it trains: the
# resume fingerprint's ignored keys (``fedrcl.federated.fingerprint.IGNORED``, written out here because that
# module loads Lightning; a test keeps the two lists in step), and the trainer's execution switches (batched
# or compiled clients, devices, processes, evaluation cadence; they change rounding at most).
EXPERIMENT_IGNORES = (
    "data.root", "data.download", "data.eval_batch_size", "data.channels_last", "model.init_args.state_dir",
    "model.init_args.max_states_in_memory", "trainer.logger", "trainer.callbacks", "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.enable_checkpointing", "trainer.default_root_dir", "trainer.checkpoint_every",
    "trainer.log_every_n_steps", "trainer.eval_every", "trainer.rounds", "trainer.resume_allow_changes",
    "trainer.client_batching", "trainer.compile_clients", "trainer.accelerator", "trainer.strategy",
    "trainer.devices", "trainer.num_nodes", "torch_threads", "weights_only", "ckpt_path", "config")
# The trainer arguments fedrcl's round loop owns, each with the only value it allows
# (``fedrcl.federated.trainer.OWNED_BY_ROUNDS``, written out here because that module loads Lightning; a test
# keeps the two in step). Older fedrcl wrote them into config.yaml, newer leaves them out: at that value they
# say nothing about what was trained.
ROUND_LOOP_VALUES = {"max_epochs": None, "min_epochs": None, "max_steps": -1, "check_val_every_n_epoch": 1,
                     "reload_dataloaders_every_n_epochs": 0, "num_sanity_val_steps": None,
                     "gradient_clip_val": None, "gradient_clip_algorithm": None}

# Config keys added after runs were committed, each with the default that trains as before it existed: at that
# value it says nothing about what was trained (a config written before it leaves it out). The data keys are
# FederatedDataModule's arguments at their defaults, ``trainer.privacy`` FederatedTrainer's (a test keeps them in
# step); ``optimizer``, ``lr_scheduler`` (LightningCLI's slots) and ``trainer.barebones``, which older fedrcl
# wrote at these values and newer leaves out, go the same way.
ADDED_KEYS = {
    "data.val_fraction": 0.0, "data.image_size": None, "data.hflip": None, "data.test_fraction": 0.2,
    "data.feature_skew": None, "data.feature_skew_severity": 3, "data.domain_split": "one", "data.domain_alpha": 1.0,
    "data.image_column": "image", "data.label_column": "label", "data.client_column": None,
    "data.domain_column": None, "data.partitioner": None, "trainer.privacy": None,
    "optimizer": None, "lr_scheduler": None, "trainer.barebones": False}


def class_name(spec: Any) -> Optional[str]:
    """``Foo`` from ``"a.b.Foo"`` or ``{"class_path": "a.b.Foo", ...}``; ``None`` from ``None``."""
    if isinstance(spec, dict):
        spec = spec.get("class_path")
    return spec.rsplit(".", 1)[-1] if isinstance(spec, str) else None


def init_args(spec: Any) -> dict[str, Any]:
    """The ``init_args`` of a ``{"class_path": ..., "init_args": ...}`` spec; ``{}`` for anything else."""
    return (spec.get("init_args") or {}) if isinstance(spec, dict) else {}


def run_setting(config: dict[str, Any]) -> dict[str, Any]:
    """The facts of a run that the paper's tables are keyed by, from its saved LightningCLI config.

    Keys: ``dataset``, ``partition``, ``alpha`` (``None`` unless a Dirichlet partition), ``shards_per_client``
    (``None`` unless a ``shards`` partition), ``num_clients``, ``clients_per_round`` (also from
    ``participation``), ``local_epochs``, ``batch_size``, ``local_iters_per_epoch``, ``server`` (class name;
    ``FedAvg`` when none), ``method`` (the client algorithm's class name), ``beta`` and ``levels`` (the
    method's, when it has them; ``levels`` a tuple, ``None`` for all levels), ``backbone`` (class name),
    ``width`` (the backbone's, when it has one), ``partition_file``.
    """
    data = config.get("data") or {}
    if "class_path" in data:
        data = init_args(data)
    trainer, model = config.get("trainer") or {}, config.get("model") or {}
    partition, num_clients = data.get("partition"), data.get("num_clients")
    clients_per_round = trainer.get("clients_per_round")
    if clients_per_round is None and trainer.get("participation") is not None and num_clients is not None:
        clients_per_round = max(1, round(trainer["participation"] * num_clients))
    method_args = init_args(model)
    backbone, levels = method_args.get("backbone"), method_args.get("levels")
    return {
        "dataset": data.get("dataset"),
        "partition": partition,
        "alpha": data.get("alpha") if str(partition).startswith("dirichlet") else None,
        "shards_per_client": data.get("shards_per_client") if partition == "shards" else None,
        "num_clients": num_clients,
        "clients_per_round": clients_per_round,
        "local_epochs": trainer.get("local_epochs"),
        "batch_size": data.get("batch_size"),
        "local_iters_per_epoch": data.get("local_iters_per_epoch"),
        "server": class_name(trainer.get("server")) or "FedAvg",
        "method": class_name(model),
        "beta": method_args.get("beta"),
        "levels": tuple(levels) if levels is not None else None,
        "backbone": class_name(backbone),
        "width": init_args(backbone).get("width"),
        "partition_file": data.get("partition_file"),
    }


def lookup(config: dict[str, Any], key: str) -> Any:
    """The value at a dotted ``key`` (``trainer.seed``) of a nested config; ``None`` where it is absent."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def experiment_key(config: dict[str, Any]) -> str:
    """What a run trains, from its saved config: everything but the seeds and ``EXPERIMENT_IGNORES`` (each
    dropped with what lies under it), the ``trainer`` keys of ``ROUND_LOOP_VALUES`` and the ``ADDED_KEYS`` at their
    value, as canonical JSON."""
    kept = copy.deepcopy(config)
    for key in SEED_KEYS + EXPERIMENT_IGNORES + tuple(ADDED_KEYS):
        *parents, leaf = key.split(".")
        node: Any = kept
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node and (key not in ADDED_KEYS or node[leaf] == ADDED_KEYS[key]):
            del node[leaf]
    trainer = kept.get("trainer")
    if isinstance(trainer, dict):
        for key, value in ROUND_LOOP_VALUES.items():
            if key in trainer and trainer[key] == value:
                del trainer[key]
    return json.dumps(kept, sort_keys=True, default=str)


def method_key(config: dict[str, Any]) -> str:
    """``experiment_key`` with the method set aside, everything under ``model`` but its backbone and the server
    half (``trainer.server``: FedAvgM, FedAdam, FedNova's or SCAFFOLD's aggregation are methods in the paper's
    tables too): what runs of two methods compared on equal terms share (data, split, clients, rounds schedule,
    network)."""
    model, trainer = config.get("model"), config.get("trainer")
    kept = {**config, "model": {"backbone": init_args(model).get("backbone")}}
    if isinstance(trainer, dict):
        kept["trainer"] = {key: value for key, value in trainer.items() if key != "server"}
    return experiment_key(kept)
