"""Whether the installed torch and torchvision are builds that work together, and the pip line that fixes them.

torchvision's compiled operators are built against one torch build. Where pip pairs a CPU torch (PyTorch's CPU
index, ``2.14.1+cpu``) with PyPI's Linux torchvision (a CUDA build, no ``+`` tag), or a torchvision of another
torch release, importing torchvision fails deep in torchmetrics' import with ``operator torchvision::nms does
not exist``. ``pair_problem`` reads the two versions from the installed packages' metadata (no import: it is
cheap enough for ``fedrcl --help``); ``import_problem`` turns that failure, when it happens anyway, into the same
one line. Nothing here imports torch.
"""
from __future__ import annotations

import re
import sys
from importlib import metadata
from typing import Optional

# torch 2.M pairs with torchvision 0.(M + 15) (torch 2.0 / torchvision 0.15 to torch 2.14 / torchvision 0.29).
TORCHVISION_MINOR_OFFSET = 15
PYTORCH_INDEX = "https://download.pytorch.org/whl"


def installed_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _release_and_build(version: str) -> tuple[tuple[int, ...], str]:
    """``2.14.1+cpu`` -> ``((2, 14, 1), "cpu")``, ``2.15.0a0`` -> ``((2, 15, 0), "")``: a build without a ``+``
    tag has ``""``."""
    release, _, build = version.partition("+")
    numbers = [int(n) for n in re.findall(r"\d+", re.split(r"[a-z]", release)[0])[:3]]
    return (*numbers, *[0] * (3 - len(numbers))), build


def _cuda_major(build: str) -> Optional[int]:
    """``cu128`` -> 12, ``cu118`` -> 11; ``None`` for a build that is not CUDA's."""
    match = re.fullmatch(r"cu(\d+)\d", build)
    return int(match.group(1)) if match else None


def paired_torchvision(torch_version: str) -> Optional[str]:
    """The torchvision release series of ``torch_version``: ``2.14.1`` -> ``0.29``; ``None`` before torch 2."""
    (major, minor, *_), _ = _release_and_build(torch_version)
    return f"0.{minor + TORCHVISION_MINOR_OFFSET}" if major == 2 else None


def fix_command(torch_version: str) -> str:
    """The pip line that installs the torchvision of ``torch_version``'s release and build, from the index that
    torch came from (``+cpu``: PyTorch's CPU index; no tag: PyPI)."""
    series = paired_torchvision(torch_version)
    _, build = _release_and_build(torch_version)
    wanted = f'"torchvision=={series}.*"' if series else "torchvision"
    index = f" --index-url {PYTORCH_INDEX}/{build}" if build else ""
    return f"pip install --force-reinstall --no-deps {wanted}{index}"


def mismatch(torch_version: str, torchvision_version: str, platform: str = sys.platform) -> Optional[str]:
    """Why these two versions cannot work together, or ``None``: another torch release, or a CPU torch beside
    a CUDA torchvision (PyPI's Linux torchvision has no tag and is one), or two CUDA major versions."""
    (major, minor, *_), torch_build = _release_and_build(torch_version)
    (vision_major, vision_minor, *_), vision_build = _release_and_build(torchvision_version)
    if major == 2 and (vision_major, vision_minor) != (0, minor + TORCHVISION_MINOR_OFFSET):
        return f"torchvision {vision_major}.{vision_minor} belongs to another torch release"
    if torch_build == "cpu" and vision_build != "cpu" and (vision_build or platform == "linux"):
        return "a CPU torch beside a CUDA torchvision"
    cuda, vision_cuda = _cuda_major(torch_build), _cuda_major(vision_build)
    if cuda is not None and vision_cuda is not None and cuda != vision_cuda:
        return f"CUDA {cuda} beside CUDA {vision_cuda}"
    return None


def problem_line(reason: str) -> str:
    """One line: both versions, why they do not work together, the install line that fixes it."""
    torch_version = installed_version("torch") or "?"
    vision_version = installed_version("torchvision") or "?"
    fix = fix_command(torch_version) if torch_version != "?" else "pip install torch torchvision"
    return (f"torch {torch_version} and torchvision {vision_version} are builds that do not work together "
            f"({reason}); install the torchvision of this torch: {fix}")


def pair_problem() -> Optional[str]:
    """``problem_line`` when the installed torch and torchvision do not pair (``mismatch``), else ``None``;
    read from the packages' metadata, without importing either."""
    torch_version, vision_version = installed_version("torch"), installed_version("torchvision")
    if torch_version is None or vision_version is None:
        return None
    reason = mismatch(torch_version, vision_version)
    return problem_line(reason) if reason else None


def import_problem(error: BaseException) -> Optional[str]:
    """``problem_line`` for the error that importing a torchvision of another build raises (its compiled
    operators missing, or torchvision's own CUDA check), else ``None``."""
    message = str(error)
    if isinstance(error, RuntimeError) and ("operator torchvision::" in message
                                            or "PyTorch and torchvision were compiled" in message):
        return problem_line(message.strip().splitlines()[0] if message.strip() else "torchvision failed to load")
    return None
