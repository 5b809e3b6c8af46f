"""Standard output and error that a reader who went away cannot stop: ``fedrcl fit ... 2>&1 | head -3``.

Python ignores SIGPIPE, so a write to a pipe whose reader has closed it raises ``BrokenPipeError``, wherever it
happens: a progress line, Lightning's logging, the summary. Uncaught, it ended the run at its next write (exit
status 1, no checkpoint, nothing said). ``quiet_when_closed`` wraps ``sys.stdout`` and ``sys.stderr``: on the
first such error the stream's file descriptor is pointed at ``/dev/null`` (``os.dup2``, as Python's documentation
advises for SIGPIPE), the write is dropped, and every later write to that descriptor, by any object holding it
(Lightning's logging handler, a progress bar), goes nowhere. The run goes on quietly to its end; checkpoints,
event files, ``config.yaml`` and the exit status are those of a run whose output was read.
"""
from __future__ import annotations

import os
import sys
from typing import Any, TextIO

__all__ = ["QuietWhenClosed", "quiet_when_closed"]


class QuietWhenClosed:
    """A text stream that turns itself (its file descriptor) into ``/dev/null`` when its reader goes away."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._silence()
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
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
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, QuietWhenClosed):
            setattr(sys, name, QuietWhenClosed(stream))
