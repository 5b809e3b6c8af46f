"""The ``fedrcl`` command: LightningCLI over (client algorithm, federated dataset, FederatedTrainer).

    fedrcl fit --config configs/quickstart.yaml
    fedrcl fit --config configs/cifar100_a005.yaml --model fedrcl.algorithms.FedAvg
    fedrcl fit --config configs/cifar100_a005.yaml --ckpt_path last
    fedrcl validate --config configs/quickstart.yaml \
        --ckpt_path runs/quickstart/version_0/checkpoints/last.ckpt
    fedrcl report runs          # our runs beside the paper's tables (fedrcl.report)
    fedrcl plot runs            # accuracy and EMA curves per method (fedrcl.plot)
    fedrcl seeds --seeds 0 1 2 --config configs/quickstart.yaml     # one fit per seed (fedrcl.seeds)
    fedrcl sweep --grid model.init_args.lr=0.03,0.1 --seeds 0 1 --config configs/quickstart.yaml  # (fedrcl.sweep)
    fedrcl methods              # the client methods and server optimizers: paper, options (fedrcl.methods)

This module reads the subcommand before it imports Lightning: ``fedrcl --help``, a wrong subcommand and
``OTHER_SUBCOMMANDS`` (``report``, ``seeds``, ...) never load it; ``fit``, ``validate`` and ``test`` go to
``fedrcl.lightning_cli`` (LightningCLI), whose names (``FedRCLCLI``, ``build_cli``, ...) are also reachable
here, imported on first use.

Errors: a bad value, file, checkpoint or config ends in ``fedrcl: error: <message>`` (the key as typed or
the file, what was found, what is allowed), exit status 1, or 2 for a config the parser refuses (no usage
dump); ``FEDRCL_DEBUG=1`` shows the traceback. A fedrcl error is one fedrcl raises itself, also when a library
wraps it (a model constructor's ``ValueError`` inside jsonargparse's), or a file that cannot be written (a full
disk, a read-only folder): see ``fedrcl.errors``; any other keeps its traceback. A start that fails before
it logged anything leaves no run folder behind. A run stopped by SIGTERM or Ctrl-C ends after its round with
exit status 143 / 130 and one line saying how to resume (``fedrcl.federated.preemption``); a second Ctrl-C
stops it at once, in one line. A torch and torchvision of builds that do not match are one line naming both
and the pip line that fixes them (``fedrcl.torch_builds``).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Sequence
from importlib import import_module
from typing import Any, Optional

from fedrcl.commands import DESCRIPTION, OTHER_SUBCOMMANDS, TRAINER_SUBCOMMANDS
from fedrcl.errors import disk_error, fedrcl_error, with_typed_key
from fedrcl.torch_builds import import_problem, pair_problem


class CommandParser(argparse.ArgumentParser):
    """argparse whose refusal is ``fedrcl: error: ...`` and where the options are listed (no usage dump), as
    the subcommands' own parser (``fedrcl.lightning_cli.FedRCLParser``) answers."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message}\n(all options: {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def command_parser() -> CommandParser:
    """``fedrcl`` above its subcommands: their list for ``--help`` and the refusal of an unknown one."""
    names = [*TRAINER_SUBCOMMANDS, *OTHER_SUBCOMMANDS]
    # The subcommands' list on the usage line's first line, also in an 80-column terminal (argparse wraps it).
    width = max(100, shutil.get_terminal_size().columns - 2)
    parser = CommandParser(prog="fedrcl", description=DESCRIPTION,
                           formatter_class=lambda prog: argparse.HelpFormatter(prog, width=width),
                           epilog="Each subcommand lists its own options: fedrcl fit --help.")
    subcommands = parser.add_subparsers(title="subcommands", dest="subcommand", required=True,
                                        metavar="{" + ",".join(names) + "}")
    for name, text in [*TRAINER_SUBCOMMANDS.items(), *((k, v[1]) for k, v in OTHER_SUBCOMMANDS.items())]:
        subcommands.add_parser(name, help=text.replace("%", "%%"), add_help=False)  # argparse formats help
    return parser


def report_user_error(error: BaseException, prog: str = "fedrcl", argv: Sequence[str] = ()) -> bool:
    """Print a fedrcl error (``fedrcl_error``, data that cannot be found or fetched, a file that cannot be
    written) as one message without its traceback, naming the key as typed in ``argv``; ``False`` for any
    other error, and with ``FEDRCL_DEBUG=1``, whose traceback the caller shows."""
    if os.environ.get("FEDRCL_DEBUG") == "1":
        return False
    data = sys.modules.get("fedrcl.data.datasets")
    ours = fedrcl_error(error)
    disk = disk_error(error)
    if isinstance(ours, OSError) and ours.strerror:  # its words, without "[Errno 28]"
        message = ours.strerror
    elif ours is not None:
        message = with_typed_key(ours, argv)
    elif data is not None and isinstance(error, data.DataUnavailableError):
        message = str(error)
    elif disk is not None:
        where = f"{disk.filename}: " if disk.filename else ""  # as the shell says it (also a read refused)
        assert disk.errno is not None  # disk_error matched it by its errno
        message = f"{where}{disk.strerror or os.strerror(disk.errno)}"
    else:
        return False
    print(f"{prog}: error: {message}\n(FEDRCL_DEBUG=1 shows where it was raised)", file=sys.stderr, flush=True)
    return True


