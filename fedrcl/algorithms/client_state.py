"""Per-client persistent state (MOON's previous local model, ...) in safetensors files, loaded on demand.

A federation with 500 clients cannot hold 500 ResNet-18s (45 MB each) in memory. ``ClientStateStore``
keeps one safetensors file per client and version on disk, reads only the clients a round trains, and
holds at most ``max_in_memory`` states in a CPU read cache (least recently used first out).

Writes go straight to disk (write-through) and are atomic (temporary file, fsync, rename), so a crash never
loses a state that a checkpoint refers to. Resume is exact because files are versioned by round:
``client00042_round00017.safetensors``. The store's ``state_dict()`` (saved inside the Lightning checkpoint)
is its *manifest*, client -> absolute file path. A file is deleted only when no checkpoint refers to it:
a version superseded before any checkpoint took it goes at once; a version a checkpoint took is kept until
no checkpoint file in ``checkpoint_dirs`` (the run's checkpoint folders) refers to it any more, checked
when the next manifest is taken. So a kill while a checkpoint is written leaves the previous checkpoint
with all its files, and every round checkpoint of the run stays resumable. A resumed run loads the manifest
from its checkpoint, reads each client's file wherever it lies (the interrupted run's folder is never
written to or cleaned), and writes new versions into its own folder. A Flower node follows the server's
manifest, which each message carries: the version the server names stays until a later message names
another, so a reply lost with its node leaves the file that the message, sent again, names.

Cost: a state costs its tensors' bytes (ResNet-18, float32: 44.7 MB) on disk once per client and per kept
checkpoint that saw a new version of it (plus the versions trained since the last checkpoint), and at most
``max_in_memory`` of them in CPU memory. Deleting old round checkpoints frees their files at the next one.
Several processes share one folder (a client may train on another process in each round): each writes
the clients it trains and takes over (``adopt``) what the others wrote (MOON exchanges that after every
round), so every process holds the whole manifest, and the checkpoint that rank 0 writes covers every
process's clients.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor


def state_nbytes(state: Mapping[str, Tensor]) -> int:
    """Bytes held by the tensors of ``state``."""
    return sum(t.numel() * t.element_size() for t in state.values())


class ClientStateStore:
    """One state dict (``str -> Tensor``) per client, on disk, with a bounded CPU read cache.

    Args:
        directory: folder of this run's files (created on first write).
        max_in_memory: most client states kept in the CPU cache (0: every read goes to disk).
        checkpoint_dirs: folders of the run's checkpoints; a file a checkpoint took is deleted only once no
            ``*.ckpt`` there refers to it (none given: such files are never deleted).
    """

    def __init__(self, directory: Union[str, Path], max_in_memory: int = 8,
                 checkpoint_dirs: Iterable[Union[str, Path]] = ()):
        if max_in_memory < 0:
            raise ValueError(f"max_in_memory must be >= 0, got {max_in_memory}")
        self.directory = Path(directory).resolve()
        self.max_in_memory = max_in_memory
        self.checkpoint_dirs = [Path(d) for d in checkpoint_dirs]
        self._files: dict[int, Path] = {}       # current version of each client
        self._committed: set[Path] = set()      # versions a checkpoint took (kept while one refers to them)
        self._followed: dict[int, Path] = {}    # versions a server's manifest names (kept while it does)
        self._manifests: dict[Path, tuple[tuple[int, int, int], frozenset[Path]]] = {}  # checkpoint -> files
        self._cache: OrderedDict[int, dict[str, Tensor]] = OrderedDict()
        self.bytes_in_memory = 0

    def __contains__(self, client_id: int) -> bool:
        return client_id in self._files

    def __len__(self) -> int:
        return len(self._files)

    def file(self, client_id: int) -> Optional[Path]:
        """The file of client ``client_id``'s current state (``None`` if it has none)."""
        return self._files.get(client_id)

    def put(self, client_id: int, state: Mapping[str, Tensor], round_idx: int) -> Path:
        """Store a copy of ``state`` (any device) as client ``client_id``'s state after round ``round_idx``;
        returns the file written."""
        cpu = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"client{client_id:05d}_round{round_idx:05d}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(cpu, str(tmp), metadata={"client_id": str(client_id), "round_idx": str(round_idx)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a crash leaves the old version or the new one, never half a file
        old = self._files.get(client_id)
        self._files[client_id] = path
        if old is not None and old != path and self._followed.get(client_id) != old:
            self._discard(old)
        self._remember(client_id, cpu)
        return path

    def adopt(self, files: Mapping[int, Optional[Union[str, Path]]]) -> None:
        """Follow versions that another process wrote (client -> file; ``None``: the client has no state):
        later reads of those clients read them (cached copies are dropped). The writer deletes the versions
        they supersede."""
        for client_id, path in files.items():
            if path is None:
                self._files.pop(int(client_id), None)
            else:
                self._files[int(client_id)] = Path(path)
            dropped = self._cache.pop(int(client_id), None)
            if dropped is not None:
                self.bytes_in_memory -= state_nbytes(dropped)

    def follow(self, files: Mapping[int, Optional[Union[str, Path]]]) -> None:
        """Take a server's manifest for these clients (client -> file; ``None``: no state), as a Flower node
        does with each message: later reads follow it, and each named file is kept until a later message
        names another, since the reply that superseded it may be lost with its node and the message sent
        again. The version the server no longer names is then deleted, unless a checkpoint took it."""
        for client_id, named in files.items():
            client_id, path = int(client_id), None if named is None else Path(named)
            if path != self._files.get(client_id):
                self.adopt({client_id: path})
            released = self._followed.pop(client_id, None)
            if path is not None:
                self._followed[client_id] = path
            if released is not None and released != path:  # the current file is ``path`` now
                self._discard(released)

    def keep(self, paths: Iterable[Union[str, Path]]) -> None:
        """Versions that a checkpoint kept elsewhere refers to (a Flower server's, whose nodes hold the
        files): this store never deletes them."""
        self._committed.update(Path(p) for p in paths)

    def get(self, client_id: int, device: Optional[torch.device] = None) -> Optional[dict[str, Tensor]]:
        """Client ``client_id``'s state (``None`` if it has none), on ``device`` (default CPU).

        Cached tensors are shared with the cache when ``device`` is the CPU: do not modify them in place.
        """
        if client_id not in self._files:
            return None
        state = self._cache.get(client_id)
        if state is not None:
            self._cache.move_to_end(client_id)
        else:
            path = self._files[client_id]
            if not path.exists():
                raise FileNotFoundError(f"client {client_id}'s state {path} is missing: resume from the run's "
                                        "newest checkpoint (older ones may refer to cleaned-up files)")
            state = load_file(str(path))
            self._remember(client_id, state)
        if device is not None and torch.device(device).type != "cpu":
            return {k: v.to(device) for k, v in state.items()}
        return state

    def state_dict(self) -> dict[str, Any]:
        """The manifest (client -> file) for a checkpoint about to be written: those files are kept from now
        on while a checkpoint refers to them; older versions no checkpoint on disk refers to are deleted."""
        self._collect()
        self._committed.update(self._files.values())
        return {"files": {k: str(p) for k, p in self._files.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Read a manifest (resume): later reads follow it; later writes go to this store's directory."""
        self._files = {int(k): Path(p) for k, p in state_dict["files"].items()}
        self._committed = set(self._files.values())
        self._cache.clear()
        self.bytes_in_memory = 0

    # -- internals ----------------------------------------------------------------------------------------
    def _remember(self, client_id: int, state: dict[str, Tensor]) -> None:
        previous = self._cache.pop(client_id, None)
        if previous is not None:
            self.bytes_in_memory -= state_nbytes(previous)
        if self.max_in_memory == 0:
            return
        self._cache[client_id] = state
        self.bytes_in_memory += state_nbytes(state)
        while len(self._cache) > self.max_in_memory:
            _, evicted = self._cache.popitem(last=False)
            self.bytes_in_memory -= state_nbytes(evicted)

    def _discard(self, path: Path) -> None:
        """Delete a superseded version, unless a checkpoint took it or another run's folder holds it."""
        if path in self._committed or path.parent != self.directory:
            return
        path.unlink(missing_ok=True)

    def _collect(self) -> None:
        """Delete superseded versions a checkpoint took once no checkpoint file refers to them any more."""
        stale = self._committed - set(self._files.values())
        if not stale or not self.checkpoint_dirs:
            return
        self._manifests = {ckpt: self._manifest_of(ckpt)
                           for folder in self.checkpoint_dirs for ckpt in folder.glob("*.ckpt")}
        referenced = set().union(*(files for _, files in self._manifests.values()))
        for path in stale - referenced:
            self._committed.discard(path)
            self._discard(path)

    def _manifest_of(self, ckpt: Path) -> tuple[tuple[int, int, int], frozenset[Path]]:
        """The version key of checkpoint ``ckpt`` and the files it refers to, read once per version (a checkpoint
        is replaced atomically, so a new version has a new inode): each save then reads only new checkpoints."""
        try:
            st = ckpt.stat()
        except FileNotFoundError:
            return (0, 0, 0), frozenset()
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._manifests.get(ckpt)
        if cached is not None and cached[0] == key:
            return cached
        try:
            checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
            files = frozenset(Path(p) for p in checkpoint["client_state"]["files"].values())
        except Exception:  # noqa: BLE001 (unreadable or no manifest: it cannot resume, keeps nothing)
            files = frozenset()
        return key, files
