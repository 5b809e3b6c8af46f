"""The run folder: checked before a run writes into it, and named when writing into it fails mid-run.

- ``check_save_dirs``: a logger's ``save_dir`` (or a folder above it) that is a regular file is refused in one
  line, before anything is built on it (Lightning failed at its first ``makedirs``, in 39 lines).
- ``run_folder_error``: what a failed write into the run folder means, in one line naming the path and
  whether the run can resume: the run folder deleted while the run writes into it (TensorBoard's writer then
  fails on a file that is gone, in two tracebacks), or a full disk where the failing write names no file
  (Lightning's ``hparams.yaml``: only ``No space left on device``). A write fedrcl names itself (a checkpoint,
  ``split.json``) is left as it is.
- ``quiet_writer_threads``: TensorBoard's writer thread prints its traceback when its write fails, then the
  run's own thread raises the same error (``EventFileWriter._check_worker_status``), which fedrcl reports; the
  thread's copy is not printed.
"""
from __future__ import annotations

import errno
import os
import threading
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
