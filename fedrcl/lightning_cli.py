"""LightningCLI for fedrcl: the parser, help and run of ``fedrcl fit`` / ``validate`` / ``test``.

``fedrcl.cli`` (the command) imports this module only for those subcommands, so that ``fedrcl --help``,
``fedrcl report`` and ``fedrcl seeds --help`` start without Lightning. Keys are never abbreviated
(``--trainer.round`` is an error, not ``--trainer.rounds``). ``validate`` and ``test`` log to
``<save_dir>/<name>/<subcommand>_k``, beside the fit run's ``version_k`` folders, so they never join its
training curves (``fedrcl.analysis.load_scalars``, the notebooks, ``fedrcl report``). ``torch_threads`` sets
torch's CPU thread count (``configs/quickstart.yaml``: 1).
"""
from __future__ import annotations

import argparse
import ast
import inspect
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Iterator
from functools import lru_cache
from importlib import import_module
from pathlib import Path
from typing import Any, NoReturn, Optional

import lightning
import torch
import yaml
from jsonargparse import ActionConfigFile, ActionSubCommands, ArgumentParser, DefaultHelpFormatter, Namespace, \
    get_loader, set_loader
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from fedrcl.algorithms import FedAvg
from fedrcl.commands import DESCRIPTION, OTHER_SUBCOMMANDS
from fedrcl.data.datamodule import FederatedDataModule
from fedrcl.data.datasets import dataset_info
from fedrcl.data.huggingface import Columns
from fedrcl.data.sources import OWN_DATASETS, own_data_shape
from fedrcl.errors import typed_pairs
from fedrcl.federated.checkpoint import check_usable, local_checkpoint
from fedrcl.federated.run_folder import held_by_another, hold_run_folders, release_run_folders
from fedrcl.federated.trainer import OWNED_BY_ROUNDS, FederatedTrainer
from fedrcl.methods import unknown_option
from fedrcl.output import quiet_when_closed

EVALUATIONS = ("validate", "test")
# Keys LightningCLI adds that fedrcl always refuses unless null / false (``before_instantiate_classes``,
# ``FederatedTrainer``): parsed, so that saved configs (``optimizer: null``, ``barebones: false``) still load,
# and left out of ``--help``, which offers only what can work.
HIDDEN_KEYS = ("optimizer", "optimizer.help", "lr_scheduler", "lr_scheduler.help", "trainer.barebones")
SEED_KEYS = ("seed_everything", "trainer.seed", "data.seed")
KNOWN_SUBCLASSES = ", known subclasses: "  # how jsonargparse's --help ends a class argument's choices


def _data_shape(dataset: str, root: str, image_size: Optional[int], image_column: str,
                label_column: str) -> tuple[int, int, int]:
    """(classes, channels, side) of a named data set, or read from your own data at ``root``."""
    if dataset in OWN_DATASETS:
        return own_data_shape(dataset, root, image_size, Columns(image_column, label_column))
    info = dataset_info(dataset)
    return info.num_classes, info.in_channels, info.image_size


def _num_classes(*data: Any) -> int:
    return _data_shape(*data)[0]


def _in_channels(*data: Any) -> int:
    return _data_shape(*data)[1]


def _image_size(*data: Any) -> int:
    return _data_shape(*data)[2]


