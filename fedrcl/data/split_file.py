"""Client splits stored in files: fedrcl's JSON export and the FedRCL authors' released splits.

Two formats are read; the first is also written (``<log_dir>/split.json`` beside every run's config.yaml):

- ``fedrcl-split/1`` (JSON)::

      {"format": "fedrcl-split/1", "dataset": "cifar10", "num_clients": 100,
       "labels": {"num_samples": 50000, "num_classes": 10, "sha256": "...", "clients_sha256": [...]},
       "clients": [[index, ...], ...]}

  ``clients[k]`` holds client ``k``'s indices into the train set. ``labels`` (``LabelFingerprint``) says
  which labels the split was made for: indices alone mean nothing on the same images in another order (a
  non-IID split applied to CIFAR-10 in torchvision's order instead of a class-sorted copy trains near-IID
  clients), so a split is refused on data whose labels differ (``check_labels``). Files written before it
  had ``labels``, and the authors' files, are read with a one-line notice that they cannot be checked.
- The FedRCL authors' ``client_data/<DATASET>/balanced/dirichlet<alpha>_clients<N>.txt``: a Python dict
  literal ``{client_id: [index, ...], ...}`` with int ids ``0 .. N-1``. It is parsed into a syntax tree
  (``ast.parse``, which runs nothing) and accepted only when it is one dict of int keys to lists of int
  literals; the numbers are read off the tree. Their indices refer to torchvision's CIFAR order.

Whatever the format, a split read here has one sorted int64 array per client (as ``fedrcl.data.partition``
returns), no index held twice and, when the train-set size is given, every index inside the train set.
Every error is a ``ValueError`` naming the file and what is wrong.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import numpy.typing as npt

__all__ = ["SPLIT_FORMAT", "LabelFingerprint", "SplitFile", "label_fingerprint", "labels_differ", "read_split",
           "read_split_file", "write_split", "check_split", "check_labels", "authors_split_name"]

SPLIT_FORMAT = "fedrcl-split/1"
MAX_SPLIT_BYTES = 64 << 20  # ImageNet's 1.28 million train indices take about 10 MB as JSON
_JSON_KEYS = ("format", "dataset", "num_clients", "clients")  # and "labels", optional (files before it lack it)
_AUTHORS_NAME = re.compile(r"dirichlet(?P<alpha>\d+(?:\.\d+)?)_clients(?P<clients>\d+)\.txt")


@dataclass(frozen=True)
class LabelFingerprint:
    """The train labels a split was made for: their count, the class count, a sha256 of the whole label array
    (int64, little-endian) and a short sha256 of each client's labels (its indices in order), which says how
    many clients the difference reaches."""

    num_samples: int
    num_classes: int
    sha256: str
    clients_sha256: tuple[str, ...]


def _sha256(labels: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(labels, dtype="<i8").tobytes()).hexdigest()


def label_fingerprint(labels: npt.ArrayLike, parts: Sequence[npt.ArrayLike], num_classes: int) -> LabelFingerprint:
    """The ``LabelFingerprint`` of train ``labels`` under the split ``parts`` (one index array per client)."""
    y = np.asarray(labels).reshape(-1)
    return LabelFingerprint(len(y), int(num_classes), _sha256(y),
                            tuple(_sha256(y[np.sort(np.asarray(p, dtype=np.int64))])[:16] for p in parts))


def labels_differ(made_for: LabelFingerprint, here: LabelFingerprint) -> Optional[str]:
    """What differs between the labels a split was made for and these (``None``: the same labels): other train
    labels, or the same labels with a client whose labels (at its indices) differ from the recorded hash, a client
    edited by hand. (An edit that puts another sample of the same label at the same place is not seen: the hashes
    are of labels.)"""
    if made_for.num_samples != here.num_samples:
        return f"made for {made_for.num_samples} train samples, this data has {here.num_samples}"
    if made_for.num_classes != here.num_classes:
        return f"made for {made_for.num_classes} classes, this data has {here.num_classes}"
    if made_for.sha256 == here.sha256:
        edited = [k for k, (a, b) in enumerate(zip(made_for.clients_sha256, here.clients_sha256, strict=True))
                  if a != b]
        if not edited:
            return None
        more = f" (and {len(edited) - 1} more: {', '.join(map(str, edited[1:6]))}{' ...' * (len(edited) > 6)})"
        return (f"client {edited[0]}'s indices were edited after the file was written{more * (len(edited) > 1)}: "
                "its labels no longer match the per-client hashes the file records")
    clients = sum(a != b for a, b in zip(made_for.clients_sha256, here.clients_sha256, strict=True))
    return (f"labels differ from those the split was made for: {here.num_samples} samples and {here.num_classes} "
            f"classes in both, but {clients} of {len(here.clients_sha256)} clients hold other labels at the "
            "split's indices (the same images in another order?)" if clients else
            f"labels differ from those the split was made for: {here.num_samples} samples in both, the clients' "
            "labels alike, other labels outside the split's indices")


def write_split(path: str | Path, parts: Sequence[npt.ArrayLike], dataset: str,
                labels: Optional[LabelFingerprint] = None) -> Path:
    """Write ``parts`` (one index sequence per client) as ``fedrcl-split/1`` JSON, one client per line, with
    the fingerprint of the ``labels`` it was made for (``label_fingerprint``) when given.

    The file is written to a temporary name in the same folder and then renamed, so a reader never sees
    half a file. Returns the path written. A failed write (a full disk) raises ``OSError`` naming ``path``.
    """
    path = Path(path)
    clients = [[int(i) for i in np.asarray(p).reshape(-1).tolist()] for p in parts]
    head: dict[str, object] = {"format": SPLIT_FORMAT, "dataset": dataset, "num_clients": len(clients)}
    if labels is not None:
        head["labels"] = {**asdict(labels), "clients_sha256": list(labels.clients_sha256)}
    body = ",\n".join(json.dumps(c, separators=(",", ":")) for c in clients)
    text = json.dumps(head)[:-1] + ', "clients": [\n' + body + "\n]}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as error:
        Path(tmp).unlink(missing_ok=True)
        raise OSError(error.errno, f"{path} not written ({error.strerror})") from error
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@dataclass(frozen=True)
class SplitFile:
    """A split read from a file: one sorted int64 index array per client, and the labels it was made for
    (``None``: the file does not say)."""

    parts: list[np.ndarray]
    labels: Optional[LabelFingerprint]


def read_split(path: str | Path, num_clients: Optional[int] = None, num_samples: Optional[int] = None,
               dataset: Optional[str] = None) -> list[np.ndarray]:
    """``read_split_file(...).parts``: the client index arrays of a split file, checked."""
    return read_split_file(path, num_clients, num_samples, dataset).parts


def read_split_file(path: str | Path, num_clients: Optional[int] = None, num_samples: Optional[int] = None,
                    dataset: Optional[str] = None) -> SplitFile:
    """Read a client split in either format (told apart by content) and check it.

    Args:
        path: a ``fedrcl-split/1`` JSON file or an authors' ``dirichlet<alpha>_clients<N>.txt``.
        num_clients: the client count the split must have (``data.num_clients``); ``None``: any.
        num_samples: the train-set size every index must lie below; ``None``: checked later.
        dataset: the data set a JSON split must have been made for; ``None``: any. (The authors'
            files do not name their data set.)

    Returns:
        The ``SplitFile``: client ``k``'s sorted int64 index array at position ``k``, and the labels
        fingerprint if the file has one.
    """
    path = Path(path)
    try:
        text = _read_bounded(path)
    except FileNotFoundError:
        raise ValueError(f"data.partition_file: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"data.partition_file: cannot read {path} ({e})") from None
    labels = None
    try:
        obj = json.loads(text)
    except ValueError:
        parts = _parse_authors(text, path)
    else:
        parts = _parse_json(obj, path, dataset)
        labels = _parse_labels(obj.get("labels"), len(parts), path)
    if num_clients is not None and len(parts) != num_clients:
        raise ValueError(f"{path}: holds {len(parts)} clients, but data.num_clients is {num_clients}")
    check_split(parts, num_samples, str(path))
    return SplitFile([np.sort(p) for p in parts], labels)


def _read_bounded(path: Path) -> str:
    """The text of ``path``, read up to ``MAX_SPLIT_BYTES`` (a device such as ``/dev/zero`` never ends): a larger
    file is refused naming the limit, before it is read whole."""
    size = path.stat().st_size if path.is_file() else 0
    with open(path, "rb") as f:
        data = f.read(MAX_SPLIT_BYTES + 1) if size <= MAX_SPLIT_BYTES else b""
    if size > MAX_SPLIT_BYTES or len(data) > MAX_SPLIT_BYTES:
        what = f"{size} bytes" if size else f"a device or pipe giving more than {MAX_SPLIT_BYTES} bytes"
        raise ValueError(f"data.partition_file: {path} is {what}, more than a split file holds (at most "
                         f"{MAX_SPLIT_BYTES >> 20} MiB; a million indices take about 8 MB); not read")
    return data.decode("utf-8")


def check_labels(split: SplitFile, labels: npt.ArrayLike, num_classes: int, source: str) -> Optional[str]:
    """Raise ``ValueError`` (prefixed with ``source``) if ``split`` was made for other labels than these train
    ``labels``; a split that records none returns the notice to show (it cannot be checked), else ``None``."""
    here = label_fingerprint(labels, split.parts, num_classes)
    if split.labels is None:
        return (f"{source} records no labels it was made for (written before fedrcl recorded them, or the "
                "authors' format): it cannot be checked against this data's order")
    differ = labels_differ(split.labels, here)
    if differ and "were edited" in differ:
        raise ValueError(f"{source}: {differ}; use the file as fedrcl wrote it (split.json beside the run's "
                         "config.yaml), or leave out data.partition_file to compute the partition")
    if differ:
        raise ValueError(f"{source}: {differ}; use the split with the data it was made for, or leave out "
                         "data.partition_file to compute the partition from this data")
    return None


def check_split(parts: Sequence[np.ndarray], num_samples: Optional[int], source: str) -> None:
    """Raise ``ValueError`` (prefixed with ``source``) if a client holds no index, or an index is negative,
    not below ``num_samples`` (when given) or held twice, by one client or by two."""
    sizes = [len(p) for p in parts]
    empty = [k for k, size in enumerate(sizes) if size == 0]
    if empty:
        more = f" (and {len(empty) - 1} more: {', '.join(map(str, empty[1:6]))}{' ...' * (len(empty) > 6)})"
        raise ValueError(f"{source}: client {empty[0]} holds no samples{more * (len(empty) > 1)}; "
                         "every client needs at least one")
    flat = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0, np.int64)
    owner = np.repeat(np.arange(len(parts)), sizes)
    outside = flat < 0
    if num_samples is not None:
        outside |= flat >= num_samples
    bad = np.flatnonzero(outside)
    if len(bad):
        i = bad[0]
        allowed = "non-negative" if num_samples is None else \
            f"0 .. {num_samples - 1} (the train set has {num_samples} samples)"
        raise ValueError(f"{source}: client {owner[i]} holds index {flat[i]}, outside the train set: indices "
                         f"must be {allowed}")
    order = np.argsort(flat, kind="stable")
    repeated = np.flatnonzero(flat[order][1:] == flat[order][:-1])
    if len(repeated):
        first, second = order[repeated[0]], order[repeated[0] + 1]
        who = f"client {owner[first]} twice" if owner[first] == owner[second] else \
            f"clients {owner[first]} and {owner[second]}"
        raise ValueError(f"{source}: index {flat[first]} is held by {who}; a sample belongs to one client")


def authors_split_name(path: str | Path) -> Optional[tuple[float, int]]:
    """``(alpha, num_clients)`` read from an authors' file name ``dirichlet<alpha>_clients<N>.txt``;
    ``None`` for any other name."""
    match = _AUTHORS_NAME.fullmatch(Path(path).name)
    return (float(match["alpha"]), int(match["clients"])) if match else None


def _parse_json(obj: object, path: Path, dataset: Optional[str]) -> list[np.ndarray]:
    if not isinstance(obj, dict) or obj.get("format") != SPLIT_FORMAT:
        raise ValueError(f"{path}: a JSON file but not a {SPLIT_FORMAT} split: expected an object with "
                         f'"format": "{SPLIT_FORMAT}" and keys {", ".join(_JSON_KEYS)}')
    missing = [k for k in _JSON_KEYS if k not in obj]
    unknown = [k for k in obj if k not in (*_JSON_KEYS, "labels")]
    if missing or unknown:
        raise ValueError(f"{path}: {SPLIT_FORMAT} needs exactly the keys {', '.join(_JSON_KEYS)} (and may have "
                         "labels); "
                         + "; ".join(filter(None, [f"missing {', '.join(missing)}" if missing else None,
                                                   f"unknown {', '.join(unknown)}" if unknown else None])))
    if dataset is not None and obj["dataset"] != dataset:
        raise ValueError(f"{path}: a split of {obj['dataset']!r}, but data.dataset is {dataset!r}")
    clients = obj["clients"]
    if not isinstance(clients, list):
        raise ValueError(f'{path}: "clients" must be a list of index lists, got {type(clients).__name__}')
    if type(obj["num_clients"]) is not int or obj["num_clients"] != len(clients):
        raise ValueError(f'{path}: "num_clients" is {obj["num_clients"]!r} but "clients" holds '
                         f'{len(clients)} lists')
    parts = []
    for k, indices in enumerate(clients):
        if not isinstance(indices, list) or not all(type(i) is int for i in indices):
            raise ValueError(f'{path}: "clients"[{k}] must be a list of integers')
        parts.append(np.asarray(indices, dtype=np.int64))
    return parts


def _parse_labels(value: object, num_clients: int, path: Path) -> Optional[LabelFingerprint]:
    if value is None:
        return None
    fields = ("num_samples", "num_classes", "sha256", "clients_sha256")
    if not isinstance(value, dict) or set(value) != set(fields) or type(value["num_samples"]) is not int \
            or type(value["num_classes"]) is not int or not isinstance(value["sha256"], str) \
            or not isinstance(value["clients_sha256"], list) or len(value["clients_sha256"]) != num_clients \
            or not all(isinstance(h, str) for h in value["clients_sha256"]):
        raise ValueError(f'{path}: "labels" must be {{"num_samples": int, "num_classes": int, "sha256": str, '
                         f'"clients_sha256": [str, one per client ({num_clients})]}}')
    return LabelFingerprint(value["num_samples"], value["num_classes"], value["sha256"],
                            tuple(value["clients_sha256"]))


def _int_literal(node: ast.expr) -> Optional[int]:
    """The int an AST node spells (``5`` or ``-5``), or ``None`` for anything else (bool included)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int_literal(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def _describe(node: ast.AST) -> str:
    text = ast.unparse(node)
    return f"{text[:40] + ('...' if len(text) > 40 else '')!r} (line {getattr(node, 'lineno', '?')})"


def _parse_authors(text: str, path: Path) -> list[np.ndarray]:
    expected = f"expected the FedRCL authors' dict literal {{client_id: [index, ...], ...}} or {SPLIT_FORMAT}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text, filename=str(path), mode="eval")
    except SyntaxError as e:
        where = f"line {e.lineno}, column {e.offset}: " if e.lineno is not None else ""
        raise ValueError(f"{path}: cannot parse ({where}{e.msg}); {expected}") from None
    except (ValueError, MemoryError, RecursionError) as e:
        raise ValueError(f"{path}: cannot parse ({type(e).__name__}: {e}); {expected}") from None
    if not isinstance(tree.body, ast.Dict):
        raise ValueError(f"{path}: the file holds {type(tree.body).__name__.lower()} {_describe(tree.body)}, "
                         f"not a dict; {expected}")
    by_client: dict[int, np.ndarray] = {}
    for key, value in zip(tree.body.keys, tree.body.values):
        if key is None:
            raise ValueError(f"{path}: '**' unpacking ({_describe(value)}) is not allowed; {expected}")
        client = _int_literal(key)
        if client is None:
            raise ValueError(f"{path}: client id {_describe(key)} is not an integer; {expected}")
        if client in by_client:
            raise ValueError(f"{path}: client id {client} appears twice")
        if not isinstance(value, ast.List):
            raise ValueError(f"{path}: client {client} maps to {_describe(value)}, not a list of integers")
        indices = [_int_literal(e) for e in value.elts]
        if None in indices:
            bad = value.elts[indices.index(None)]
            raise ValueError(f"{path}: client {client} holds {_describe(bad)}, not an integer index")
        by_client[client] = np.asarray(indices, dtype=np.int64)
    missing = sorted(set(range(len(by_client))) - set(by_client))
    if missing:
        raise ValueError(f"{path}: {len(by_client)} clients must have the ids 0 .. {len(by_client) - 1}; "
                         f"missing {', '.join(map(str, missing[:5]))}{' ...' if len(missing) > 5 else ''}")
    return [by_client[k] for k in range(len(by_client))]
