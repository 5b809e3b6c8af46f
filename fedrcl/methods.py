"""``fedrcl methods``: the client methods and server optimizers a run can pick, each with its paper and options.

    fedrcl methods          # every method and server optimizer: paper, options with their defaults
    fedrcl fit --help       # starts with the short list (``short_listing``)

Read from the source of ``fedrcl.algorithms`` and ``fedrcl.server`` (the names their ``__all__`` exports, each
module's docstring, each class's ``Args:`` and ``__init__`` defaults) without importing them: no torch, no
Lightning, so the list comes at once. A class that leaves a method to subclasses (``ServerOptimizer``,
``FedOpt``) is not one to pick and is left out, as in ``fedrcl fit --help``. ``unknown_option`` is the error
for a ``--model.<key>`` the chosen method does not have (``--model.lambda``: FedRCL's lambda is ``threshold``).
"""
from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import re
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Optional

__all__ = ["Entry", "Option", "entries", "listing", "main", "short_listing", "unknown_option"]

PACKAGE = Path(__file__).resolve().parent
LINKED = ("num_classes", "in_channels", "image_size")  # set from data.dataset by the CLI, never typed
YAML_WORDS = {"None": "null", "True": "true", "False": "false"}


@dataclass(frozen=True)
class Option:
    """One constructor argument: its name, default as YAML writes it (``None``: required) and ``Args:`` text."""

    name: str
    default: Optional[str]
    text: str


@dataclass(frozen=True)
class Entry:
    """A class a run can pick: its name, class path, paper (or what it is) and its own options."""

    name: str
    class_path: str
    paper: str
    options: tuple[Option, ...]


def args_section(docstring: Optional[str]) -> dict[str, str]:
    """``{argument: text}`` of a Google-style ``Args:`` section, each text on one line."""
    found: dict[str, str] = {}
    lines = (docstring or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    if start is None:
        return found
    name, indent = None, None
    for line in lines[start + 1:]:
        if not line.strip():
            break
        depth = len(line) - len(line.lstrip())
        match = re.match(r"\s*(\w+):\s*(.*)", line)
        if match and (indent is None or depth == indent):
            indent, name = depth, match.group(1)
            found[name] = match.group(2).strip()
        elif name is not None and indent is not None and depth > indent:
            found[name] += " " + line.strip()
        else:
            break
    return found


def paper(module_doc: Optional[str]) -> str:
    """The paper a module's docstring cites in its first sentence's parentheses (``Seo et al., "Relaxed
    Contrastive Learning for Federated Learning", CVPR 2024``), else that sentence."""
    first = " ".join((module_doc or "").strip().split("\n\n", 1)[0].split())
    depth, start = 0, None
    for i, char in enumerate(first):
        if char == "(":
            depth, start = depth + 1, i if depth == 0 else start
        elif char == ")" and depth:
            depth -= 1
            if depth == 0 and start is not None:
                return first[start + 1:i]
    return first.split(". ", 1)[0].rstrip(".")


def _exports(package: str) -> dict[str, str]:
    """``{name: module file stem}`` of what ``fedrcl.<package>`` exports (``__all__``), read from its source."""
    tree = ast.parse((PACKAGE / package / "__init__.py").read_text(encoding="utf-8"))
    modules: dict[str, str] = {}
    exported: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(f"fedrcl.{package}."):
            modules.update({alias.asname or alias.name: node.module.rsplit(".", 1)[1] for alias in node.names})
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                  for t in node.targets):
            exported = list(ast.literal_eval(node.value))
    return {name: modules[name] for name in exported if name in modules}


