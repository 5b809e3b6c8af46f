"""Client algorithms: one LightningModule each, differing from FedAvg only in their hooks."""
from fedrcl.algorithms.fedavg import FedAvg
from fedrcl.algorithms.fedrcl import FedRCL, FedSCL
from fedrcl.algorithms.fedprox import FedProx
from fedrcl.algorithms.fedlc import FedLC
from fedrcl.algorithms.feddecorr import FedDecorr
from fedrcl.algorithms.fedntd import FedNTD
from fedrcl.algorithms.fitnet import FitNet
from fedrcl.algorithms.moon import MOON
from fedrcl.algorithms.fedmlb import FedMLB
from fedrcl.algorithms.fedproc import FedProc
from fedrcl.algorithms.fedcl import FedCL
from fedrcl.algorithms.scaffold import SCAFFOLD
from fedrcl.algorithms.feddyn import FedDyn
from fedrcl.algorithms.fednova import FedNova
from fedrcl.algorithms.fedsam import FedSAM
from fedrcl.algorithms.fedcm import FedCM
from fedrcl.algorithms.mofedsam import MoFedSAM
from fedrcl.algorithms.fedgamma import FedGAMMA
from fedrcl.algorithms.fedspeed import FedSpeed
from fedrcl.algorithms.fedsmoo import FedSMOO

__all__ = ["FedAvg", "FedRCL", "FedSCL", "FedProx", "FedLC", "FedDecorr", "FedNTD", "FitNet", "MOON", "FedMLB",
           "FedProc", "FedCL", "SCAFFOLD", "FedDyn", "FedNova",
           "FedSAM", "FedCM", "MoFedSAM", "FedGAMMA", "FedSpeed", "FedSMOO"]
