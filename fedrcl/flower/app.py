"""The apps ``flwr run`` loads, both in one module (``examples/flower_app/pyproject.toml`` names the light
``fedrcl.flower.clientapp`` for its ClientApp, so that a node's ClientApp processes never import the server).

The ServerApp reads fedrcl's arguments from the run config's ``fedrcl-args``; the ClientApp takes them from
the server's messages.
"""
from fedrcl.flower.clientapp import client_app
from fedrcl.flower.server import make_server_app

server_app = make_server_app()

__all__ = ["client_app", "server_app"]
