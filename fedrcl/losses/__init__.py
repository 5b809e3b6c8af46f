"""Pure loss functions (no state), one formula per module; client algorithms call them by name.

- ``relaxed_contrastive``: FedRCL's loss (``relaxed_contrastive_loss``) and its per-level parts.
- ``info_nce``: FedCL's two-view InfoNCE. ``model_contrastive``: MOON. ``prototype_contrastive``: FedProc.
- ``proximal``: FedProx's squared distance. ``decorrelation``: FedDecorr.
- ``not_true_distillation``: FedNTD. ``feature_distillation``: FitNet. ``branch_distillation``: FedMLB.
- ``logit_calibration``: FedLC. ``control_variate``: SCAFFOLD. ``dynamic_regularizer``: FedDyn.
- ``normalized_averaging``: FedNova. ``sharpness``: FedSAM's perturbation. ``client_momentum``: FedCM.
- ``prox_correction``: FedSpeed. ``perturbation_correction``: FedSMOO.
"""
from fedrcl.losses.branch_distillation import hybrid_branch_losses
from fedrcl.losses.client_momentum import global_update_direction, momentum_direction
from fedrcl.losses.control_variate import control_variate_delta, linear_term
from fedrcl.losses.decorrelation import decorrelation_loss
from fedrcl.losses.dynamic_regularizer import dual_update, dynamic_regularizer
from fedrcl.losses.feature_distillation import hint_losses
from fedrcl.losses.info_nce import info_nce
from fedrcl.losses.logit_calibration import calibrated_cross_entropy, calibration_offsets
from fedrcl.losses.model_contrastive import model_contrastive_loss
from fedrcl.losses.normalized_averaging import effective_mean, normalized_model, update_norm
from fedrcl.losses.not_true_distillation import not_true_distillation, not_true_logits
from fedrcl.losses.perturbation_correction import corrected_perturbation, fedsmoo_direction, \
    global_perturbation, perturbation_dual_update
from fedrcl.losses.prototype_contrastive import class_feature_sums, prototype_contrastive_loss
from fedrcl.losses.prox_correction import corrected_model, fedspeed_direction, prox_correction_update
from fedrcl.losses.proximal import squared_distance
from fedrcl.losses.relaxed_contrastive import relaxed_contrastive_loss, relaxed_contrastive_terms
from fedrcl.losses.sharpness import asam_scale, global_norm, sam_perturbation

__all__ = [
    "asam_scale",
    "calibrated_cross_entropy",
    "calibration_offsets",
    "class_feature_sums",
    "control_variate_delta",
    "corrected_model",
    "corrected_perturbation",
    "decorrelation_loss",
    "dual_update",
    "dynamic_regularizer",
    "effective_mean",
    "fedsmoo_direction",
    "fedspeed_direction",
    "global_norm",
    "global_perturbation",
    "global_update_direction",
    "hint_losses",
    "hybrid_branch_losses",
    "info_nce",
    "linear_term",
    "model_contrastive_loss",
    "momentum_direction",
    "normalized_model",
    "not_true_distillation",
    "not_true_logits",
    "perturbation_dual_update",
    "prototype_contrastive_loss",
    "prox_correction_update",
    "relaxed_contrastive_loss",
    "relaxed_contrastive_terms",
    "sam_perturbation",
    "squared_distance",
    "update_norm",
]