def _left_to_subclasses(method: Any) -> bool:
    """Whether ``method`` only raises ``NotImplementedError`` (after its docstring)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    except (OSError, TypeError, SyntaxError):
        return False
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else []
    body = [node for node in body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.dump(body[0])


@lru_cache(maxsize=None)
def selectable(class_path: str) -> bool:
    """Whether ``--help`` lists ``class_path`` as a choice: a fedrcl client method, server optimizer or backbone
    only if its package exports it (``__all__``) and it implements every method fedrcl declares (not
    ``GlobalTeacherClient``, ``FedOpt``, ``ServerOptimizer``). Only fedrcl's own methods are read: parsing the
    source of every Lightning method took most of ``fedrcl fit --help``'s time after the imports."""
    parts = class_path.split(".")
    if parts[0] != "fedrcl" or len(parts) < 3 or parts[1] not in ("algorithms", "server", "models"):
        return True
    package = import_module(".".join(parts[:2]))
    cls = getattr(package, parts[-1], None)
    if parts[-1] not in getattr(package, "__all__", ()) or not isinstance(cls, type):
        return False
    methods = (getattr(cls, name) for name in dir(cls) if not name.startswith("__"))
    return not any(inspect.isfunction(m) and m.__module__.startswith("fedrcl.") and _left_to_subclasses(m)
                   for m in methods)


class FedRCLHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's ``--help`` whose "known subclasses" lists keep the ``selectable`` ones (and, for a
    backbone, fedrcl's models rather than every ``torch.nn.Module`` imported so far)."""

    def _get_help_string(self, action: Any) -> str:
        text = super()._get_help_string(action)
        head, found, listed = text.partition(KNOWN_SUBCLASSES)
        if not found or not listed.endswith(")"):
            return text
        paths = listed[:-1].split(", ")
        modules = "torch.nn.Module" in paths
        paths = [p for p in paths if selectable(p) and (p.startswith("fedrcl.models.") or not modules)]
        return head + (KNOWN_SUBCLASSES + ", ".join(paths) if paths else "") + ")"


MAX_CONFIG_BYTES = 1 << 20  # a config is a few KB
MAX_YAML_VALUES = 100_000  # values a YAML text may expand to, aliases counted each time (a config: a few hundred)


class YAMLTooLarge(yaml.YAMLError):
    """A YAML text whose aliases expand to more than ``MAX_YAML_VALUES`` values (an alias bomb), or that
    refers to itself."""


