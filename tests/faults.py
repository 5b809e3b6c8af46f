"""Fault injection for the reliability tests: a file write stops half-way, as under a kill or a full disk.

A spec ``ACTION:NAME:N`` (``ACTION`` is ``kill`` or ``enospc``): the N-th file (1-based) opened for
writing whose name contains ``NAME`` receives half of its first write; then the process kills itself
with SIGKILL (``kill``), or the write raises ``OSError(ENOSPC)`` (``enospc``). Python writes and
``os.sendfile`` (how ``shutil`` copies across filesystems) are both covered, so the fault hits whichever
code writes the file: ours, Lightning's, or fsspec's.

In a child process: ``FEDRCL_FAULT=kill:last.ckpt:2`` and ``python -c "import faults;
faults.install_from_env(); ..."``.
In-process: ``install(spec, monkeypatch)``.

``SignalAt`` sends a signal to its own process in the middle of a chosen round, as a scheduler would
(``--trainer.callbacks+=faults.SignalAt --trainer.callbacks.init_args.round 2``).
"""
from __future__ import annotations

import builtins
import errno
import os
import signal
from typing import Any, Optional

import lightning as L


class _Fault:
    def __init__(self, spec: str):
        self.action, self.name, count = spec.split(":")
        self.remaining = int(count)
        self.fds: set[int] = set()

    def hit(self) -> None:
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def opened(self, path: Any, mode: str) -> bool:
        if not any(c in mode for c in "wax+") or self.name not in os.path.basename(str(path)):
            return False
        self.remaining -= 1
        return self.remaining == 0


class _HalfWriter:
    """A file whose first write lands half-way before the fault."""

    def __init__(self, f: Any, fault: _Fault):
        self._f, self._fault = f, fault
        fault.fds.add(f.fileno())

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._f.write(view[: len(view) // 2])
        self._f.flush()
        os.fsync(self._f.fileno())
        self._fault.hit()
        return 0

    def __enter__(self) -> "_HalfWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def install(spec: str, monkeypatch: Optional[Any] = None) -> None:
    """Arm the fault ``spec`` (see the module docstring); with ``monkeypatch`` it is undone after the test."""
    fault = _Fault(spec)
    real_open, real_sendfile = builtins.open, os.sendfile

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, mode, *args, **kwargs)
        return _HalfWriter(f, fault) if fault.opened(file, mode) else f

    def sendfile(out_fd: int, in_fd: int, offset: Any, count: int) -> int:
        if out_fd in fault.fds:
            real_sendfile(out_fd, in_fd, offset, max(1, os.fstat(in_fd).st_size // 2))
            os.fsync(out_fd)
            fault.hit()
        return real_sendfile(out_fd, in_fd, offset, count)

    set_attr = monkeypatch.setattr if monkeypatch is not None else setattr
    set_attr(builtins, "open", open_)
    set_attr(os, "sendfile", sendfile)


def install_from_env() -> None:
    spec = os.environ.get("FEDRCL_FAULT")
    if spec:
        install(spec)


class SignalAt(L.Callback):
    """Send ``signal`` to this process before step ``step`` of round ``round`` (1-based), on rank ``rank``.

    Args:
        round: the round in which the signal arrives.
        step: the round's batch index before which it is sent.
        signal: its name (``SIGTERM``, ``SIGUSR1``).
        rank: the process that receives it (the others learn of it from fedrcl).
    """

    def __init__(self, round: int = 2, step: int = 1, signal: str = "SIGTERM", rank: int = 0):
        self.round, self.step, self.signal, self.rank = round, step, signal, rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if (trainer.current_epoch + 1, batch_idx, trainer.global_rank) == (self.round, self.step, self.rank):
            os.kill(os.getpid(), getattr(signal, self.signal))
