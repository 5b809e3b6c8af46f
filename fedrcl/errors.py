"""What fedrcl reports as an error of the user's (one line, no traceback) and how it names the key.

``fedrcl.cli.report_user_error`` prints these; everything else keeps its traceback. Nothing here imports
Lightning or torch: the command's own errors must not wait for them.
"""
from __future__ import annotations

import errno
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, Optional

# Errors of the file system that are the machine's state, not a bug: a full disk, a read-only or foreign folder.
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def user_error(error: BaseException) -> bool:
    """Whether ``error`` is one fedrcl raised about its input (a ``raise`` in fedrcl's own code: a bad value,
    file, checkpoint or config, a diverged run), as opposed to a bug or a library's failure."""
    if not isinstance(error, Exception):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    package = Path(__file__).resolve().parent
    return Path(last.filename).resolve().is_relative_to(package) and (last.line or "").lstrip().startswith("raise")


def disk_error(error: Optional[BaseException]) -> Optional[OSError]:
    """The ``OSError`` of a full disk or an unwritable folder that ``error`` is or was raised from (torch wraps
    a failed write in a ``RuntimeError``), else ``None``."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in DISK_ERRORS:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def fedrcl_error(error: BaseException) -> Optional[BaseException]:
    """The fedrcl error (``user_error``) that ``error`` is or was raised from (``raise ... from``): jsonargparse
    wraps what a constructor refuses (``--model.init_args.lr -0.1``) in a ``ValueError`` of its own."""
    current: Optional[BaseException] = error
    while current is not None:
        if user_error(current):
            return current
        current = current.__cause__
    return None


def typed_pairs(argv: Sequence[str]) -> list[tuple[str, str]]:
    """``(key, value)`` of each ``--key value`` / ``--key=value`` in ``argv``, as typed (without ``--``)."""
    pairs = []
    for i, arg in enumerate(argv):
        if arg.startswith("--") and "=" in arg:
            key, value = arg[2:].split("=", 1)
            pairs.append((key, value))
        elif arg.startswith("--") and i + 1 < len(argv):
            pairs.append((arg[2:], argv[i + 1]))
    return pairs


def with_typed_key(error: BaseException, argv: Sequence[str]) -> str:
    """``error``'s message naming the constructor argument it refuses by the key the user typed.

    A constructor names its own argument (``model.lr``, ``conv_padding``); the user typed
    ``--model.init_args.lr -0.1``. The argument is one of the raising ``__init__``'s parameters named in the
    message whose typed key ends in it with the value it received. A dotted name in the message becomes the
    typed key; a bare one gets ``--key value:`` in front. When no typed key matches (a value from a config
    file), ``model.<arg>`` becomes ``model.init_args.<arg>``, where a config holds a method's arguments."""
    import yaml

    message, tb = str(error), error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or tb.tb_frame.f_code.co_name != "__init__":
        return message
    code, values = tb.tb_frame.f_code, tb.tb_frame.f_locals
    params = code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]
    if not params:
        return message
    for name in params:
        mentioned = re.search(rf"(?<![\w.])((?:\w+\.)*){re.escape(name)}\b", message)
        if not mentioned:
            continue
        for key, value in reversed(typed_pairs(argv)):  # the last one typed wins, as in the parser
            try:
                same = key.split(".")[-1] == name and yaml.safe_load(value) == values.get(name)
            except yaml.YAMLError:
                same = False
            if same:
                if mentioned.group(1):
                    return message[:mentioned.start()] + key + message[mentioned.end():]
                return f"--{key} {value}: {message}"
    return re.sub(rf"(?<![\w.])model\.({'|'.join(map(re.escape, params))})\b", r"model.init_args.\1", message)


def command_error(prog: str, message: str) -> NoReturn:
    """``<prog>: error: <message>`` on stderr and exit status 2 (argparse's, without the usage)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
