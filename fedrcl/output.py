"""Standard output and error that a reader who went away cannot stop: ``fedrcl fit ... 2>&1 | head -3``.

Python ignores SIGPIPE, so a write to a pipe whose reader has closed it raises ``BrokenPipeError``, wherever it
happens: a progress line, Lightning's logging, the summary. Uncaught, it ended the run at its next write (exit
status 1, no checkpoint, nothing said). ``quiet_when_closed`` wraps ``sys.stdout`` and ``sys.stderr``: on the
first such error the stream's file descriptor is pointed at ``/dev/null`` (``os.dup2``, as Python's documentation
advises for SIGPIPE), the write is dropped, and every later write to that descriptor, by any object holding it
(Lightning's logging handler, a progress bar), goes nowhere. The run goes on quietly to its end; checkpoints,
event files, ``config.yaml`` and the exit status are those of a run whose output was read.

A full device (``fedrcl methods > /dev/full``, a log on a full disk) is the same for the run: the stream goes to
``/dev/null`` and the run goes on; but the output is incomplete, so ``ended_output`` (called as the command ends)
says so in one line on standard error and the exit status is 1 (``--help`` included).
"""
from __future__ import annotations

import errno
import os
import sys
from typing import Any, Optional, TextIO

__all__ = ["QuietWhenClosed", "ended_output", "quiet_when_closed"]

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a device or quota that holds no more
_LOST: dict[str, OSError] = {}  # stream name -> the error that sent it to /dev/null (a full device)


class QuietWhenClosed:
    """A text stream that turns itself (its file descriptor) into ``/dev/null`` when its reader goes away."""

    def __init__(self, stream: TextIO, name: str = "standard output"):
        self._stream = stream
        self._name = name

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            self._gone(error)
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            self._gone(error)

    def _gone(self, error: OSError) -> None:
        """A closed pipe or a full device: silence the stream (``ended_output`` names a full one); any other
        error is raised."""
        if not isinstance(error, BrokenPipeError) and error.errno not in FULL:
            raise error
        if not isinstance(error, BrokenPipeError):
            _LOST.setdefault(self._name, error)
        self._silence()

    def _silence(self) -> None:
        """Point the stream's descriptor at ``/dev/null``; what it still buffers is flushed there."""
        try:
            descriptor = self._stream.fileno()
        except (AttributeError, OSError, ValueError):  # no descriptor (an in-memory stream): drop the write
            return
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, descriptor)
        finally:
            os.close(null)
        try:
            self._stream.flush()
        except OSError:
            pass

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer, ...: the stream's own
        return getattr(self._stream, name)


def quiet_when_closed() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` in ``QuietWhenClosed`` (once; a missing stream stays ``None``)."""
    for name, words in (("stdout", "standard output"), ("stderr", "standard error")):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, QuietWhenClosed):
            setattr(sys, name, QuietWhenClosed(stream, words))


def ended_output(code: Any = 0, prog: str = "fedrcl") -> None:
    """At the end of a command that exits with ``code``: flush standard output and error; if a full device
    swallowed part of either, say so in one line on standard error and exit with status 1 (``code``, if it is
    already an error)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            try:
                stream.flush()
            except OSError:  # a stream of someone else's (a test's capture): theirs to handle
                pass
    lost: Optional[tuple[str, OSError]] = next(iter(_LOST.items()), None)
    if lost is None:
        return
    _LOST.clear()
    name, error = lost
    print(f"{prog}: error: {name}: {error.strerror or os.strerror(error.errno or 0)} (what was written there is "
          "incomplete)", file=sys.stderr, flush=True)
    raise SystemExit(1 if code in (0, None) else code)
