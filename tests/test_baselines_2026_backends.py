"""The 2026 baselines (issue 52) on the backends their own tests do not cover, shrunk from ``fedrcl check``'s rows
(docs/methods.md, "The 2026 baselines on every backend"): seeds trained together and two processes, each equal to
the method's own ``fedrcl fit`` in float64 (<= 1e-9 relative, as ``fedrcl check`` judges; the same client steps).
Batched clients: ``test_baselines_2026`` (``ENGINE_RUNS``), ``test_fedsmoo``, ``test_step_mask``; seeds together
of FedSAM, FedNova and FedSMOO: ``test_step_mask``, ``test_fedsmoo``; Flower: ``test_flower``'s ``METHODS``."""
from __future__ import annotations

import pytest

from conftest import REPO, run_cli
from fedrcl import seeds
from test_multiprocess import FIVE_CLIENTS, fit_two_processes, last_run
from test_together import args as together_args
from test_together import last as together_last
from test_together import relative_difference

CONFIGS = REPO / "configs" / "methods"
# method: its config and what its setting needs (FedNova: clients of different step counts and local momentum, the
# case where its normalisation is not FedAvg's; FedCM and MoFedSAM refuse clients of different step counts)
METHODS = {
    "FedSAM": ("fedasam", ()),  # the adaptive perturbation; the plain one trains together in test_step_mask
    "MoFedSAM": ("mofedsam", ("--data.local_iters_per_epoch", "3")),
    "FedCM": ("fedcm", ("--data.local_iters_per_epoch", "3")),
    "FedNova": ("fednova", ("--data.partition", "dirichlet_unbalanced", "--model.init_args.momentum", "0.5")),
    "FedGAMMA": ("fedgamma", ()),
    "FedSpeed": ("fedspeed", ()),
    "FedSMOO": ("fedsmoo", ()),
}
TOGETHER = ["FedSAM", "MoFedSAM", "FedCM", "FedGAMMA", "FedSpeed"]  # the rest: the tests named above
# one method per kind of exchange two processes must get right beyond FedAvg's mean: a downlink the server copy
# makes (FedCM's global update; MoFedSAM's is the same), reports summed over the processes with clients of
# different step counts (FedNova's update norms), per-client state files with a server step on summed reports and
# a broadcast (FedSMOO). FedGAMMA's server is SCAFFOLD's and FedSpeed's client state is FedDyn's kind, both over two
# processes in test_scaffold_feddyn; FedSAM sends and keeps nothing more than FedAvg (test_multiprocess).
PROCESSES = ["FedCM", "FedNova", "FedSMOO"]


def method_args(method: str) -> tuple[str, ...]:
    config, extra = METHODS[method]
    return ("--config", str(CONFIGS / f"{config}.yaml"), "--trainer.precision", "64-true", *extra)


@pytest.mark.parametrize("method", TOGETHER)
def test_seeds_together_give_each_seed_its_own_fit(data_root, tmp_path, capsys, method):
    """Seeds 0 and 1 trained together (no fallback): seed 0 has the weights and the local steps of its own fit."""
    model = f"fedrcl.algorithms.{method}"
    seeds.main(["--seeds", "0", *together_args(data_root, tmp_path / "alone", *method_args(method), rounds=2,
                                               model=model)])
    capsys.readouterr()
    seeds.main(["--seeds", "0", "1", "--together", *together_args(data_root, tmp_path / "together",
                                                                  *method_args(method), rounds=2, model=model)])
    assert "--together:" not in capsys.readouterr().out  # trained together
    alone, together = together_last(tmp_path / "alone", 0), together_last(tmp_path / "together", 0)
    assert relative_difference(together["state_dict"], alone["state_dict"]) <= 1e-9
    assert together["global_step"] == alone["global_step"]


@pytest.mark.slow
@pytest.mark.parametrize("method", PROCESSES)
def test_two_processes_give_one_process_weights(data_root, tmp_path, method):
    """Five clients a round split 3 / 2 over two CPU processes (their uploads and server reports summed across
    them): the weights of one process (float64, 1e-9) and the same local steps."""
    model = f"fedrcl.algorithms.{method}"
    one = run_cli(data_root, tmp_path / "one", *FIVE_CLIENTS, *method_args(method), rounds=2, model=model)
    fit_two_processes(data_root, tmp_path / "two", *method_args(method), rounds=2, model=model)
    ckpt, _ = last_run(tmp_path / "two")
    assert ckpt["global_step"] == one.trainer.global_step
    assert relative_difference(ckpt["state_dict"], one.model.state_dict()) <= 1e-9
