"""The run folder: checked before a run writes into it, and named when writing into it fails mid-run.

- ``check_save_dirs``: a logger's ``save_dir`` (or a folder above it) that is a regular file is refused in one
  line, before anything is built on it (Lightning failed at its first ``makedirs``, in 39 lines).
- ``run_folder_error``: what a failed write into the run folder means, in one line naming the path and
  whether the run can resume: the run folder deleted while the run writes into it (TensorBoard's writer then
  fails on a file that is gone, in two tracebacks), or a full disk where the failing write names no file
  (Lightning's ``hparams.yaml``: only ``No space left on device``). A write fedrcl names itself (a checkpoint,
  ``split.json``) is left as it is.
- ``hold_run_folders``: one writer per run folder. Before a run writes into its folder (``version_k``), it creates
  ``fedrcl.lock`` there atomically (``O_CREAT | O_EXCL``) with its PID, host and command; a second run into a folder
  whose lock names a live process is refused in one line naming that process (two ``fedrcl fit`` with the same
  ``version``, two ``fedrcl seeds --together`` started at once into one save_dir). A lock whose process is gone (a
  run killed with ``kill -9``) is taken over; the lock is removed when the run ends (``release_run_folders``, at
  the latest at exit).
- ``quiet_writer_threads``: TensorBoard's writer thread prints its traceback when its write fails, then the
  run's own thread raises the same error (``EventFileWriter._check_worker_status``), which fedrcl reports; the
  thread's copy is not printed.
"""
from __future__ import annotations

import atexit
import errno
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import lightning as L

from fedrcl.errors import disk_error, fedrcl_error
from fedrcl.federated.checkpoint import run_checkpoints


def check_save_dirs(trainer: L.Trainer) -> None:
    """Raise ``ValueError`` if a logger's ``save_dir``, or an existing folder above it, is not a folder."""
    for logger in trainer.loggers:
        save_dir = getattr(logger, "save_dir", None)
        if not save_dir or "://" in str(save_dir):
            continue
        path = Path(save_dir)
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            where = "it" if existing == path else f"{existing}, above it,"
            raise ValueError(f"trainer.logger save_dir {save_dir}: {where} is a file, not a folder; name a "
                             "folder (made if missing) for the run folders")


LOCK_NAME = "fedrcl.lock"
_held: set[Path] = set()  # the run folders this process holds


class RunFolderTaken(RuntimeError):
    """Another live process writes into the run folder (``hold_run_folder``)."""


def _holder(lock: Path) -> Optional[dict[str, Any]]:
    """What a lock file says (``pid``, ``host``, ``command``); ``None`` if it is gone, empty or not a lock of ours."""
    try:
        holder = json.loads(lock.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and type(holder.get("pid")) is int else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def hold_run_folder(folder: Path) -> None:
    """Make ``folder`` this process's to write: create its ``fedrcl.lock`` atomically, taking over a lock whose
    process is gone.

    Raises:
        RunFolderTaken: a live process (or one on another host, which cannot be checked) holds it."""
    folder = Path(folder).resolve()
    if folder in _held and (folder / LOCK_NAME).is_file():  # (a failed start may have removed the folder)
        return
    folder.mkdir(parents=True, exist_ok=True)
    lock, host = folder / LOCK_NAME, socket.gethostname()
    mine = {"pid": os.getpid(), "host": host, "command": " ".join(sys.argv)[:500]}
    for attempt in range(50):
        try:
            handle = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(lock)
            if holder is None and attempt < 10:  # being written by its creator this moment
                time.sleep(0.1)
                continue
            if holder is not None and (holder.get("host") != host or _alive(holder["pid"])):
                if holder["pid"] == os.getpid() and holder.get("host") == host:
                    break  # this process's own (a run built again in the same process)
                raise RunFolderTaken(_taken(folder, holder, host)) from None
            lock.unlink(missing_ok=True)  # its process is gone (killed): the folder is free
            continue
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            json.dump(mine, f)
        break
    else:
        raise RunFolderTaken(f"the run folder {folder}: its lock {lock} could not be taken")
    if not _held:
        atexit.register(release_run_folders)
    _held.add(folder)


def _taken(folder: Path, holder: dict[str, Any], host: str) -> str:
    command = f" ({holder['command']})" if holder.get("command") else ""
    where = f"PID {holder['pid']}" if holder.get("host") == host else \
        f"PID {holder['pid']} on host {holder.get('host')} (whether it still runs cannot be checked from {host})"
    return (f"the run folder {folder} is being written by another run, {where}{command}; wait for it to end, or give "
            f"this run a folder of its own (another trainer.logger name or version); if that run has ended, delete "
            f"{folder / LOCK_NAME}")


def held_by_another(folder: Path) -> bool:
    """Whether ``folder``'s lock names another process (a live one or not: not this process's to remove)."""
    holder = _holder(Path(folder) / LOCK_NAME)
    return holder is not None and (holder["pid"] != os.getpid() or holder.get("host") != socket.gethostname())


def logger_folder(trainer: L.Trainer, logger: Any) -> Optional[Path]:
    """The run folder of ``logger``, a local one: TensorBoard's and CSVLogger's ``log_dir`` (``version_k``); for
    any other logger (W&B, MLflow, ...) the folder Lightning's ``ModelCheckpoint`` puts the run's
    ``checkpoints`` in, ``<save_dir>/<name>/<version>`` (W&B's own files go to its ``wandb`` folder); ``None``
    where that is not a local path."""
    log_dir = getattr(logger, "log_dir", None)
    if log_dir is None:
        save_dir = logger.save_dir or trainer.default_root_dir
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        log_dir = str(Path(save_dir) / str(logger.name) / version)
    return Path(log_dir) if "://" not in str(log_dir) else None


def run_folders(trainer: L.Trainer) -> list[Path]:
    """The local run folders (``log_dir``) of the trainer's loggers."""
    folders = []
    for logger in trainer.loggers:
        log_dir = getattr(logger, "log_dir", None)
        if log_dir and "://" not in str(log_dir) and Path(log_dir) not in folders:
            folders.append(Path(log_dir))
    return folders


def hold_run_folders(trainer: L.Trainer) -> None:
    """``hold_run_folder`` for each of the trainer's run folders, on the process that writes them (rank 0)."""
    from lightning.pytorch.utilities import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) == 0:
        for folder in run_folders(trainer):
            hold_run_folder(folder)


