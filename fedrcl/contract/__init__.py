"""The contract between a client method and the drivers that run it, on the lowest floor of the package.

Everything a method (``fedrcl.algorithms``), a server optimizer (``fedrcl.server``) or the data
(``fedrcl.data``) shares with the drivers (``fedrcl fit``'s round loop, batched clients, several processes,
Flower) lives here and imports nothing else of fedrcl:

- ``context``: ``ClientContext``, one client's facts in a round, and ``ClientData``, its own data;
- ``exchange``: the hooks a method exchanges besides the weights, and their check before training;
- ``plan``: ``RoundPlan``, which clients a process trains in a round and their steps;
- ``step_mask``: clients with different step counts on one stacked axis (which step when, on which batch size),
  shared by the data's stacked batches and both stacked engines;
- ``processes``: sums and gathers over the processes a run spans;
- ``weights``: loading and copying a model's weights;
- ``protocols``: batched clients as a method sees them.
"""
from fedrcl.contract.context import ClientContext, ClientData
from fedrcl.contract.exchange import ClientExchange, ServerExchange, check_method
from fedrcl.contract.plan import RoundPlan

__all__ = ["ClientContext", "ClientData", "ClientExchange", "RoundPlan", "ServerExchange", "check_method"]
