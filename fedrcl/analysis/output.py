"""Where ``fedrcl report`` and ``fedrcl plot`` write: checked before anything is read or printed.

A file that cannot be written (its folder read-only, a regular file where a folder should be, a folder where
the file should be) is one line naming the path, before the command prints a table that would look like
success; a write that fails anyway (a full disk) is one line too.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

__all__ = ["make_parent", "out_file_problem", "write_text"]


def out_file_problem(path: Path) -> Optional[str]:
    """Why a file cannot be written at ``path`` (its missing folders to be made), or ``None`` when it can."""
    if path.is_dir():
        return f"{path} is a folder; give a file name"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{path} is read-only"
    existing = next(folder for folder in (path.parent, *path.parent.parents) if folder.exists())
    if not existing.is_dir():
        return f"{path}: {existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{path}: cannot write in {existing} (read-only or not yours)"
    return None


def make_parent(path: Path) -> None:
    """Makes ``path``'s missing folders; ``ValueError`` naming the path when the system refuses."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror or error}") from error


def write_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` (making its folders); ``ValueError`` naming the path when that fails."""
    make_parent(path)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as error:
        raise ValueError(f"{path} not written ({error.strerror or error})") from error