def release_run_folders(trainer: Optional[L.Trainer] = None) -> None:
    """Remove the locks this process holds on ``trainer``'s run folders (``None``: all; its runs have ended)."""
    folders = set(_held) if trainer is None else {f.resolve() for f in run_folders(trainer)} & _held
    for folder in folders:
        _held.discard(folder)
        holder = _holder(folder / LOCK_NAME)
        if holder is not None and holder["pid"] == os.getpid():
            (folder / LOCK_NAME).unlink(missing_ok=True)


def _run_folder(trainer: L.Trainer) -> Optional[Path]:
    """The first logger's run folder (``version_k``), read without a collective (``trainer.log_dir`` is one)."""
    logger = trainer.loggers[0] if trainer.loggers else None
    log_dir = getattr(logger, "log_dir", None)
    return Path(log_dir) if log_dir and "://" not in str(log_dir) else None


def _what_now(trainer: L.Trainer) -> str:
    where, paths = run_checkpoints(trainer)
    if paths:
        return f"resume with --ckpt_path last (the newest usable checkpoint under {where})"
    return "start the run again"


def run_folder_error(trainer: L.Trainer, error: BaseException) -> Optional[Exception]:
    """The one-line error that replaces ``error``, a failed write into the run folder that names no file, or
    ``None`` (any other error, and one fedrcl raised itself, keep theirs)."""
    if fedrcl_error(error) is not None:
        return None
    folder = _run_folder(trainer)
    if folder is None:
        return None
    if not folder.is_dir() and _missing_inside(error, folder):
        return FileNotFoundError(errno.ENOENT, f"the run folder {folder} was deleted while the run wrote into it "
                                               f"(round {trainer.current_epoch + 1}), its checkpoints with it; "
                                               f"{_what_now(trainer)}")
    disk = disk_error(error)
    if disk is None or disk.filename:
        return None
    assert disk.errno is not None  # disk_error matched it by its errno
    return OSError(disk.errno, f"{folder}: {disk.strerror or os.strerror(disk.errno)}, writing into the run "
                               f"folder; make room, then {_what_now(trainer)}")


def _missing_inside(error: Optional[BaseException], folder: Path) -> bool:
    """Whether ``error`` is or was raised from a ``FileNotFoundError`` for a file inside ``folder``."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, FileNotFoundError) and error.filename is not None:
            name = os.fsdecode(error.filename)
            if Path(name).is_relative_to(folder):
                return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


@contextmanager
def quiet_writer_threads() -> Iterator[None]:
    """While the run trains: TensorBoard's writer thread does not print the error its run re-raises."""
    previous = threading.excepthook

    def hook(args: Any) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous
