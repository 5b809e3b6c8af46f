"""Batched clients: a round's clients (of this process) trained at once, on a leading client axis.

``trainer.client_batching`` (``ClientBatching``) decides which rounds of ``fedrcl fit`` train batched; the stacked
engine (``fedrcl.federated.stacked``, the one seeds together use, with one federation) trains them: all clients of
a round start from the same broadcast weights, stacked K times into one set of weights ``[K, ...]``, and
``torch.func.vmap`` over ``torch.func.functional_call`` runs the algorithm's own one-client loss
(``FedAvg.local_loss``, or its ``client_direction``, written once, for one client) for every client on its own
batch with its own slice of the weights (``LocalLoss``); per-client clip and SGD (``fedrcl.federated.client_step``).
One Lightning step is one local step of every client; batches come stacked from
``FederatedDataModule.stacked_client_batches`` (each client's from its own (seed, round, client) stream). Clients
that differ in step count or batch sizes train under a step mask (``fedrcl.contract.step_mask``), each at its own
local epoch's lr.

Shared by all clients, unbatched: the round's frozen global teacher, the broadcast weights (FedProx, FedACG's
client term), the round's index and seed. Per client, mapped: inside ``client_loss`` each client's slice sees
its own ``self.client`` (``client_id``, ``num_samples`` and ``num_steps`` as 0-dim integer tensors, usable in
tensor arithmetic; ``client.tensors``, what its ``on_client_start`` put there, e.g. FedLC's label counts, as its
slice of the clients' stacked ones). A round falls back to the sequential loop, with a one-line notice, when
the algorithm keeps per-client models (``unbatchable_reason``, MOON), when the backbone has buffers (BatchNorm
statistics) or when the method overrides Lightning's step (``OWN_STEP``: the stacked step is the method's loss or
``client_direction`` with SGD, and calls no Lightning hook of its own). The helpers here refuse, at the first
stacked round, what would silently differ from clients trained one after another (``fedrcl.federated.stacked``).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal, Optional, get_args

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

if TYPE_CHECKING:
    import fedrcl.algorithms.fedavg

Mode = Literal["auto", "on", "off"]
# torch.compile backend of the batched step; tests set a cheap one ("aot_eager") to run it on the CPU.
COMPILE_BACKEND = "inductor"
# The client facts each mapped slice sees as its own (``ClientContext`` fields).
CLIENT_FACTS = ("client_id", "num_samples", "num_steps")
# Attributes of the algorithm that are per client by design: its client (mapped), the weights (stacked).
PER_CLIENT = {"client", "_params", "stack", "backbone"}
# What a method may not override to train stacked: the stacked step is its ``local_loss`` (or ``client_direction``),
# per-client clipping and SGD, and calls none of these per step.
OWN_STEP = ("configure_optimizers", "configure_gradient_clipping", "training_step", "on_train_batch_start",
            "on_train_batch_end", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
            "on_before_zero_grad", "optimizer_step", "optimizer_zero_grad", "backward")
REMEDY = ("put it in client.tensors (a tensor or a dict of tensors, stacked per client), set unbatchable_reason, "
          "or trainer.client_batching off")


class _UnmappedData:
    """``client.data`` inside a batched ``client_loss``: one call serves every client, so there is no one
    client's data to give; reading it says where to read it instead."""

    def __getattr__(self, name: str) -> Any:
        raise ValueError(f"client_loss reads client.data.{name}, which batched clients cannot map: read the "
                         "client's data in on_client_start into client.tensors (FedLC's label counts), or set "
                         "unbatchable_reason")


UNMAPPED_DATA: Any = _UnmappedData()


class LocalLoss(nn.Module):
    """``algorithm.local_loss`` as a module call, so that ``functional_call`` can swap the weights it sees."""

    def __init__(self, algorithm: fedrcl.algorithms.fedavg.FedAvg):
        super().__init__()
        self.algorithm = algorithm

    def forward(self, tensors: dict[str, Any], weights: dict[str, Tensor], facts: dict[str, Tensor], x: Tensor,
                y: Tensor, global_state: Optional[dict[str, Tensor]] = None, direction: bool = False) -> Any:
        """The slice's ``(loss, parts)``, or with ``direction`` its ``client_direction`` ``(direction, loss, parts,
        replaced)``: ``tensors`` is the slice's own ``client.tensors``, and ``replaced`` the entries its step
        replaced (FedSMOO's duals). ``weights``: the slice's values of the method's ``SWEEPABLE`` loss weights, set
        on the algorithm for the call. ``global_state``: the slice's own broadcast weights where they differ
        between slices (seeds together, ``fedrcl.federated.client_step``); ``None``: the client's."""
        algorithm = self.algorithm
        assert algorithm.client is not None, "the clients were started (StackedClients)"
        # This client's context (its facts, 0-dim tensors where one client has ints, read in tensor arithmetic; its
        # tensors), its loss weights and its slice of the weights for the server's client term, set for the call
        # and put back before returning: no vmapped tensor outlives it (torch.compile needs that too).
        given = dict(tensors)  # as handed in; the context's copy (dicts copied too) is what the hooks may change
        own: dict[str, Any] = {**facts, "tensors": {k: dict(v) if isinstance(v, dict) else v for k, v in given.items()}}
        if global_state is not None:
            own["global_state"] = global_state
        context = dataclasses.replace(algorithm.client, data=UNMAPPED_DATA, **own)
        bound = {**weights, "_params": dict(algorithm.backbone.named_parameters()), "client": context}
        saved = {name: getattr(algorithm, name) for name in bound}
        for name, value in bound.items():
            setattr(algorithm, name, value)
        try:
            if direction:
                out = algorithm.client_direction(dict(algorithm.backbone.named_parameters()), x, y)
                return (*out, replaced_tensors(type(algorithm).__name__, "client_direction", given, context.tensors))
            loss = algorithm.local_loss(x, y)
            changed = replaced_tensors(type(algorithm).__name__, "client_loss", given, context.tensors)
            if changed:
                raise ValueError(
                    f"model {type(algorithm).__name__}: client_loss replaces "
                    f"{', '.join(f'client.tensors[{k!r}]' for k in changed)}; a loss keeps no state (batched clients "
                    "would drop it): replace it in client_direction (the step), or set unbatchable_reason")
            return loss
        finally:
            for name, value in saved.items():
                setattr(algorithm, name, value)


