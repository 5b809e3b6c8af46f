"""The ``fedrcl`` command's subcommands and their one-line help: a table that imports nothing, read by the
command (``fedrcl.cli``, before Lightning loads) and by LightningCLI's parser (``fedrcl.lightning_cli``)."""
from __future__ import annotations

# Subcommands that are not Trainer methods: name -> (module whose ``main(argv)`` runs it, one-line help).
OTHER_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "report": ("fedrcl.report", "Markdown tables of our runs beside the FedRCL paper's numbers."),
    "plot": ("fedrcl.plot", "Accuracy and EMA curves of your runs per method, mean and 95% band over seeds."),
    "seeds": ("fedrcl.seeds", "One fit per seed of a config (--together: all in one program, their clients in "
                              "one step); fedrcl report groups them (mean, std, 95% CI)."),
    "sweep": ("fedrcl.sweep", "A grid or random search over config keys, one run folder per (setting, seed) "
                              "(--together: the lrs and sweepable loss weights in one program)."),
    "check": ("fedrcl.check", "Run a method on every backend (sequential, batched, seeds together, two "
                              "processes, Flower) and compare the weights: does it give the same numbers "
                              "everywhere?"),
    "methods": ("fedrcl.methods", "The client methods and server optimizers, with their paper and options."),
}
# The Trainer's subcommands (LightningCLI's, without ``predict``) and their help: the first paragraph of
# ``FederatedTrainer``'s method docstrings, written here so that ``fedrcl --help`` needs no Lightning.
TRAINER_SUBCOMMANDS: dict[str, str] = {
    "fit": "Train the federation round by round, evaluating and checkpointing the global model.",
    "validate": "Evaluate a checkpoint's global model on the test set (``val/acc``, and the checkpoint's "
                "accuracy EMA).",
    "test": "Evaluate a checkpoint's global model on the test set, logged as ``test/acc``.",
}
DESCRIPTION = "FedRCL and its baselines: federated learning runs."
