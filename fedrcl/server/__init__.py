"""Server optimizers: what clients receive and how their average becomes the next global model.

Picked with ``trainer.server`` (class path plus init_args), e.g. ``--config configs/server/fedacg.yaml``.
"""
from fedrcl.server.base import FedAvg, ServerOptimizer, StatefulServer
from fedrcl.server.fedacg import FedACG
from fedrcl.server.fedavgm import FedAvgM
from fedrcl.server.feddyn import FedDyn
from fedrcl.server.fednova import FedNova
from fedrcl.server.fedsmoo import FedSMOO
from fedrcl.server.fedopt import FedAdagrad, FedAdam, FedOpt, FedYogi
from fedrcl.server.scaffold import SCAFFOLD

__all__ = ["FedACG", "FedAdagrad", "FedAdam", "FedAvg", "FedAvgM", "FedDyn", "FedNova", "FedOpt", "FedSMOO",
           "FedYogi", "SCAFFOLD", "ServerOptimizer", "StatefulServer"]