class ClientBatching:
    """The ``trainer.client_batching`` option: when to train a round's clients batched.

    Args:
        mode: ``on``: batched whenever the round allows it; ``off``: clients one after another; ``auto``:
            batched on CUDA, sequential elsewhere (on the CPU it is slower: ``bench/batched_step.py``).
        compile: compile the stacked step with ``torch.compile`` (``mode="reduce-overhead"``, CUDA graphs,
            on CUDA).
    """

    def __init__(self, mode: Mode = "auto", compile: bool = False):
        if mode not in get_args(Mode):
            raise ValueError(f"trainer.client_batching must be one of {', '.join(get_args(Mode))}, "
                             f"got {mode!r}")
        self.mode, self.compile = mode, compile
        self._noticed: set[str] = set()
        self.checked = False  # the run's first stacked round refused what would differ (``fedrcl.federated.stacked``)
        self.steps: dict[tuple[int, int, int], Any] = {}  # the run's stacked steps by shape (``stacked.stacked_step``)

    @property
    def compile_seconds(self) -> Optional[float]:
        """How long the first compiled stacked step took (``None``: none compiled yet)."""
        return next((s.compile_seconds for s in self.steps.values() if s.compile_seconds is not None), None)

    def applies(self, pl_module: Any, device: torch.device, precision: str) -> bool:
        """Whether this run's rounds train batched in ``precision`` (a fallback is announced once per reason)."""
        if self.mode == "off" or (self.mode == "auto" and device.type != "cuda"):
            return False
        reason = unbatchable(pl_module, precision)
        if reason is None:
            return True
        if reason not in self._noticed:
            self._noticed.add(reason)
            rank_zero_info(f"trainer.client_batching: clients trained one after another: {reason}")
        return False


def unbatchable(pl_module: Any, precision: str) -> Optional[str]:
    """Why the method's clients can never train on a stacked axis in the run's ``precision`` (its
    ``unbatchable_reason``, buffers in its backbone: BatchNorm statistics are not per client, a step of its own:
    ``OWN_STEP``, or ``16-mixed``: ``UNSCALED``), or ``None``."""
    from fedrcl.algorithms.fedavg import FedAvg

    reason: Optional[str] = getattr(pl_module, "unbatchable_reason", None)
    if reason is None and precision == "16-mixed":
        reason = UNSCALED
    if reason is None and any(True for _ in pl_module.backbone.buffers()):
        reason = "the backbone has buffers (e.g. BatchNorm statistics)"
    overridden = [name for name in OWN_STEP if getattr(type(pl_module), name) is not getattr(FedAvg, name)]
    if reason is None and overridden:
        reason = (f"model {type(pl_module).__name__} overrides {', '.join(overridden)}: the stacked step is the "
                  "method's local_loss (or client_direction) and SGD, and calls no Lightning hook of the method's "
                  "per step")
    return reason


# Why 16-mixed trains one client after another: Lightning's gradient scaler scales one backward, which the stacked
# engine (its own gradients and SGD) does not run; unscaled float16 gradients can underflow to zero
UNSCALED = ("trainer.precision 16-mixed: the stacked step has no loss scale (its float16 gradients could "
            "underflow); bf16-mixed and 32-true train batched")


def stack_clients(tensor: Tensor, num_clients: int) -> Tensor:
    """``num_clients`` copies of ``tensor`` on a new leading axis, each slice in ``tensor``'s memory format
    (a channels_last model keeps channels_last weights per client)."""
    channels_last = tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last)
    if channels_last and not tensor.is_contiguous():
        o, c, h, w = tensor.shape
        out = tensor.new_empty((num_clients, o, h, w, c)).permute(0, 1, 4, 2, 3)
    else:
        out = tensor.new_empty((num_clients, *tensor.shape))
    return out.copy_(tensor.unsqueeze(0).expand_as(out))


