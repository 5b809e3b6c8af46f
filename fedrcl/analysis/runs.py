"""Reading runs back from their logs (for notebooks, ``fedrcl report`` and ``fedrcl plot``).

A run is a folder ``<save_dir>/<name>`` written by Lightning's TensorBoardLogger (event files) or CSVLogger
(``metrics.csv``), with one ``version_k`` sub-folder per start; a run resumed with ``--ckpt_path last``
continues in a new version. Both loggers get the round as their step, so both read back against the round. A run's curve
is the union of its versions' points, a later version's point replacing an earlier one at the same round.
``fedrcl validate`` / ``test`` log beside them in ``<subcommand>_k`` folders, which are not versions: they
never enter a run's curves. Which folders are runs, and which versions make one run, is the catalogue's
(``fedrcl.analysis.catalogue``).

A log that cannot be read whole is never skipped in silence: ``read_scalars`` returns it with why (an event
file cut short mid-record, a record that fails its checksum, a file the system will not open, a
``metrics.csv`` that is not one), and keeps the points read before the damage; ``load_scalars`` warns.
Event files are read record by record (TFRecord framing, each record's CRC checked, as TensorBoard's own
reader does) because TensorBoard's ``EventAccumulator`` stops at a damaged record without a word.
"""
from __future__ import annotations

import csv
import struct
import warnings
from pathlib import Path
from typing import Optional

import numpy as np

__all__ = ["Curve", "LogProblem", "has_logs", "load_scalars", "read_scalars"]

Curve = tuple[np.ndarray, np.ndarray]
"""``(rounds, values)``: int64 and float64 arrays, rounds ascending."""

LogProblem = tuple[Path, str]
"""``(log file, why it was not read whole)``."""

Points = dict[str, dict[int, float]]
MAX_EVENT_BYTES = 1 << 30  # an event file is read whole; a run's scalars take a few MB, its figures more


def version_number(path: Path) -> int:
    """``k`` of a ``version_k`` folder (-1 for another name), to sort versions as they were started."""
    suffix = path.name.removeprefix("version_")
    return int(suffix) if suffix.isdigit() else -1


def event_files(version: Path) -> list[Path]:
    """A folder's TensorBoard event files (TensorBoard reads any file with "tfevents" in its name), by name."""
    return sorted(p for p in version.glob("*tfevents*") if p.is_file())


def has_logs(version: Path) -> bool:
    """Whether a version folder holds a TensorBoard event file or a CSVLogger ``metrics.csv``."""
    return bool(event_files(version)) or (version / "metrics.csv").is_file()


def read_scalars(run: str | Path) -> tuple[dict[str, Curve], list[LogProblem]]:
    """Every scalar tag of a run (all its versions merged, in version order) and the log files not read whole.

    Args:
        run: a run folder (holding ``version_*``), a single version folder or an event file; a version's
            event files and its ``metrics.csv`` are both read.
    """
    run = Path(run)
    versions = sorted(run.glob("version_*"), key=version_number) or [run]
    points: Points = {}
    problems: list[LogProblem] = []
    for version in versions:
        for path in [run] if run.is_file() else event_files(version):
            why = _read_event_file(path, points)
            if why is not None:
                problems.append((path, why))
        if (version / "metrics.csv").is_file():
            why = _read_metrics_csv(version / "metrics.csv", points)
            if why is not None:
                problems.append((version / "metrics.csv", why))
    curves: dict[str, Curve] = {}
    for tag, by_step in sorted(points.items()):
        steps = np.array(sorted(by_step), dtype=np.int64)
        curves[tag] = steps, np.array([by_step[s] for s in steps], dtype=np.float64)
    return curves, problems


def load_scalars(run: str | Path) -> dict[str, Curve]:
    """Every scalar tag of a run (all its versions merged): ``{tag: (rounds, values)}``; a warning names each
    log file not read whole (``read_scalars``).

    Args:
        run: a run folder (holding ``version_*``), a single version folder or an event file; a version's
            event files and its ``metrics.csv`` are both read.
    """
    curves, problems = read_scalars(run)
    for path, why in problems:
        warnings.warn(f"{path}: {why}", stacklevel=2)
    return curves


def _read_event_file(path: Path, points: Points) -> Optional[str]:
    """Adds the scalars of one event file to ``points``; why it stopped before the end, or ``None``.

    A TFRecord is ``length`` (uint64), its masked CRC32C (uint32), ``length`` bytes of an ``Event`` proto and
    their masked CRC32C; Lightning's TensorBoardLogger writes each scalar as a ``simple_value``.
    """
    # tensorboard is imported here: reading a CSVLogger run, or importing this module, needs none of it
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    try:
        size = path.stat().st_size
        if not path.is_file() or size > MAX_EVENT_BYTES:  # a device or a pipe never ends; read whole below
            what = f"{size} bytes" if path.is_file() else "not a regular file"
            return f"{what}, more than fedrcl reads of an event file ({MAX_EVENT_BYTES >> 30} GiB); not read"
        data = path.read_bytes()
    except OSError as error:
        return f"not readable ({error.strerror or error})"
    offset, last_round = 0, None

    def stopped(what: str) -> str:
        after = "nothing read" if last_round is None else f"rounds after {last_round} not read"
        return f"{what} at byte {offset} of {len(data)}; {after}"

    while offset < len(data):
        if offset + 12 > len(data):
            return stopped("truncated (the writer stopped mid-record: killed, a full disk, or still writing)")
        (length,), (length_crc,) = struct.unpack_from("<Q", data, offset), struct.unpack_from("<I", data, offset + 8)
        if masked_crc32c(data[offset:offset + 8]) != length_crc:
            return stopped("corrupt (a record's length fails its checksum)")
        end = offset + 12 + length
        if end + 4 > len(data):
            return stopped("truncated (the writer stopped mid-record: killed, a full disk, or still writing)")
        payload = data[offset + 12:end]
        if masked_crc32c(payload) != struct.unpack_from("<I", data, end)[0]:
            return stopped("corrupt (a record fails its checksum)")
        try:
            event = Event.FromString(payload)
        except DecodeError:
            return stopped("corrupt (a record is not a TensorBoard event)")
        for value in event.summary.value:
            if value.HasField("simple_value"):
                points.setdefault(value.tag, {})[event.step] = value.simple_value
                last_round = event.step
        offset = end + 4
    return None


def _read_metrics_csv(path: Path, points: Points) -> Optional[str]:
    """Adds the scalars of a CSVLogger ``metrics.csv`` to ``points`` (one row per ``log_metrics`` call, a column
    per tag, empty where the call did not log it; ``epoch`` is Lightning's own column, not a scalar); why it
    stopped before the end, or ``None``."""
    line = 1
    try:
        with path.open(newline="", encoding="utf-8") as file:
            reader = csv.DictReader(file)
            for row in reader:
                line = reader.line_num
                step = row.pop("step", "")
                row.pop("epoch", None)
                if step in ("", None):
                    continue
                at = int(float(step))
                values = {tag: float(value) for tag, value in row.items() if value not in ("", None)}
                for tag, value in values.items():
                    points.setdefault(tag, {})[at] = value
    except OSError as error:
        return f"not readable ({error.strerror or error})"
    except (ValueError, TypeError, UnicodeDecodeError, csv.Error) as error:
        return f"not a CSVLogger metrics.csv from line {line} on ({error}); the rows before it are read"
    return None
