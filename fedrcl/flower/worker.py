"""A deployed node's worker: one process per SuperNode that keeps the node's built run between messages.

Flower 1.42's SuperNode starts a ``flwr-clientapp`` process for every message, which pulls that message and
exits. Building a fedrcl client run there (importing torch and Lightning, parsing the config, reading the
data, making the module) would cost every round seconds of start-up. So the ClientApp
(``fedrcl.flower.clientapp``) imports only Flower and this module and forwards the message to the node's
worker, ``python -m fedrcl.flower.worker``, started on the node's first message: it runs fedrcl's node
handlers (``fedrcl.flower.client``), which build the run once per (Flower run, fedrcl arguments, state
folder), as the simulation's Ray actors do, and answers with the reply.

A worker is keyed by its SuperNode (the ClientApp's parent process, ``watch``) and the node's ``state-dir``:
its folder ``<state-dir>/worker-<pid>`` (mode 0700) holds its Unix socket, its key (``authkey``, mode 0600;
``multiprocessing.connection``'s challenge) and its log (``worker.log``, kept after it exits: what it built
and when, each message's seconds). It runs in a session of its own and exits when its SuperNode's process
ends, on SIGTERM, or after ``idle`` seconds without a message (node config ``worker-idle``). It serves one
peer at a time, so a peer must pass the key's challenge within ``HANDSHAKE_TIMEOUT`` seconds and send each
frame within ``FRAME_TIMEOUT``; one that connects and stays silent is dropped, logged, and the next served.

The socket carries bytes only, never pickles: a request is the frames ``PROTOCOL``, a JSON header (the
ClientApp's ``sys.path``, so that modules of the Flower app import alike), Flower's own protobuf encoding of
the ``Context`` and of the ``Message`` (the SuperNode's wire format; arrays are ``.npy`` bytes read with
``allow_pickle=False``); a reply is ``PROTOCOL``, ``ok`` or ``error``, then the reply ``Message``'s protobuf
or the error's text. Anything else is refused, named, and the connection closed.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Optional

from flwr.app import Context, Message
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext  # pylint: disable=no-name-in-module
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=no-name-in-module

PROTOCOL = b"fedrcl-worker/1"
START_TIMEOUT = 120.0  # seconds a ClientApp waits for a worker it started to listen
FRAME_TIMEOUT = 60.0  # seconds the worker waits for each frame of a request
HANDSHAKE_TIMEOUT = 5.0  # seconds a peer has to pass the key's challenge before it is dropped
log = logging.getLogger("fedrcl.flower.worker")


class WorkerError(RuntimeError):
    """The worker refused or failed a message (its text is the worker's error), or could not be reached."""


class ProtocolError(ValueError):
    """A request that is not in the worker's format (``PROTOCOL`` frames): refused, never interpreted."""


def folder_of(state_dir: Path, watch: int) -> Path:
    return state_dir / f"worker-{watch}"


def socket_path(folder: Path) -> Path:
    """The worker's socket: in its folder, or, where that path is too long for a Unix socket (108 bytes),
    in a private folder of this user's under the temp folder (or ``/tmp``), named by a hash of the worker's
    folder."""
    inside = folder / "socket"
    if len(os.fsencode(inside)) < 100:
        return inside
    name = hashlib.sha256(os.fsencode(folder.resolve())).hexdigest()[:24] + ".sock"
    private = f"fedrcl-workers-{os.getuid()}"
    short = next((base / private for base in (Path(tempfile.gettempdir()), Path("/tmp"))
                  if len(os.fsencode(base / private / name)) < 100), None)
    if short is None:
        raise WorkerError(f"no Unix socket path short enough for the worker of {folder}: set TMPDIR shorter")
    short.mkdir(mode=0o700, exist_ok=True)
    if short.stat().st_uid != os.getuid() or short.stat().st_mode & 0o077:
        raise WorkerError(f"{short}: not a private folder of this user (mode 0700); no socket put there")
    return short / name


@contextmanager
def _locked(folder: Path, blocking: bool = True) -> Iterator[bool]:
    """Hold the worker folder's lock (a ClientApp's whole exchange; the worker's idle exit): yields whether
    it was taken."""
    with open(folder / "lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True


# -- the ClientApp's side ---------------------------------------------------------------------------------
def connect(folder: Path) -> Optional[Connection]:
    """A connection to the worker of ``folder`` (the key's challenge passed), or None if none listens."""
    try:
        return Client(str(socket_path(folder)), family="AF_UNIX", authkey=(folder / "authkey").read_bytes())
    except (FileNotFoundError, ConnectionError, EOFError):
        return None


def start(folder: Path, watch: int, idle: float) -> Connection:
    """Start a worker for ``folder`` (a new key, a session of its own) and connect to it."""
    key = folder / "authkey.new"
    key.unlink(missing_ok=True)
    descriptor = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(os.urandom(32))
    key.replace(folder / "authkey")
    socket_path(folder).unlink(missing_ok=True)
    with open(folder / "worker.log", "ab") as output:
        command = [sys.executable, "-m", "fedrcl.flower.worker", str(folder), "--watch", str(watch), "--idle",
                   str(idle)]
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT
    while (connection := connect(folder)) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            tail = (folder / "worker.log").read_text(errors="replace")[-3000:]
            raise WorkerError(f"the node's worker (pid {process.pid}) did not start; its log "
                              f"{folder / 'worker.log'} ends with:\n{tail}")
        time.sleep(0.05)
    return connection


def call(state_dir: Path, watch: int, idle: float, message: Message, context: Context) -> Message:
    """Have the worker of (``watch``, ``state_dir``) answer ``message`` (starting it if none runs); its reply,
    addressed as a reply to ``message``. A failure there raises ``WorkerError`` with the worker's error."""
    folder = folder_of(state_dir, watch)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    with _locked(folder):
        connection = connect(folder) or start(folder, watch, idle)
        with connection:
            header = json.dumps({"path": [p for p in sys.path if isinstance(p, str)], "age": process_age()})
            for frame in (PROTOCOL, header.encode(), context_to_proto(context).SerializeToString(),
                          message_to_proto(message).SerializeToString()):
                connection.send_bytes(frame)
            try:
                protocol, status, payload = (connection.recv_bytes() for _ in range(3))
            except (EOFError, ConnectionError):
                raise WorkerError(f"the node's worker ended while answering a "
                                  f"{message.metadata.message_type} message; see its log "
                                  f"{folder / 'worker.log'}") from None
    if protocol != PROTOCOL or status not in (b"ok", b"error"):
        raise WorkerError("the node's worker answered in another format")
    if status == b"error":
        raise WorkerError(payload.decode(errors="replace"))
    reply = message_from_proto(ProtoMessage.FromString(payload))
    return Message(reply.content, reply_to=message)


def process_age() -> Optional[float]:
    """Seconds since this process started (Linux's ``/proc``; else None): the ClientApp's start-up, logged by
    the worker for each message."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# -- the worker's side ------------------------------------------------------------------------------------
def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def read_request(connection: Connection) -> tuple[dict, Context, Message]:
    """A request's header (``path``: the ClientApp's ``sys.path``; ``age``: its process's age in seconds, or
    None), ``Context`` and ``Message``; ``ProtocolError`` for anything else."""
    frames = []
    for index in range(4):
        if not connection.poll(FRAME_TIMEOUT):
            raise ProtocolError(f"no frame {index + 1} of 4 within {FRAME_TIMEOUT:.0f} s")
        frames.append(connection.recv_bytes())
        if index == 0 and frames[0] != PROTOCOL:
            raise ProtocolError(f"the first frame is not {PROTOCOL.decode()!r}")
    try:
        header = json.loads(frames[1])
        path, age = header["path"], header["age"]
        if not (isinstance(path, list) and all(isinstance(p, str) for p in path)):
            raise TypeError("path is not a list of strings")
        if not (age is None or isinstance(age, (int, float))):
            raise TypeError("age is not a number")
        context = context_from_proto(ProtoContext.FromString(frames[2]))
        message = message_from_proto(ProtoMessage.FromString(frames[3]))
    except Exception as error:  # noqa: BLE001  # protobuf's DecodeError, a bad header: all refused alike
        raise ProtocolError(f"not a request of {PROTOCOL.decode()}: {type(error).__name__}: {error}") \
            from None
    return header, context, message


def _answer(connection: Connection, handle: Callable[[Message, Context], Message]) -> None:
    """Read one request, answer it with ``handle``'s reply or the error it raised."""
    try:
        header, context, message = read_request(connection)
    except ProtocolError as error:
        log.warning("refused a request: %s", error)
        for frame in (PROTOCOL, b"error", f"refused: {error}".encode()):
            connection.send_bytes(frame)
        return
    sys.path[:0] = [p for p in header["path"] if p not in sys.path]  # the Flower app's folder, as there
    started = time.perf_counter()
    kind = message.metadata.message_type
    try:
        reply = handle(message, context)
    except Exception as error:  # noqa: BLE001  # the node's error goes back to the server, named
        log.exception("%s message of run %s failed", kind, context.run_id)
        for frame in (PROTOCOL, b"error", f"{type(error).__name__}: {error}".encode()):
            connection.send_bytes(frame)
        return
    age = "" if header["age"] is None else f" (its ClientApp sent it {header['age']:.2f} s after starting)"
    log.info("%s message of run %s answered in %.2f s%s", kind, context.run_id, time.perf_counter() - started,
             age)
    for frame in (PROTOCOL, b"ok", message_to_proto(reply).SerializeToString()):
        connection.send_bytes(frame)


class _Handler:
    """fedrcl's node ClientApp (``fedrcl.flower.client``), imported on the first message."""

    def __init__(self) -> None:
        self.app: Optional[Callable[[Message, Context], Message]] = None

    def __call__(self, message: Message, context: Context) -> Message:
        if self.app is None:
            started = time.perf_counter()
            from fedrcl.flower.client import make_client_app

            self.app = make_client_app()
            log.info("imported fedrcl's node handlers in %.2f s", time.perf_counter() - started)
        return self.app(message, context)


def _time_limit(peer: socket.socket, seconds: float) -> None:
    """Make a blocking read or write on ``peer`` fail (``BlockingIOError``) after ``seconds`` without progress
    (``SO_RCVTIMEO`` / ``SO_SNDTIMEO``: the socket stays blocking, as ``Connection`` needs)."""
    limit = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)