def split_ckpt_path(args: list[str]) -> tuple[list[str], Optional[str]]:
    """``fedrcl fit``'s ``--ckpt_path PATH`` (or ``last``) taken out of ``args``: the arguments that build the
    run, and the checkpoint it resumes from (``None``: a new run)."""
    rest, ckpt_path = [], None
    i = 0
    while i < len(args):
        if args[i] == "--ckpt_path":
            if i + 1 == len(args):
                raise ValueError("--ckpt_path needs a value: a checkpoint file or last")
            ckpt_path, i = args[i + 1], i + 2
            continue
        if args[i].startswith("--ckpt_path="):
            ckpt_path = args[i].split("=", 1)[1]
        else:
            rest.append(args[i])
        i += 1
    return rest, ckpt_path


def resume_command(argv: list[str]) -> str:
    """The command line that resumes ``fedrcl <argv>``: the same arguments, ``--ckpt_path last``."""
    return shlex.join(["fedrcl", *split_ckpt_path(argv)[0], "--ckpt_path", "last"])


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``fedrcl`` console script (exit status 0 on success).

    ``--help`` and an unknown subcommand are answered here; ``OTHER_SUBCOMMANDS`` (``fedrcl report ...``) go
    to their module's ``main``; the rest to LightningCLI (``fedrcl.lightning_cli``). Classes named in a config
    (``--model my_method.MyMethod``) are also looked up in the current folder. An error of fedrcl's
    (``report_user_error``) ends in its message and exit status 1, without a traceback unless
    ``FEDRCL_DEBUG=1``; a run stopped by a signal (``Preempted``: SIGTERM, Ctrl-C) in one line saying how to
    resume it, with exit status 128 + the signal. A torch and torchvision that cannot work together
    (``fedrcl.torch_builds``) are one line naming both and the pip line that fixes them: an error before any
    subcommand runs, a warning beside ``--help``. Output to a closed pipe ends quietly, to a full device in one
    line and exit status 1 (``fedrcl.output``), ``--help`` included.
    """
    from fedrcl.output import ended_output, quiet_when_closed

    quiet_when_closed()  # ``fedrcl fit --help | head -1``: the method list is printed before LightningCLI runs
    try:
        _main(args)
    except SystemExit as stop:
        ended_output(stop.code)
        raise
    ended_output()


def _main(args: list[str] | None) -> None:
    argv = list(sys.argv[1:] if args is None else args)
    # A user's own method or server in the current folder (``--model my_method.MyMethod``), as ``python -m``
    # would find it; appended, so it never shadows an installed module.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    mismatch = pair_problem()  # torch and torchvision builds that cannot work together: say so first
    if not argv or argv[0] in ("-h", "--help") or argv[0][:1] != "-" \
            and argv[0] not in TRAINER_SUBCOMMANDS and argv[0] not in OTHER_SUBCOMMANDS:
        if mismatch:
            print(f"fedrcl: warning: {mismatch}", file=sys.stderr, flush=True)
        command_parser().parse_args(argv[:1])  # prints the help or the refusal, and exits
    if mismatch:
        print(f"fedrcl: error: {mismatch}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    try:
        run_subcommand(argv, args)
    except KeyboardInterrupt:  # Ctrl-C outside a fit's rounds (those stop as Preempted / Interrupted)
        print("fedrcl: stopped by SIGINT (Ctrl-C)", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGINT) from None
    except RuntimeError as error:  # torchvision of another build, found on import
        line = import_problem(error)
        if line is None or os.environ.get("FEDRCL_DEBUG") == "1":
            raise
        print(f"fedrcl: error: {line}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def run_subcommand(argv: list[str], args: list[str] | None) -> None:
    """``fedrcl <argv>`` for a known subcommand: ``OTHER_SUBCOMMANDS`` in their module, the rest in
    LightningCLI (``args``: as given to ``main``, ``None`` for the command line)."""
    if argv[0] in OTHER_SUBCOMMANDS:
        import_module(OTHER_SUBCOMMANDS[argv[0]][0]).main(argv[1:])
        return
    if "-h" in argv or "--help" in argv:  # what a run can pick comes first, before Lightning has loaded
        from fedrcl.methods import short_listing

        print(short_listing(), flush=True)
    from fedrcl.federated.preemption import Preempted
    from fedrcl.lightning_cli import FedRCLCLI, build_cli, remove_failed_start

    cli = FedRCLCLI.__new__(FedRCLCLI)  # held before it runs, so that a failed start can be cleaned up
    try:
        build_cli(args, cli)
    except Preempted as stop:
        if stop.rank == 0:
            print(stop.message(resume_command(argv)), file=sys.stderr, flush=True)
        raise SystemExit(stop.code) from None
    except Exception as error:
        remove_failed_start(cli)
        if not report_user_error(error, argv=argv):
            raise
        raise SystemExit(1) from None


def __getattr__(name: str) -> Any:
    """``fedrcl.cli.FedRCLCLI``, ``build_cli``, ...: the LightningCLI side, imported on first use."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module("fedrcl.lightning_cli"), name)


if __name__ == "__main__":
    main()
