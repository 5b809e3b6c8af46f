"""Round checkpoints: written atomically, never non-finite, and found again by ``--ckpt_path last``.

- ``AtomicCheckpointIO`` (a Lightning ``CheckpointIO`` plugin, so every checkpoint callback goes through it,
  a user's ``ModelCheckpoint`` included): a checkpoint is written to a temporary file in its own folder,
  flushed to disk (``fsync``), renamed over the target (``os.replace``, atomic within a folder) and the
  folder entry synced. A kill or a full disk at any moment leaves the old file or the new one, never a part
  of one, also when the run folder lies on another filesystem than ``/tmp`` (Lightning's own writer stages in
  ``/tmp`` and copies across). A checkpoint with non-finite weights is not written. Reading names an empty
  or truncated file as such and uses ``torch.load(weights_only=True)``; a file given by name
  (``--ckpt_path FILE``) with non-finite weights is refused (``check_usable``), as ``last`` passes such over.
- ``RoundCheckpoint``: Lightning's ``ModelCheckpoint`` every ``checkpoint_every`` rounds and after the last
  round, with ``last.ckpt`` beside the round files. A user's own ``ModelCheckpoint`` adds files beside it.
  The round's scalars are logged and flushed before its checkpoint is written (``log_round``), so a resume
  never leaves a round without its points.
- ``find_resumable``: what ``--ckpt_path last`` means here: the newest checkpoint (by training progress)
  among every ``*.ckpt`` in the run name's ``version_*/checkpoints`` folders that loads, holds finite
  weights, refers to client-state files that exist and matches the configuration; each file passed over
  is named with the reason. A resumed run writes a new version folder and never overwrites the old one.
- ``local_checkpoint``: one rule for every reader (``fedrcl fit`` / ``validate`` / ``test``, seeds, check, Flower's
  server, a user's ``Trainer.fit(ckpt_path=...)`` through ``AtomicCheckpointIO``): a checkpoint is a local file,
  read with ``weights_only=True`` whatever ``--weights_only`` says. ``file://`` and fsspec cache chains of a
  local file (``simplecache::file:///...``) are that file; a remote URL (``http://``, ``s3://``, any other
  ``scheme://``) and Lightning's model registry are refused in one line (download the file first): a pickle
  loaded from one can run code, and nothing is downloaded or cached where the user did not ask.
"""
from __future__ import annotations

import os
import re
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from fedrcl.errors import disk_error
from fedrcl.federated.deadline import stopped_after_round
from fedrcl.federated.divergence import all_finite
from fedrcl.federated.fingerprint import allowed, compare, refused_changes, run_fingerprint


# Lightning's words for a checkpoint it finds itself (a local file: ``AtomicCheckpointIO`` reads it).
LIGHTNING_WORDS = ("last", "best", "hpc")
FSSPEC_CACHES = ("simplecache", "filecache", "blockcache")  # fsspec chains that only cache the file after them


def _is_local(path: Any) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


def local_checkpoint(path: Any, key: str = "--ckpt_path") -> Any:
    """The local file checkpoint argument ``path`` names (``file:///x`` and ``simplecache::file:///x`` are
    ``/x``; ``None``, ``last``, ``best``, ``hpc`` and plain paths as given).

    Raises:
        ValueError: ``path`` is a remote URL (any ``scheme://`` but ``file://``), an fsspec chain that reads
            more than a cached local file, or Lightning's model registry: one line naming ``key``."""
    if path is None or str(path) in LIGHTNING_WORDS or os.path.exists(str(path)):
        return path
    text = str(path)
    *wrappers, target = text.split("::")
    if text == "registry" or text.startswith("registry:"):
        raise ValueError(f"{key} {text}: a checkpoint from Lightning's model registry is not read (it is "
                         "downloaded and unpickled); download it first and name the file")
    if any(w.rstrip(":/") not in FSSPEC_CACHES for w in wrappers):
        raise ValueError(f"{key} {text}: an fsspec chain other than a cache of a local file "
                         f"({', '.join(FSSPEC_CACHES)}) is not read; name the checkpoint file itself")
    scheme = target.split("://", 1)[0] if "://" in target else None
    if scheme is None:
        return target
    if scheme in ("file", "local"):
        return target.split("://", 1)[1]
    raise ValueError(f"{key} {text}: a remote checkpoint ({scheme}://) is not read: loading one can run code "
                     "it carries, and fedrcl reads checkpoints from local files only (weights_only=True); "
                     "download it first (e.g. curl -o model.ckpt URL) and name the file")