def _leaves_to_subclasses(function: ast.FunctionDef) -> bool:
    body = [n for n in function.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.dump(body[0])


def entries(package: str) -> list[Entry]:
    """The classes of ``fedrcl.<package>`` (``algorithms`` or ``server``) a run can pick: FedAvg (the default)
    first, then in ``__all__``'s order."""
    classes: dict[str, tuple[ast.ClassDef, ast.Module]] = {}
    for path in sorted((PACKAGE / package).glob("*.py")):
        module = ast.parse(path.read_text(encoding="utf-8"))
        for node in module.body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(f"{path.stem}.{node.name}", (node, module))
                classes.setdefault(node.name, (node, module))

    def abstract(name: str) -> set[str]:
        """The methods ``name`` leaves to subclasses, its bases' included."""
        if name not in classes:
            return set()
        node, _ = classes[name]
        own = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
        inherited = set().union(*(abstract(ast.unparse(b).split(".")[-1]) for b in node.bases))
        left = {f.name for f in node.body if isinstance(f, ast.FunctionDef) and _leaves_to_subclasses(f)}
        return (inherited - own) | left

    def options(name: str) -> tuple[Option, ...]:
        """The arguments of the nearest ``__init__`` in ``name``'s own class or its bases in the package."""
        if name not in classes:
            return ()
        node, _ = classes[name]
        init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
        if init is None:
            return next((inherited for b in node.bases if (inherited := options(ast.unparse(b).split(".")[-1]))),
                        ())
        texts = args_section(ast.get_docstring(node))
        args = init.args.args[1:]
        defaults = [None] * (len(args) - len(init.args.defaults)) + list(init.args.defaults)
        own: list[Option] = []
        for arg, default in [*zip(args, defaults), *zip(init.args.kwonlyargs, init.args.kw_defaults)]:
            if arg.arg not in LINKED:
                shown = None if default is None else ast.unparse(default)
                own.append(Option(arg.arg, YAML_WORDS.get(shown, shown) if shown else None,
                                  texts.get(arg.arg, "").replace("``", "")))
        return tuple(own)

    found = []
    for name, stem in _exports(package).items():
        node, module = classes[f"{stem}.{name}"]
        if abstract(f"{stem}.{name}") or abstract(name):
            continue
        cited = paper(ast.get_docstring(module))
        if "(" not in " ".join((ast.get_docstring(module) or "").split("\n\n", 1)[0].split()):
            cited = paper(ast.get_docstring(node))  # a module that cites no paper: what the class is
        found.append(Entry(name, f"fedrcl.{package}.{name}", cited, options(f"{stem}.{name}")))
    return sorted(found, key=lambda entry: entry.name != "FedAvg")  # the default first


def _option_line(option: Option, width: int) -> str:
    shown = option.name if option.default is None else f"{option.name} {option.default}"
    return f"      {shown:<{width}}  {option.text}".rstrip()


def listing() -> str:
    """What ``fedrcl methods`` prints: every client method and server optimizer, its paper and own options."""
    parts = []
    for package, heading, key in (
            ("algorithms", "Client methods: --model fedrcl.algorithms.<Name>; options: --model.init_args.<option> "
                           "(each method also takes FedAvg's)", "model.init_args"),
            ("server", "Server optimizers: --trainer.server fedrcl.server.<Name> (default FedAvg); options: "
                       "--trainer.server.init_args.<option>", "trainer.server.init_args")):
        parts.append(heading)
        for entry in entries(package):
            parts.append(f"  {entry.name:<12}{entry.paper}")
            width = max((len(o.name) + len(o.default or "") + 1 for o in entry.options), default=0)
            parts += [_option_line(option, width) for option in entry.options]
        parts.append("")
    parts.append("Each method's update rule and config: docs/methods.md; a config's values: fedrcl fit --config X "
                 "--print_config")
    return "\n".join(parts)


def short_listing() -> str:
    """The head of ``fedrcl fit --help``: the methods and server optimizers, one line each with its paper."""
    lines = ["Client methods (--model fedrcl.algorithms.<Name>):"]
    lines += [f"  {e.name:<12}{e.paper}" for e in entries("algorithms")]
    lines.append("Server optimizers (--trainer.server fedrcl.server.<Name>; default FedAvg):")
    lines += [f"  {e.name:<12}{e.paper}" for e in entries("server")]
    lines.append("Their options and defaults: fedrcl methods. All options of a run follow.")
    return "\n".join(lines) + "\n"


def unknown_option(class_path: str, key: str) -> str:
    """The error for option ``key`` that class ``class_path`` does not take: the options it does take, and
    the closest one by name or by its ``Args:`` text (``lambda`` -> ``threshold``: "lambda: same-class ...")."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(import_module(module), name)
    except (ImportError, AttributeError):
        return f"{class_path} has no option {key}"
    options: dict[str, str] = {}
    for klass in cls.__mro__:  # a constructor that passes **kwargs on takes its bases' options too
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        texts = args_section(inspect.getdoc(klass))
        parameters = list(inspect.signature(init).parameters.values())[1:]
        for p in parameters:
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in LINKED:
                options.setdefault(p.name, texts.get(p.name, ""))
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break
    by_text = [n for n, text in options.items() if re.search(rf"\b{re.escape(key)}\b", text, re.I)]
    by_start = [n for n in options if n.startswith(key) or key.startswith(n)]
    close = by_text or by_start or difflib.get_close_matches(key, list(options), n=1, cutoff=0.6)
    text = options[close[0]].rstrip(".") if close else ""
    hint = f"; did you mean {close[0]}" + (f" ({text})" if text else "") + "?" if close else "."
    return f"{name} has no option {key}{hint} Its options: {', '.join(options)} (fedrcl methods lists them)"


def main(argv: Optional[list[str]] = None) -> None:
    """``fedrcl methods``."""
    argparse.ArgumentParser(prog="fedrcl methods", description="The client methods and server optimizers a run "
                            "can pick, with their paper and options.").parse_args(argv)
    print(listing())
