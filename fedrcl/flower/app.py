"""The apps ``flwr run`` loads (``[tool.flwr.app.components]`` of ``examples/flower_app/pyproject.toml``).

The ServerApp reads fedrcl's arguments from the run config's ``fedrcl-args``; the ClientApp takes them from
the server's messages.
"""
from fedrcl.flower.client import make_client_app
from fedrcl.flower.server import make_server_app

server_app = make_server_app()
client_app = make_client_app()