def clip_coefficients(grads: list[Tensor], max_norm: float) -> Tensor:
    """Each client's clip coefficient ``[K]``: ``min(1, max_norm / (norm + 1e-6))`` of its gradient's total
    2-norm (slice ``k`` of every tensor in ``grads``)."""
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads])  # [P, K]
    return (max_norm / (torch.linalg.vector_norm(norms, dim=0) + 1e-6)).clamp(max=1.0)


def client_view(algorithm: Any, exclude: set[str]) -> dict[str, Any]:
    """What ``algorithm`` holds now, by attribute, copied so that later in-place changes do not reach it (a
    module as its state), except the names in ``exclude``."""
    def copy(value: Any) -> Any:
        if isinstance(value, Tensor):
            return value.detach().clone()
        if isinstance(value, nn.Module):
            return {k: t.detach().clone() for k, t in value.state_dict().items()}
        if isinstance(value, (list, tuple)):
            return [copy(v) for v in value]
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        return value

    return {name: copy(value) for name, value in vars(algorithm).items()
            if name not in exclude and not name.startswith("__")}


def same(a: Any, b: Any) -> bool:
    """Whether two copied values (``client_view``) are equal: tensors by shape, dtype and value."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and bool(torch.equal(a, b)))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    try:
        return bool(a is b or a == b)
    except Exception:  # a value without a truthy equality (an array): equal only as the same object
        return False


def per_client_attributes(views: list[dict[str, Any]]) -> list[str]:
    """The attributes whose values differ between clients' views (``client_view`` after each client's start)."""
    names: set[str] = set().union(*views)
    return sorted(name for name in names
                  if any(name not in v or name not in views[0] or not same(views[0][name], v[name])
                         for v in views[1:]))


def stored_attributes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The attributes a loss call set (``before`` / ``after``: the algorithm's ``vars``): new ones, and ones
    bound to another value; a container handed on and reset to an equal one (FedMLB's maps) is not kept."""
    def kept(name: str, value: Any) -> bool:
        if name in PER_CLIENT:
            return False
        if name not in before:
            return True
        if before[name] is value:
            return False
        try:
            return isinstance(value, Tensor) or not same(before[name], value)
        except Exception:  # a mapped tensor that escaped the call cannot even be compared
            return True

    return sorted(name for name, value in after.items() if kept(name, value))


def refuse_per_client_attributes(pl_module: Any, views: list[dict[str, Any]]) -> None:
    """Refuse an attribute that ``on_client_start`` set differently per client (``views``: ``client_view`` after
    each client's start) without naming it in ``client_tensors``: stacked clients would all read the last one's."""
    differing = per_client_attributes(views)
    if differing:
        raise ValueError(
            f"model {type(pl_module).__name__}: on_client_start sets {', '.join('self.' + n for n in differing)} "
            f"differently per client, and batched clients would all see the last client's: {REMEDY} "
            "(fedrcl.federated.batched)")


def refuse_stored_attributes(pl_module: Any, before: dict[str, Any]) -> None:
    """Refuse a ``client_loss`` that stored something on the algorithm (``before``: its ``vars`` before the
    first mapped call): a loss keeps no state, and a mapped tensor would leak into it."""
    stored = stored_attributes(before, vars(pl_module))
    if stored:
        raise ValueError(
            f"model {type(pl_module).__name__}: client_loss stores {', '.join('self.' + k for k in stored)}; a loss "
            "keeps no state (batched clients would leak mapped tensors into it): keep per-client results in "
            "on_client_end, or set unbatchable_reason")


def replaced_tensors(model: str, hook: str, given: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """The entries of a slice's ``client.tensors`` that ``hook`` replaced (``given``: as handed in, ``now``: after
    the call; a dict entry is replaced when any of its tensors is). One added or removed is refused: every client's
    tensors are stacked once, at its start."""
    if now.keys() != given.keys():
        added, removed = sorted(now.keys() - given.keys()), sorted(given.keys() - now.keys())
        raise ValueError(f"model {model}: {hook} " + "; ".join(
            [f"adds client.tensors[{k!r}]" for k in added] + [f"removes client.tensors[{k!r}]" for k in removed])
            + ": a client's tensors are set in on_client_start (batched clients stack them there)")

    def differs(old: Any, new: Any) -> bool:
        if isinstance(old, dict) and isinstance(new, dict) and old.keys() == new.keys():
            return any(old[k] is not new[k] for k in old)
        return old is not new

    return {name: value for name, value in now.items() if differs(given[name], value)}


def run_compile_options(trainer: Any) -> Optional[dict[str, Any]]:
    """``compile_options`` of the run's device with ``trainer.compile_clients``; ``None`` without."""
    return compile_options(trainer.strategy.root_device) if trainer.federation.batching.compile else None


def compile_options(device: torch.device) -> dict[str, Any]:
    """``torch.compile``'s options for the clients' mapped step on ``device``: ``COMPILE_BACKEND``, with CUDA
    graphs (``reduce-overhead``) on CUDA with inductor."""
    graphs = device.type == "cuda" and COMPILE_BACKEND == "inductor"
    return {"backend": COMPILE_BACKEND, "mode": "reduce-overhead" if graphs else None}
