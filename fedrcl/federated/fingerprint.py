"""The resume fingerprint: every setting that changes the training math, as flat ``key -> value`` pairs.

A checkpoint carries the fingerprint of the run that wrote it; a resumed run recomputes its own and refuses
to continue where a key differs (``compare``), unless the key is listed in ``trainer.resume_allow_changes``.
Keys are the config's dotted names (``model.init_args.lr``, ``trainer.server.init_args.beta``,
``data.batch_size``) so that an error and the switch speak the language of the YAML file.

Two sources, merged: facts read from the objects (always there, also without the CLI), and the parsed
config of ``fedrcl fit`` (held by LightningCLI's ``SaveConfigCallback``), which adds what objects do not
keep, such as the backbone's init arguments. Settings that leave the math alone are left out: the number
of rounds (resuming with more rounds is the point), evaluation and checkpoint frequency, logging, devices,
data paths, the client-state folder and cache.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import lightning as L
from lightning.pytorch.cli import SaveConfigCallback

# Trainer keys that change the math (the rest of the trainer section is how and where the run executes).
TRAINER_KEYS = ("clients_per_round", "participation", "local_epochs", "server", "seed", "precision",
                "accumulate_grad_batches", "privacy")
# Model and data keys that do not change the math.
IGNORED = ("data.root", "data.download", "data.eval_batch_size", "data.channels_last",
           "model.init_args.state_dir", "model.init_args.max_states_in_memory")
_PLAIN = (str, int, float, bool, type(None))


def _plain(value: Any) -> Any:
    """A value that ``torch.load(weights_only=True)`` reads back and ``==`` compares."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = _plain(value)
    return flat


def init_args(obj: Any, prefix: str) -> dict[str, Any]:
    """``prefix.<arg>`` for every constructor argument of ``obj``'s class (and its bases) that ``obj`` keeps
    as an attribute of the same name with a plain value."""
    facts: dict[str, Any] = {}
    for cls in type(obj).__mro__:
        if "__init__" not in vars(cls):
            continue
        for name in inspect.signature(vars(cls)["__init__"]).parameters:
            value = getattr(obj, name, None) if name != "self" else None
            if isinstance(value, _PLAIN) and hasattr(obj, name):
                facts.setdefault(f"{prefix}.{name}", value)
    return facts


def config_facts(trainer: L.Trainer) -> dict[str, Any]:
    """The math-relevant part of the parsed ``fedrcl fit`` config, if the run came from LightningCLI."""
    config = next((c.config for c in trainer.callbacks  # type: ignore[attr-defined]
                   if isinstance(c, SaveConfigCallback)), None)
    if config is None:
        return {}
    tree = config.as_dict() if hasattr(config, "as_dict") else dict(config)
    facts = {}
    for key, value in flatten({k: tree.get(k) for k in ("model", "data", "optimizer", "lr_scheduler",
                                                         "seed_everything") if k in tree}).items():
        if not any(key == ignored or key.startswith(ignored + ".") for ignored in IGNORED):
            facts[key] = value
    for key, value in flatten(tree.get("trainer") or {}, "trainer.").items():
        if key.split(".")[1] in TRAINER_KEYS:
            facts[key] = value
    return facts


def run_fingerprint(trainer: L.Trainer, model: L.LightningModule, datamodule: Any) -> dict[str, Any]:
    """The fingerprint of a run from its trainer, client algorithm and federated datamodule."""
    federation, dm = trainer.federation, datamodule  # type: ignore[attr-defined]  # a FederatedTrainer's
    facts = {
        # The keys of the first fingerprint (checkpoints written before this module): names and values kept.
        "data.dataset": dm.dataset, "data.num_clients": dm.num_clients, "data.partition": dm.partition,
        "data.alpha": dm.alpha, "data.seed": dm.seed, "data.partition_file": dm.partition_file,
        "model": type(model).__name__, "model.backbone": type(model.backbone).__name__,
        "trainer.seed": federation.seed,
        # Added by the strict resume check.
        "trainer.clients_per_round": federation._clients_per_round,
        "trainer.participation": federation.participation, "trainer.local_epochs": federation.local_epochs,
        "trainer.server": type(federation.server).__name__, "trainer.precision": str(trainer.precision),
        "data.batch_size": dm.batch_size, "data.local_iters_per_epoch": dm.local_iters_per_epoch,
        "data.shards_per_client": dm.shards_per_client, "data.augment": dm.augment, "data.views": dm.views,
        **init_args(federation.server, "trainer.server.init_args"),
        **{k: v for k, v in init_args(model, "model.init_args").items() if k not in IGNORED},
    }
    return {**config_facts(trainer), **facts}


def allowed(key: str, allow: Iterable[str]) -> bool:
    """Whether ``key`` is covered by an entry of ``trainer.resume_allow_changes`` (the key or a parent)."""
    return any(key == a or key.startswith(a + ".") for a in allow)


def compare(saved: Mapping[str, Any],
            current: Mapping[str, Any]) -> tuple[list[tuple[str, Any, Any]], list[str]]:
    """``(differences, unchecked)``: keys in both whose values differ, as ``(key, saved, current)``, and keys
    that only one side has (a checkpoint from an older fingerprint lacks the newer keys)."""
    differences = [(k, saved[k], v) for k, v in current.items() if k in saved and saved[k] != v]
    unchecked = sorted(set(saved) ^ set(current))
    return differences, unchecked


def refused_changes(saved: Mapping[str, Any], current: Mapping[str, Any],
                    allow: Iterable[str]) -> Optional[str]:
    """The error a resume with ``current`` from a checkpoint with ``saved`` stops with (``None``: allowed)."""
    refused = [(k, a, b) for k, a, b in compare(saved, current)[0] if not allowed(k, allow)]
    if not refused:
        return None
    return ("checkpoint comes from another configuration: "
            + "; ".join(f"{k} was {a!r} there and is {b!r} here" for k, a, b in refused)
            + ". Resume with the checkpoint's settings, start a new run (no --ckpt_path), or list the keys "
              "in trainer.resume_allow_changes to continue with a deliberate change")