def write_atomically(path: Path, write: Callable[[Any], None]) -> None:
    """Write ``path`` by ``write(file)`` into a temporary file in its folder, fsync, rename into place. A full
    disk or an unwritable folder raises one ``OSError`` naming ``path`` (and leaves no temporary file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        Path(tmp).unlink(missing_ok=True)
        disk = disk_error(error)  # torch wraps a failed write in a RuntimeError ("unexpected pos")
        if disk is None:
            raise
        raise OSError(disk.errno, f"checkpoint {path} not written ({disk.strerror}); the checkpoints written "
                                  "before it are intact: make room, then resume with --ckpt_path last") from error
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a power cut
    finally:
        os.close(folder)


class UnreadableCheckpoint(ValueError):
    """A checkpoint file that cannot be read: empty, truncated, or not loadable with ``weights_only=True``."""

    def __init__(self, path: Any, reason: str):
        super().__init__(f"checkpoint {path} is {reason}")
        self.reason = reason


class NothingToResume(FileNotFoundError):
    """``--ckpt_path last`` found no usable checkpoint under ``where`` (``found``: the checkpoint files there)."""

    def __init__(self, message: str, where: str, found: int):
        super().__init__(message)
        self.where, self.found = where, found


def read_checkpoint(path: Any, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``; a file that cannot be read raises ``UnreadableCheckpoint``, a
    remote URL ``ValueError`` (``local_checkpoint``)."""
    path = local_checkpoint(path)
    size = os.path.getsize(path)
    if size == 0:
        raise UnreadableCheckpoint(path, "empty (0 bytes)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as error:  # noqa: BLE001 (torch raises several types for a damaged file)
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if "weights only load failed" in str(error).lower():  # torch's advice (weights_only=False) left out
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
            what = f"it holds {found.group(1)}, which only unpickling with code execution makes" if found else \
                "it holds objects beyond tensors and plain values"
            raise UnreadableCheckpoint(path, f"not loadable with weights_only=True ({what}); fedrcl never "
                                             "unpickles a checkpoint") from error
        raise UnreadableCheckpoint(path, f"truncated or not a checkpoint ({size} bytes; {first})") from error


def finite_weights(checkpoint: Mapping[str, Any]) -> bool:
    """Whether a loaded checkpoint's model weights are all finite (no NaN or inf)."""
    return all_finite(checkpoint.get("state_dict", {}).values())


def check_usable(path: Optional[str]) -> None:
    """Raise ``UnreadableCheckpoint`` if ``path`` is a local checkpoint file that cannot be read, ``ValueError``
    if its weights are not finite (what ``--ckpt_path last`` passes over: training or evaluating from it is
    meaningless) and ``FileNotFoundError`` if it names none (Lightning's words ``last``, ``best``, ``hpc``
    aside); a remote URL raises ``ValueError`` (``local_checkpoint``)."""
    path = local_checkpoint(path)
    if not path or path in LIGHTNING_WORDS:
        return
    if not os.path.exists(path):
        raise FileNotFoundError(f"--ckpt_path {path}: no such file (a checkpoint file, or last: the newest "
                                "usable checkpoint of the run name)")
    if os.path.isfile(path) and not finite_weights(read_checkpoint(path, mmap=True)):
        raise ValueError(f"--ckpt_path {path}: its weights are not finite (NaN or inf), so nothing can train or "
                         "be evaluated from it; name an earlier checkpoint, or --ckpt_path last (the newest "
                         "usable one)")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic, durable local writes and finite weights only."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Optional[Any] = None) -> None:
        if not _is_local(path):  # object stores: Lightning's own upload
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"storage_options is not supported by {type(self).__name__}")
        if not all_finite(checkpoint.get("state_dict", {}).values()):
            rank_zero_warn(f"checkpoint {path} not written: the model's weights are not finite")
            return
        write_atomically(Path(str(path).removeprefix("file://")), lambda f: torch.save(checkpoint, f))

    def load_checkpoint(self, path: Any, map_location: Any = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The local file ``path`` names, read with ``weights_only=True`` whatever ``weights_only`` says; a
        remote URL is refused (``local_checkpoint``)."""
        path = local_checkpoint(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return read_checkpoint(path, map_location)


def with_atomic_checkpoint_io(plugins: Any) -> list[Any]:
    """Trainer ``plugins`` plus ``AtomicCheckpointIO``, unless the user chose a ``CheckpointIO`` of theirs."""
    from lightning.fabric.plugins import CheckpointIO

    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        plugins.append(AtomicCheckpointIO())
    return plugins


class RoundCheckpoint(ModelCheckpoint):
    """Checkpoint every ``every_n_epochs`` rounds and after the last round; ``last.ckpt`` beside them (on Flower's
    server, every round).

    Files are named ``round{epoch:04d}.ckpt`` (Lightning's 0-based epoch: ``round0019`` holds 20 rounds).
    """

    def __init__(self, every_n_rounds: int):
        super().__init__(filename="round{epoch:04d}", auto_insert_metric_name=False,
                         every_n_epochs=every_n_rounds, save_top_k=-1, save_last=True,
                         save_on_train_epoch_end=True)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._evaluating = stage != "fit"

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """An evaluation writes no checkpoint: it needs none of the fit's checkpoint bookkeeping. A resumed fit
        writes into a new version folder by design, so Lightning's warning that the folder changed is noise."""
        if getattr(self, "_evaluating", False):
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The dirpath has changed")
            super().load_state_dict(state_dict)

    def due(self, trainer: L.Trainer) -> bool:
        """Whether the end of the current round writes a checkpoint."""
        done = trainer.current_epoch + 1
        return not self._should_skip_saving_checkpoint(trainer) and (
            done % self._every_n_epochs == 0 or done == trainer.max_epochs or stopped_after_round(trainer))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.due(trainer):
            self.save(trainer)
        elif getattr(getattr(trainer, "federation", None), "remote", None) is not None \
                and not self._should_skip_saving_checkpoint(trainer):
            # clients on other machines (Flower): a node lost in the next round stops the run, which then resumes
            # from this round, so ``last.ckpt`` is written every round (the round files as due)
            log_round(trainer)
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def save(self, trainer: L.Trainer) -> None:
        """Write the current round's checkpoint and ``last.ckpt`` now, its scalars logged first."""
        log_round(trainer)
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)


def log_round(trainer: L.Trainer) -> None:
    """Log the round's training scalars now and flush every logger, before its checkpoint is written.

    Lightning logs them after the epoch-end callbacks, so a run that stops after the checkpoint (a kill while
    ``last.ckpt`` is written, a full disk) would resume after a round whose ``train/*`` points were never
    written, nor its ``comm/*`` bytes (logged with its seconds at the next round's start). Lightning's own
    call afterwards finds nothing left to log."""
    connector = trainer._logger_connector
    connector.on_epoch_end()  # progress-bar and callback metrics, as Lightning would update them
    connector.update_train_epoch_metrics()  # logs the round's epoch metrics and resets them
    ledger = getattr(getattr(trainer, "federation", None), "ledger", None)
    comm = ledger.comm_metrics() if ledger is not None else {}
    for logger in trainer.loggers:
        if comm:  # the round's bytes (its seconds follow at the next round's start, as without a checkpoint)
            getattr(logger.log_metrics, "__wrapped__", logger.log_metrics)(comm, step=trainer.current_epoch + 1)
        logger.save()  # TensorBoard: flush the event file


def run_checkpoints(trainer: L.Trainer) -> tuple[str, list[Path]]:
    """The run name's folder (for messages) and every ``*.ckpt`` in its versions' checkpoint folders."""
    logger = trainer.logger
    if logger is not None and logger.save_dir is not None:
        run_dir = Path(logger.save_dir) / (logger.name or "")
        return str(run_dir), sorted(run_dir.glob("version_*/checkpoints/*.ckpt"))
    folder = Path(trainer.default_root_dir) / "checkpoints"
    return str(folder), sorted(folder.glob("*.ckpt"))


def why_not_resumable(checkpoint: Mapping[str, Any], fingerprint: Mapping[str, Any],
                      allow: tuple[str, ...]) -> Optional[str]:
    """Why a loaded checkpoint cannot resume this run (``None`` if it can)."""
    if "loops" not in checkpoint or "callbacks" not in checkpoint:
        return "holds weights only (no training state)"
    if not finite_weights(checkpoint):
        return "non-finite weights"
    files = checkpoint.get("client_state", {}).get("files", {}).values()
    missing = [p for p in files if not os.path.exists(p)]
    if missing:
        return f"{len(missing)} client-state file(s) it refers to are gone, e.g. {missing[0]}"
    saved = checkpoint["callbacks"].get("Federation", {}).get("fingerprint", {})
    refused = [(k, a, b) for k, a, b in compare(saved, fingerprint)[0] if not allowed(k, allow)]
    if refused:
        return "other configuration: " + "; ".join(f"{k} {a!r} there, {b!r} here" for k, a, b in refused)
    return None


def check_configuration(path: str, fingerprint: Mapping[str, Any], allow: tuple[str, ...] = ()) -> None:
    """Raise ``ValueError`` naming each key where checkpoint ``path`` differs from this run (before any
    weights are loaded into a model that may not even have their shapes)."""
    if not _is_local(path) or not os.path.isfile(path):
        return
    saved = read_checkpoint(path, mmap=True).get("callbacks", {}).get("Federation", {}).get("fingerprint", {})
    error = refused_changes(saved, fingerprint, allow)
    if error:
        raise ValueError(error)


def check_rounds(path: str, rounds: int) -> None:
    """Raise ``ValueError`` if checkpoint ``path`` holds more rounds than ``trainer.rounds`` (Lightning would
    refuse it later, in its own words and with a traceback)."""
    if not _is_local(path) or not os.path.isfile(path):
        return
    done = read_checkpoint(path, mmap=True).get("loops", {}).get("fit_loop", {}).get("epoch_progress", {})
    done = done.get("current", {}).get("processed", 0)
    if done > rounds:
        raise ValueError(f"trainer.rounds={rounds}, but checkpoint {path} has already trained {done} rounds: "
                         f"set trainer.rounds to {done} or more")


def resume_path(trainer: L.Trainer, model: L.LightningModule, datamodule: Any, ckpt_path: str) -> str:
    """The checkpoint ``--ckpt_path`` resumes from (``last``: ``find_resumable``), checked before anything is
    loaded: a local file that is missing, unreadable or holds non-finite weights (``check_usable``), another
    configuration's (``check_configuration``) or one with more rounds than ``trainer.rounds`` (``check_rounds``)
    raises, naming it. ``fedrcl fit``'s and a Flower run's resume both go through here."""
    allow = trainer.federation.allow_changes  # type: ignore[attr-defined]  # a FederatedTrainer
    fingerprint = run_fingerprint(trainer, model, datamodule)
    path = find_resumable(trainer, fingerprint, allow) if ckpt_path == "last" else local_checkpoint(ckpt_path)
    check_usable(path)
    check_configuration(path, fingerprint, allow)
    assert trainer.max_epochs is not None  # FederatedTrainer sets max_epochs to trainer.rounds
    check_rounds(path, trainer.max_epochs)
    return path


def find_resumable(trainer: L.Trainer, fingerprint: Mapping[str, Any], allow: tuple[str, ...] = (),
                   purpose: str = "resuming from") -> str:
    """The checkpoint ``--ckpt_path last`` resumes from (see the module docstring); ``purpose`` says what is
    done with it (``evaluating`` for ``validate`` / ``test``).

    Raises:
        NothingToResume: (a ``FileNotFoundError``) no checkpoint can resume this run (the rule: fail, never
            start from scratch silently); the message names each file passed over and says how to start a new run.
    """
    where, paths = run_checkpoints(trainer)
    loaded, skipped = [], []
    for path in paths:
        try:
            checkpoint = read_checkpoint(path, mmap=True)  # reads the structure, not the tensors yet
        except UnreadableCheckpoint as error:
            skipped.append(f"{path}: {error.reason}")
            continue
        progress = (checkpoint.get("global_step", 0), checkpoint.get("epoch", 0), path.stat().st_mtime)
        loaded.append((progress, str(path), checkpoint))
    chosen: Optional[str] = None
    for _, name, checkpoint in sorted(loaded, key=lambda item: item[:2], reverse=True):  # newest first
        reason = why_not_resumable(checkpoint, fingerprint, allow)
        if reason is None:
            chosen = name
            break
        skipped.append(f"{name}: {reason}")
    for line in skipped:
        rank_zero_warn(f"--ckpt_path last: skipped {line}")
    if chosen is None:
        what, hint = ("nothing to resume", "To start a new run, leave out --ckpt_path.") \
            if purpose == "resuming from" else ("nothing to evaluate", "Name a checkpoint file, or fit one first.")
        raise NothingToResume(f"--ckpt_path last: {what} under {where} ({len(paths)} checkpoint file(s), "
                              f"none usable). {hint}", where, len(paths))
    rank_zero_info(f"--ckpt_path last: {purpose} {chosen}")
    return chosen