def accept(server: socket.socket, authkey: bytes, handshake: float = HANDSHAKE_TIMEOUT) -> Connection:
    """The next peer on ``server`` as a ``Connection``, once it passed the key's challenge both ways (what
    ``multiprocessing.connection.Listener.accept`` does, which waits for a silent peer for ever) within
    ``handshake`` seconds; then each of its reads and writes may stall ``FRAME_TIMEOUT`` seconds. A peer that
    fails raises ``AuthenticationError``, ``EOFError`` or ``OSError`` (silent: ``BlockingIOError``)."""
    peer, _ = server.accept()
    with peer:  # the limits belong to the socket, which the connection's own descriptor shares
        _time_limit(peer, handshake)
        connection = Connection(os.dup(peer.fileno()))
        try:
            deliver_challenge(connection, authkey)
            answer_challenge(connection, authkey)
            _time_limit(peer, FRAME_TIMEOUT)
        except BaseException:
            connection.close()
            raise
    return connection


def serve(folder: Path, watch: int, idle: float) -> None:
    """Answer requests on ``folder``'s socket until process ``watch`` ends, SIGTERM, or ``idle`` seconds
    pass without a request."""
    os.umask(0o077)
    address = socket_path(folder)
    authkey = (folder / "authkey").read_bytes()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(address))
    server.listen()
    last, busy = [time.monotonic()], threading.Event()

    def leave(reason: str) -> None:
        log.info("worker pid %s exits: %s", os.getpid(), reason)
        for path in (address, folder / "authkey"):
            path.unlink(missing_ok=True)
        logging.shutdown()
        os._exit(0)

    def watchdog() -> None:
        while True:
            time.sleep(0.5)
            if not alive(watch):
                leave(f"its SuperNode (pid {watch}) ended")
            if not busy.is_set() and time.monotonic() - last[0] > idle:
                with _locked(folder, blocking=False) as taken:  # no ClientApp is about to connect
                    if taken:
                        leave(f"no message for {idle:.0f} s")

    signal.signal(signal.SIGTERM, lambda *_: leave("SIGTERM"))
    log.info("worker pid %s serves SuperNode pid %s at %s (idle exit after %.0f s)", os.getpid(), watch,
             address, idle)
    threading.Thread(target=watchdog, daemon=True).start()
    handle = _Handler()
    while True:
        try:
            connection = accept(server, authkey)
        except BlockingIOError:
            log.warning("dropped a peer: no handshake within %.0f s", HANDSHAKE_TIMEOUT)
            continue
        except Exception as error:  # noqa: BLE001  # a wrong key, a peer gone: the next one is served
            log.warning("refused a connection: %s: %s", type(error).__name__, error)
            continue
        busy.set()
        try:
            with connection:
                _answer(connection, handle)
        except (EOFError, OSError) as error:
            log.warning("the ClientApp went away: %s", error)
        finally:
            last[0] = time.monotonic()
            busy.clear()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedrcl.flower.worker",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="the worker's folder (<state-dir>/worker-<SuperNode pid>)")
    parser.add_argument("--watch", type=int, required=True, help="exit when this process (a SuperNode) ends")
    parser.add_argument("--idle", type=float, default=3600.0, help="exit after this many idle seconds")
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stdout)  # fedrcl's lines; Lightning's and Flower's have their own
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    logging.getLogger("fedrcl").addHandler(handler)
    logging.getLogger("fedrcl").setLevel(logging.INFO)
    serve(args.folder, args.watch, args.idle)


if __name__ == "__main__":
    main()