def yaml_values(node: yaml.Node, limit: int = MAX_YAML_VALUES) -> int:
    """How many values the composed YAML ``node`` expands to, each alias counted as a copy of what it names
    (which ``yaml.compose`` shares, so composing an alias bomb is cheap and loading it is not); raises
    ``YAMLTooLarge`` above ``limit`` or for an alias inside what it names."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(current: yaml.Node) -> int:
        key = id(current)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise YAMLTooLarge("an alias refers to the value that holds it")
        open_.add(key)
        children: list[yaml.Node] = []
        if isinstance(current, yaml.SequenceNode):
            children = list(current.value)
        elif isinstance(current, yaml.MappingNode):
            children = [n for pair in current.value for n in pair]
        total = 1
        for child in children:
            total += size(child)
            if total > limit:
                raise YAMLTooLarge(f"its aliases expand to more than {limit} values (a config has a few hundred)")
        open_.discard(key)
        sizes[key] = total
        return total

    return size(node)


def check_yaml_size(text: str) -> None:
    """Refuse (``YAMLTooLarge``) a YAML text above ``MAX_CONFIG_BYTES`` or expanding past ``MAX_YAML_VALUES``
    values, before anything loads it."""
    if len(text) > MAX_CONFIG_BYTES:
        raise YAMLTooLarge(f"{len(text)} characters, more than a config needs ({MAX_CONFIG_BYTES})")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise YAMLTooLarge("nested too deep") from None
    if node is not None:
        try:
            yaml_values(node)
        except RecursionError:
            raise YAMLTooLarge("nested too deep") from None


def check_typed_yaml(args: list[str]) -> None:
    """Raise ``ValueError`` naming the key (and the file) if a value typed on the command line, or a YAML file
    it names (``--model.init_args.backbone backbone.yaml``), is YAML too large or whose aliases expand too far
    (``check_yaml_size``): jsonargparse loads both with PyYAML, unbounded."""
    for key, value in typed_pairs(args):
        if key == "config":
            continue  # ``ConfigFile`` checks it, naming it as a config file
        path = Path(value)
        named = path.suffix in (".yaml", ".yml") and os.path.isfile(value)
        if not named and not ("&" in value and "*" in value):
            continue
        try:
            check_yaml_size(path.read_text(encoding="utf-8", errors="replace") if named else value)
        except YAMLTooLarge as e:
            raise ValueError(f"--{key} {value}: refused, {e}" if named else f"--{key}: refused, {e}") from None
        except yaml.YAMLError:
            continue  # not YAML: jsonargparse's own error names it


def bounded_yaml_load(text: str) -> Any:
    """jsonargparse's YAML loader, refusing (``YAMLTooLarge``) a text that ``check_yaml_size`` refuses first: every
    value and file jsonargparse loads goes through it, a file that a config names for ``model:`` or
    ``trainer.callbacks:`` included (which it reads whole)."""
    check_yaml_size(text)
    return bounded_yaml_load.__wrapped__(text)  # type: ignore[attr-defined]


_loader = get_loader("yaml")
bounded_yaml_load.__wrapped__ = getattr(_loader, "__wrapped__", _loader)  # type: ignore[attr-defined]
set_loader("yaml", bounded_yaml_load, (yaml.YAMLError,))


class ConfigFile(ActionConfigFile):
    """``--config``: a YAML syntax error names the file, line and column (jsonargparse names neither); a file
    too large, or whose aliases expand too far (``check_yaml_size``), is refused naming it, before it is read."""

    def __call__(self, parser, cfg, values, option_string=None):
        path = Path(str(values))
        if path.is_file():
            if path.stat().st_size > MAX_CONFIG_BYTES:
                raise TypeError(f"{path}: {path.stat().st_size} bytes, more than a configuration file needs "
                                f"({MAX_CONFIG_BYTES}); not read")
            if not path.read_text(encoding="utf-8", errors="replace").strip():
                raise TypeError(f"{path}: the configuration file is empty (give it at least one key, or leave "
                                "out this --config)")
            try:
                check_yaml_size(path.read_text(encoding="utf-8"))
            except YAMLTooLarge as e:
                raise TypeError(f"{path}: refused, {e}") from None
            except yaml.MarkedYAMLError as e:
                mark = e.problem_mark or e.context_mark
                where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
                raise TypeError(f"{path}: not valid YAML ({where}{e.problem or e.context})") from None
            except (UnicodeDecodeError, yaml.YAMLError) as e:
                raise TypeError(f"{path}: not valid YAML ({e})") from None
            for key, named in included_files(yaml.safe_load(path.read_text(encoding="utf-8")), path.parent):
                if named.stat().st_size > MAX_CONFIG_BYTES:
                    raise TypeError(f"{path}: {key}: {named}, {named.stat().st_size} bytes, more than a "
                                    f"configuration file needs ({MAX_CONFIG_BYTES}); not read")
        super().__call__(parser, cfg, values, option_string)


def included_files(value: Any, folder: Path, key: str = "") -> Iterator[tuple[str, Path]]:
    """``(key, file)`` for each YAML file a loaded config names as a value (``model: model.yaml``), which
    jsonargparse reads as that key's config (relative to the config's ``folder``)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from included_files(v, folder, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from included_files(v, folder, f"{key}[{i}]")
    elif isinstance(value, str) and value.endswith((".yaml", ".yml")) and (folder / value).is_file():
        yield key, folder / value


class FedRCLParser(LightningArgumentParser):
    """Lightning's parser whose subcommand list also shows ``OTHER_SUBCOMMANDS`` (run by ``main``), without the
    Trainer arguments the round loop sets itself (``OWNED_BY_ROUNDS``), whose help lists the classes a run
    accepts (``FedRCLHelpFormatter``; also in jsonargparse's ``--<key>.help`` parsers, made of this class), and
    whose errors are a few lines."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", FedRCLHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_lightning_class_args(self, lightning_class: Any, nested_key: str, subclass_mode: bool = False,
                                 required: bool = True) -> list[str]:
        if isinstance(lightning_class, type) and issubclass(lightning_class, FederatedTrainer):
            return self.add_class_arguments(lightning_class, nested_key, fail_untyped=False, instantiate=False,
                                            sub_configs=True, skip=set(OWNED_BY_ROUNDS))
        return super().add_lightning_class_args(lightning_class, nested_key, subclass_mode, required)

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        """``fedrcl fit: error: <message>`` and where the options are listed; exit status 2 (argparse's).
        ``FEDRCL_DEBUG=1``: jsonargparse's own report."""
        if os.environ.get("FEDRCL_DEBUG") == "1" or not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        print(f"{prog}: error: {parse_error_text(message)}\n(all options: {prog} --help)", file=sys.stderr)
        raise SystemExit(2)

    def add_subcommands(self, *args: Any, **kwargs: Any) -> ActionSubCommands:
        self.subcommands_action = super().add_subcommands(*args, **kwargs)
        return self.subcommands_action


class RunConfigCallback(SaveConfigCallback):
    """Lightning's ``config.yaml`` beside a run, written only where a logger made the run's folder. With
    ``--trainer.logger false`` there is none (``split.json`` is not written either) and Lightning would write
    into the working folder, over a ``config.yaml`` of the user's own."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.loggers:
            hold_run_folders(trainer)  # the first write of a run built without LightningCLI's run (seeds, Flower)
            super().setup(trainer, pl_module, stage)


class FedRCLCLI(LightningCLI):
    """LightningCLI with the dataset's shape linked into the model, so it is never typed twice.

    Differences from LightningCLI: no abbreviated keys; no ``predict`` (a federated run has nothing to
    predict); ``validate`` / ``test`` report the checkpoint's own accuracy EMA and log apart from the fit
    runs; ``torch_threads``.
    """

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        kwargs.setdefault("dump_header", [f"lightning.pytorch=={lightning.__version__}"])
        parser = self.parser_class(allow_abbrev=False, **kwargs)
        parser.add_argument("-c", "--config", action=ConfigFile,
                            help="Path to a configuration file in yaml format (several: later ones win).")
        return parser

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any],
                     subparser_kwargs: dict[str, Any]) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        for run_parser in self._subcommand_parsers.values() if add_subcommands else [self.parser]:
            for action in run_parser._actions:
                if action.dest in HIDDEN_KEYS:
                    action.help = argparse.SUPPRESS
        if add_subcommands:  # listed in --help; main() runs them before LightningCLI is built
            parser = self.parser
            assert isinstance(parser, FedRCLParser)  # fedrcl's parser_class, which keeps subcommands_action
            for name, (_, text) in OTHER_SUBCOMMANDS.items():
                parser.subcommands_action.add_subcommand(name, ArgumentParser(description=text), help=text)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """LightningCLI's, with ``RunConfigCallback`` unless told otherwise (also for ``fedrcl.flower.config.build``):
        it holds the run folder before it writes ``config.yaml``."""
        kwargs.setdefault("save_config_callback", RunConfigCallback)
        super().__init__(*args, **kwargs)

    def before_fit(self) -> None:
        """The run folder is this run's alone (``hold_run_folders``), before the data's setup writes ``split.json``."""
        hold_run_folders(self.trainer)

    before_validate = before_test = before_fit

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--torch_threads", type=Optional[int], default=None,
                            help="CPU threads of torch (torch.set_num_threads); null: torch's default "
                                 "(OMP_NUM_THREADS, else one per core). 1 is fastest for small models on "
                                 "shared cores.")
        # your own data's shape is read from it
        data = ("data.dataset", "data.root", "data.image_size", "data.image_column", "data.label_column")
        parser.link_arguments(data, "model.init_args.num_classes", compute_fn=_num_classes)
        parser.link_arguments(data, "model.init_args.in_channels", compute_fn=_in_channels)
        parser.link_arguments(data, "model.init_args.image_size", compute_fn=_image_size)

    def parse_arguments(self, parser, args) -> None:
        if args is None or isinstance(args, list):
            check_typed_yaml(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        for key in SEED_KEYS:
            seed = config.get(key)
            if type(seed) is int and not 0 <= seed < 2**32:  # before LightningCLI seeds (numpy's error)
                raise ValueError(f"{key}: a seed must be 0 <= seed < 2**32 (numpy's and torch's generators take no "
                                 f"other), got {seed}")
        # LightningCLI reads ckpt_path next (for hyperparameters): refuse a URL, name an empty, truncated or
        # non-finite file first; a file:// or fsspec-cached local file is read as that file.
        if config.get("weights_only") is False:
            print("fedrcl: --weights_only false is ignored: checkpoints are always read with weights_only=True "
                  "(a pickle can run code when it is loaded)", file=sys.stderr, flush=True)
            config.weights_only = True  # also for a CheckpointIO plugin of the user's own
        if "ckpt_path" in config:
            config.ckpt_path = local_checkpoint(config.ckpt_path)
            check_usable(config.ckpt_path)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        for key in ("optimizer", "lr_scheduler"):  # LightningCLI's; kept so that saved configs still parse
            if config.get(key) is not None:
                raise ValueError(
                    f"{key}: fedrcl builds each client's optimizer itself (SGD from --model.init_args.lr, "
                    f"momentum, weight_decay; the lr per round from lr_decay and local_lr_decay) and the "
                    f"server's from --trainer.server; LightningCLI's --optimizer / --lr_scheduler would replace "
                    f"the client optimizer for the whole run, so they must stay null (got {config[key]})")
        if config.get("torch_threads") is not None:
            if config.torch_threads < 1:
                raise ValueError(f"torch_threads must be >= 1 or null, got {config.torch_threads}")
            torch.set_num_threads(config.torch_threads)
        if self.subcommand in EVALUATIONS:
            _log_apart(config.trainer, self.subcommand)

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        # Which run folders exist before this start writes anything (``remove_failed_start``).
        folders = [Path(log_dir) for logger in self.trainer.loggers
                   if (log_dir := getattr(logger, "log_dir", None))]
        self._run_folders = [(p, p.exists()) for p in folders]
        self._run_parents = [(p.parent, p.parent.exists()) for p in folders]


def _log_apart(trainer: Namespace, subcommand: str) -> None:
    """Point the run's file loggers at ``<save_dir>/<name>/<subcommand>_k`` (``runs/quickstart/validate_0``):
    beside the fit run's ``version_k`` folders, never one of them, so ``--ckpt_path last`` still finds the
    run's checkpoints while its curves, run list and report stay as the fit wrote them."""
    if trainer.logger in (None, True):  # FederatedTrainer's default logger, made explicit
        trainer.logger = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                                   init_args=Namespace(save_dir=trainer.get("default_root_dir") or "runs",
                                                       name="fedrcl", version=None))
    for logger in trainer.logger if isinstance(trainer.logger, list) else [trainer.logger]:
        args = logger.get("init_args") if isinstance(logger, Namespace) else None
        if args is None or not {"save_dir", "name", "version"} <= set(vars(args)) or args.version is not None:
            continue
        run_dir = Path(args.save_dir or ".") / (args.name or "")
        taken = [p.name.removeprefix(f"{subcommand}_") for p in run_dir.glob(f"{subcommand}_*")]
        args.version = f"{subcommand}_{max((int(k) + 1 for k in taken if k.isdigit()), default=0)}"


def parse_error_text(message: str) -> str:
    """jsonargparse's message, shortened to what was wrong: an unknown key says so, and a key the round loop
    sets says which key to use instead; a class that cannot be imported is named with the reason."""
    for key, (_, instead) in OWNED_BY_ROUNDS.items():
        if f"trainer.{key}" in message and ("unrecognized" in message or "does not accept" in message):
            return f"trainer.{key} is set by fedrcl's round loop: {instead}"
    link = re.match(r"Call to compute_fn of link '\w+\(([\w.]+)[\w., ]*\) --> [\w.]+' with args \('?([^',)]*)'?.*?\) "
                    r"failed: (.*)", message.strip(), re.S)
    if link:  # a linked value (data.dataset -> the model's class count) could not be derived
        return f"{link.group(1)} {link.group(2)}: {link.group(3).strip()}"
    included = re.search(r"Invalid content in sub-config file (\S+): (.+)", message)
    if included:  # a file a config names for a key (``model: model.yaml``): too large, or not YAML
        parser_key = re.match(r'\s*Parser key "([\w.]+)"', message)
        named = f"{parser_key.group(1)}: " if parser_key else ""
        return f"{named}{included.group(1)}: {included.group(2).strip()}"
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if lines and lines[0].startswith("Parser key") and any("class_path" in line for line in lines):
        key = lines[0].removeprefix("Parser key").strip(' ":')
        given = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Given value:")), "?")
        cause = next((lines[i + 1] for i, line in enumerate(lines[:-1])
                      if line.startswith("- Problem with given class_path")), "")
        unknown = re.fullmatch(r"Option '(\w+)' is not accepted", cause)
        nested = re.fullmatch(r"NestedArg\(key='([\w.]+)', val='(.*)'\)", given)
        class_path = re.search(r"Problem with given class_path '([\w.]+)'", message)
        if unknown and class_path:  # --model.lambda: an option the chosen class does not take
            typed = f"--{key}.{nested.group(1)} {nested.group(2)}" if nested else f"--{key} {given}"
            return f"{typed}: {unknown_option(class_path.group(1), unknown.group(1))}"
        return f"--{key} {given}: not a class fedrcl can import ({cause})"
    return "\n".join(lines[:6])


def remove_failed_start(cli: Optional[FedRCLCLI]) -> None:
    """After a failure before anything was logged: delete the run folder this start made (its
    ``config.yaml``, ``split.json``, an empty event file) and a run-name folder it left empty; never a folder
    that existed before, nor one holding a checkpoint."""
    trainer = getattr(cli, "trainer", None)
    if trainer is None or trainer.logged_metrics or not trainer.is_global_zero:
        return
    for folder, existed in getattr(cli, "_run_folders", []):
        if held_by_another(folder):  # started at the same moment as this one, and writing it
            continue
        if not existed and folder.is_dir() and not any(folder.rglob("*.ckpt")):
            shutil.rmtree(folder, ignore_errors=True)
        if not existed and folder.parent.is_dir() and not any(folder.parent.iterdir()) \
                and (folder.parent, False) in getattr(cli, "_run_parents", []):
            folder.parent.rmdir()


def build_cli(args: list[str] | None = None, cli: Optional[FedRCLCLI] = None, run: bool = True) -> FedRCLCLI:
    """Parse ``args`` (default: the command line), then run the subcommand; returns the CLI object (``cli``,
    made by ``FedRCLCLI.__new__``, if given). ``run=False``: ``args`` without a subcommand, the model, data
    and trainer built and not run."""
    quiet_when_closed()  # ``fedrcl fit ... | head``: a closed pipe silences the output, never the run
    cli = cli if cli is not None else FedRCLCLI.__new__(FedRCLCLI)
    try:
        type(cli).__init__(cli, FedAvg, FederatedDataModule, trainer_class=FederatedTrainer,
                           subclass_mode_model=True, parser_class=FedRCLParser, seed_everything_default=0,
                           parser_kwargs={"prog": "fedrcl", "description": DESCRIPTION},
                           save_config_callback=RunConfigCallback, save_config_kwargs={"overwrite": True},
                           args=args, run=run)
    finally:
        if run and getattr(cli, "trainer", None) is not None:  # the run has ended: its folders are free
            release_run_folders(cli.trainer)
    return cli
