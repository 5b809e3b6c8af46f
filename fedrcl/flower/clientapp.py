"""The ClientApp ``flwr run`` loads (``examples/flower_app``'s ``clientapp`` component), light: it imports
Flower and ``fedrcl.flower.node`` / ``worker``, never torch or Lightning.

Every message is answered by fedrcl's node handlers (``fedrcl.flower.client``): on a deployed SuperNode, which
starts this ClientApp in a new process for every message, by the node's worker process, which keeps the
built run between messages (``fedrcl.flower.worker``; started on the node's first message); in Flower's
simulation, whose Ray actors live for the run, in this process (node config ``worker``:
``fedrcl.flower.node``).
A SecAgg+ round (``fedrcl.flower.secure_aggregation``) runs Flower's ``secaggplus_mod`` here, in the process the
SuperNode gives the node's context to (the protocol's keys live in it between messages); only its masked-vector
stage reaches the node handlers, which then answer with the node's update for the mod to mask.
A ``query`` first checks the node's own configuration (``fedrcl.flower.node.check``) and refuses a bad one,
named, before anything is started or built.
"""
from __future__ import annotations

import os
from typing import Callable

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedrcl.flower import node, worker
from fedrcl.flower.secure_aggregation import secure_aggregation_mod

_IN_PROCESS: list[Callable[[Message, Context], Message]] = []  # the node handlers, once imported here


def _answer(message: Message, context: Context) -> Message:
    if node.uses_worker(context.node_config):
        config = context.node_config  # the SuperNode's process (here Flower's SuperExec) is this one's parent
        return worker.call(node.state_base(config), os.getppid(), node.idle_seconds(config), message, context)
    if not _IN_PROCESS:
        from fedrcl.flower.client import make_client_app

        _IN_PROCESS.append(make_client_app())
    return _IN_PROCESS[0](message, context)


def make_light_client_app() -> ClientApp:
    """The ClientApp of the module docstring."""
    app = ClientApp(mods=[secure_aggregation_mod])  # SecAgg+ rounds' messages go through Flower's mod

    @app.query()
    def query(message: Message, context: Context) -> Message:
        node.check(context.node_config)  # before a worker or a run is started
        return _answer(message, context)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return _answer(message, context)

    return app


client_app = make_light_client_app()
