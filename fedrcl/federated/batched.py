"""Batched clients: a round's clients (of this process) trained at once, on a leading client axis.

All clients of a round start from the same broadcast weights. Stacked K times they form one set of
parameters ``[K, ...]``; ``torch.func.vmap`` over ``torch.func.functional_call`` runs the algorithm's own
one-client loss (``FedAvg.local_loss``, written once, for one client) for every client on its own batch with
its own slice of the weights. The sum of the K losses has, in each slice, exactly that client's gradient, so
Lightning's ordinary backward and the algorithm's ordinary SGD optimizer (elementwise: lr, weight decay,
momentum) update every client at once; only the gradient-norm clip is per client (``clip_grad_norm_``).
One Lightning step is one local step of every client; batches come stacked from
``FederatedDataModule.stacked_client_batches`` (each client's from its own (seed, round, client) stream).

Clients that differ in step count or batch sizes (``data.local_iters_per_epoch: null`` with clients of different
sizes) train stacked under a step mask (``fedrcl.contract.step_mask``): the round has as many steps as its
longest client; at each step the clients that step are grouped by batch size, each group's loss mapped over its
own slices of the stacked weights on its real batches, and the clients that have finished keep their weights and
SGD momenta exactly (restored after the optimizer's step, which would apply weight decay and momentum to them).
Lightning's optimizer has one lr per step: where clients in different local epochs would need different client
lrs at one step (``client_lr`` depending on ``local_epoch``), the round falls back (seeds together, whose step
takes a per-client lr, train it stacked).

Shared by all clients, unbatched: the round's frozen global teacher, the broadcast weights (FedProx, FedACG's
client term), the round's index and seed. Per client, mapped: inside ``client_loss`` each client's slice sees
its own ``self.client`` (``client_id``, ``num_samples`` and ``num_steps`` as 0-dim integer tensors, usable in
tensor arithmetic), and the tensors an algorithm names in ``client_tensors`` (set by its ``on_client_start``,
e.g. FedLC's label counts), stacked. A round falls back to the sequential loop, with a one-line notice, when
the algorithm keeps per-client models (``unbatchable_reason``, MOON), when the backbone has buffers (BatchNorm
statistics) or when one step would need different client lrs (above).

What would silently differ from clients trained one after another is refused at the first batched round, in
one line, before any step: an attribute that ``on_client_start`` sets differently per client without naming it
in ``client_tensors`` (every client would see the last client's), a ``client_loss`` that stores something on
the algorithm (a loss keeps no state: per-client results belong in ``on_client_end``), and a ``client_loss``
that cannot run mapped (e.g. branching on a client fact).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Optional, get_args

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.func import functional_call, vmap

from fedrcl.contract.plan import RoundPlan
from fedrcl.federated.round import ClientResult, ClientRun
from fedrcl.contract.step_mask import RoundMask, joined, scattered, shared_lrs, split_groups, uniform

if TYPE_CHECKING:
    import fedrcl.algorithms.fedavg

Mode = Literal["auto", "on", "off"]
# torch.compile backend of the batched step; tests set a cheap one ("aot_eager") to run it on the CPU.
COMPILE_BACKEND = "inductor"
# The client facts each mapped slice sees as its own (``ClientContext`` fields).
CLIENT_FACTS = ("client_id", "num_samples", "num_steps")
# Attributes of the algorithm that are per client by design: its client (mapped), the weights (stacked).
PER_CLIENT = {"client", "_params", "stack", "backbone"}
REMEDY = ("name it in client_tensors (a tensor, stacked per client), set unbatchable_reason, or "
          "trainer.client_batching off")


class _UnmappedData:
    """``client.data`` inside a batched ``client_loss``: one call serves every client, so there is no one
    client's data to give; reading it says where to read it instead."""

    def __getattr__(self, name: str) -> Any:
        raise ValueError(f"client_loss reads client.data.{name}, which batched clients cannot map: read the "
                         "client's data in on_client_start into a tensor named in client_tensors (FedLC's "
                         "label counts), or set unbatchable_reason")


UNMAPPED_DATA: Any = _UnmappedData()


class LocalLoss(nn.Module):
    """``algorithm.local_loss`` as a module call, so that ``functional_call`` can swap the weights it sees."""

    def __init__(self, algorithm: fedrcl.algorithms.fedavg.FedAvg):
        super().__init__()
        self.algorithm = algorithm

    def forward(self, client_tensors: dict[str, Tensor], facts: dict[str, Tensor], x: Tensor, y: Tensor,
                global_state: Optional[dict[str, Tensor]] = None, direction: bool = False) -> Any:
        """The slice's ``(loss, parts)``, or with ``direction`` its ``client_direction`` ``(direction, loss,
        parts)``. ``global_state``: the slice's own broadcast weights where they differ between slices (seeds
        together, ``fedrcl.federated.client_step``); ``None``: the client's."""
        algorithm = self.algorithm
        assert algorithm.client is not None, "the clients were started (StackedClients)"
        # This client's tensors, its facts and its slice of the weights for the server's client term, set for
        # the call and put back before returning: no vmapped tensor outlives it (torch.compile needs that too).
        own: dict[str, Any] = {**facts} if global_state is None else {**facts, "global_state": global_state}
        bound = {**client_tensors, "_params": dict(algorithm.backbone.named_parameters()),
                 # the slice's own facts, 0-dim tensors where one client has ints (read in tensor arithmetic)
                 "client": dataclasses.replace(algorithm.client, data=UNMAPPED_DATA, **own)}
        saved = {name: getattr(algorithm, name) for name in bound}
        for name, value in bound.items():
            setattr(algorithm, name, value)
        try:
            if direction:
                return algorithm.client_direction(dict(algorithm.backbone.named_parameters()), x, y)
            return algorithm.local_loss(x, y)
        finally:
            for name, value in saved.items():
                setattr(algorithm, name, value)


class ClientBatching:
    """The ``trainer.client_batching`` option: when to train a round's clients batched, and the batched loss.

    Args:
        mode: ``on``: batched whenever the round allows it; ``off``: clients one after another; ``auto``:
            batched on CUDA, sequential elsewhere (on the CPU it is slower: ``bench/batched_step.py``).
        compile: compile the batched loss with ``torch.compile`` (``mode="reduce-overhead"``, CUDA graphs,
            on CUDA).
    """

    def __init__(self, mode: Mode = "auto", compile: bool = False):
        if mode not in get_args(Mode):
            raise ValueError(f"trainer.client_batching must be one of {', '.join(get_args(Mode))}, "
                             f"got {mode!r}")
        self.mode, self.compile = mode, compile
        self._noticed: set[str] = set()
        self._module: Optional[LocalLoss] = None
        self._mapped: dict[tuple[bool, bool], Callable[..., Any]] = {}  # (direction, eager) -> the mapped call
        self._low: Optional[torch.dtype] = None
        self.compile_seconds: Optional[float] = None
        self.checked = False  # the attributes on_client_start sets per client (``StackedClients``)

    def applies(self, pl_module: Any, plan: RoundPlan, device: torch.device) -> bool:
        """Whether the round of ``plan`` trains batched (a fallback is announced once per reason)."""
        if self.mode == "off" or (self.mode == "auto" and device.type != "cuda"):
            return False
        reason = unbatchable(pl_module)
        if reason is None and len(set(plan.steps_per_epoch)) > 1 and shared_lrs(
                lambda epoch: pl_module.client_lr(plan.round_idx, epoch), plan.steps_per_epoch,
                plan.local_epochs) is None:
            reason = ("clients in different local epochs would need different client lrs at one step "
                      "(client_lr depends on local_epoch; Lightning's optimizer has one lr per step)")
        if reason is None:
            return True
        if reason not in self._noticed:
            self._noticed.add(reason)
            rank_zero_info(f"trainer.client_batching: clients trained one after another: {reason}")
        return False

    def losses(self, pl_module: fedrcl.algorithms.fedavg.FedAvg, params: dict[str, Tensor],
               client_tensors: dict[str, Tensor], facts: dict[str, Tensor], x: Tensor, y: Tensor,
               direction: bool = False, eager: bool = False) -> Any:
        """Every client's ``local_loss`` on its batch (``x[k]``, ``y[k]``) with its weight slices, tensors and
        facts (``[k]``): losses ``[K]`` and parts; with ``direction`` each client's ``client_direction`` (directions
        ``[K, ...]`` in the weights' dtype, losses, parts). ``eager``: never compiled (a step mask's groups, whose
        shapes change from step to step).

        Under Lightning's mixed precision (``bf16-mixed``, ``16-mixed``) the weights and images enter the
        mapped call in the autocast dtype: autocast does not reach inside ``vmap`` (torch 2.14, CPU checked),
        so the batched forward runs wholly in that dtype (normalisations included, which autocast keeps in
        float32); weights, gradients and optimizer stay in float32, and the losses upcast as before.
        """
        device_type = x.device.type
        low = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        if self._module is None or self._module.algorithm is not pl_module or self._low != low:
            self._module, self._low, self._mapped = LocalLoss(pl_module), low, {}
        compiled = self.compile and not eager
        if (direction, eager) not in self._mapped:
            module = self._module

            def one_client(p: dict[str, Tensor], c: dict[str, Tensor], f: dict[str, Tensor], xb: Tensor,
                           yb: Tensor) -> Any:
                dtypes = {name.removeprefix("algorithm.backbone."): w.dtype for name, w in p.items()}
                if low is not None:
                    p, xb = {name: w.to(low) for name, w in p.items()}, xb.to(low)
                if not direction:
                    return functional_call(module, p, (c, f, xb, yb))
                d, loss, parts = functional_call(module, p, (c, f, xb, yb), {"direction": True})
                return {name: g.to(dtypes[name]) for name, g in d.items()}, loss, parts

            mapped: Callable[..., Any] = vmap(one_client, randomness="error")
            self._mapped[direction, eager] = torch.compile(mapped, **compile_options(x.device)) if compiled else mapped
        prefixed = {f"algorithm.backbone.{name}": p for name, p in params.items()}
        first = compiled and self.compile_seconds is None
        start = time.perf_counter()
        out = self._mapped[direction, eager](prefixed, client_tensors, facts, x, y)
        if direction:  # the directions by the backbone's names
            out = ({name.removeprefix("algorithm.backbone."): d for name, d in out[0].items()}, *out[1:])
        if first:  # the first call compiles (a one-off host sync to time it)
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            self.compile_seconds = time.perf_counter() - start
            rank_zero_info(f"trainer.compile_clients: the first batched step (compiling) took "
                           f"{self.compile_seconds:.1f} s")
        return out


def unbatchable(pl_module: Any) -> Optional[str]:
    """Why the method's clients can never train on a stacked axis (its ``unbatchable_reason``, or buffers in
    its backbone: BatchNorm statistics are not per client), or ``None``."""
    reason: Optional[str] = getattr(pl_module, "unbatchable_reason", None)
    if reason is None and any(True for _ in pl_module.backbone.buffers()):
        reason = "the backbone has buffers (e.g. BatchNorm statistics)"
    return reason


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


def clip_grad_norm_(grads: list[Tensor], max_norm: float) -> None:
    """Clip each client's gradient (slice ``k`` of every tensor in ``grads``) to total 2-norm ``max_norm``.

    The per-client form of ``torch.nn.utils.clip_grad_norm_``: the same coefficient
    ``min(1, max_norm / (norm + 1e-6))``, computed and applied on the device.
    """
    coef = clip_coefficients(grads, max_norm)
    for g in grads:
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))).to(g.dtype))


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


def compile_options(device: torch.device) -> dict[str, Any]:
    """``torch.compile``'s options for the clients' mapped step on ``device``: ``COMPILE_BACKEND``, with CUDA
    graphs (``reduce-overhead``) on CUDA with inductor."""
    graphs = device.type == "cuda" and COMPILE_BACKEND == "inductor"
    return {"backend": COMPILE_BACKEND, "mode": "reduce-overhead" if graphs else None}


class StackedClients:
    """One round's clients as one set of stacked weights, plugged into the algorithm's optimizer.

    Created at the round's first step: starts every client's run (``ClientRun.start``: the broadcast weights,
    the extras, ``on_client_start``; the tensors the algorithm names in ``client_tensors`` are stacked, and
    each client's facts), refuses an attribute that ``on_client_start`` set per client without naming it
    there, stacks the broadcast weights and points the optimizer's parameter group at them (its state
    cleared: every client's optimizer starts fresh), and hands itself to the algorithm (``algorithm.stack``).
    ``sizes`` (each client's batch size per step, ``FederatedDataModule.client_batch_sizes``) that differ between
    clients put the round under a step mask (``fedrcl.contract.step_mask``; the module docstring): the round
    loop calls ``begin_step`` before each step and ``end_step`` after the optimizer's. ``finish`` puts the
    module's parameters back and, for each client in turn, loads its weights into the backbone and ends its run,
    in client order as the sequential loop does.
    """

    def __init__(self, trainer: Any, pl_module: Any, runs: list[ClientRun], batching: ClientBatching,
                 sizes: Optional[list[tuple[int, ...]]] = None):
        self.pl_module, self.batching, self.runs = pl_module, batching, runs
        names = tuple(getattr(pl_module, "client_tensors", ()))
        per_client: dict[str, list[Tensor]] = {name: [] for name in names}
        views = []  # checked in the run's first batched round: what is per client does not change later
        for run in runs:
            run.start()
            for name, values in per_client.items():
                values.append(getattr(pl_module, name))
            if not batching.checked:
                views.append(client_view(pl_module, PER_CLIENT | set(names)))
        batching.checked = True
        if views:
            refuse_per_client_attributes(pl_module, views)
        self.client_tensors = {name: torch.stack(values) for name, values in per_client.items()}
        sent = runs[0].downlink.sent
        device = next(iter(sent.values())).device
        self.facts = {name: torch.tensor([getattr(run.client, name) for run in runs], device=device)
                      for name in CLIENT_FACTS}
        self.params = {name: stack_clients(sent[name].detach(), len(runs)).requires_grad_()
                       for name, _ in pl_module.backbone.named_parameters()}
        (self.optimizer,) = trainer.optimizers
        (group,) = self.optimizer.param_groups
        self._module_params, group["params"] = group["params"], list(self.params.values())
        self.optimizer.state.clear()
        self._checked = False
        self.mask = None if sizes is None or uniform(sizes) else RoundMask(sizes, device)
        self.step = 0  # the stacked step in progress
        self._before: list[tuple[Tensor, Tensor]] = []  # a masked step's weights and momenta as they were
        pl_module.stack = self

    def __len__(self) -> int:
        """How many clients take the current step (all, unless some have finished: ``fedrcl.contract.step_mask``)."""
        return len(self.runs) if self.mask is None else self.mask.count[self.step]

    def _masked(self) -> bool:
        return self.mask is not None and not self.mask.full(self.step)

    def begin_step(self, step: int) -> None:
        """Before stacked step ``step``: under a mask where some clients have finished, keep a copy of their slices
        of the weights and momenta, which the optimizer's step would change (weight decay, momentum)."""
        self.step = step
        if self.mask is None or self.mask.count[step] == self.mask.num_clients:
            return
        idle = self.mask.idle[step]
        state = [self.optimizer.state.get(p, {}).get("momentum_buffer") for p in self.params.values()]
        self._before = [(t, t.detach().index_select(0, idle)) for t in [*self.params.values(), *state]
                        if t is not None]

    @torch.no_grad()
    def end_step(self) -> None:
        """After the optimizer's step: the finished clients' slices of the weights and momenta put back exactly."""
        if not self._before:
            return
        assert self.mask is not None  # begin_step kept them
        idle = self.mask.idle[self.step]
        for tensor, before in self._before:
            tensor.index_copy_(0, idle, before)
        self._before = []

    def _mapped(self, params: dict[str, Tensor], client_tensors: dict[str, Tensor], facts: dict[str, Tensor],
                x: Tensor, y: Tensor, direction: bool, eager: bool) -> Any:
        """``ClientBatching.losses`` of these slices; the round's first call also refuses a loss that cannot run
        mapped or that stores something on the algorithm."""
        if self._checked:
            return self.batching.losses(self.pl_module, params, client_tensors, facts, x, y, direction, eager)
        name = type(self.pl_module).__name__
        before = dict(vars(self.pl_module))
        try:
            out = self.batching.losses(self.pl_module, params, client_tensors, facts, x, y, direction, eager)
        except RuntimeError as error:
            if "vmap" not in str(error):
                raise
            raise ValueError(
                f"model {name}: client_loss cannot run batched ({str(error).splitlines()[0]}); batched clients "
                "see self.client's client_id, num_samples and num_steps as 0-dim tensors: use them in tensor "
                "arithmetic, or set unbatchable_reason, or trainer.client_batching off") from error
        refuse_stored_attributes(self.pl_module, before)
        self._checked = True
        return out

    def losses(self, x: Tensor, y: Tensor, direction: bool = False) -> Any:
        """Per-client losses ``[K]`` and loss parts (each ``[K]``) of one stacked batch (with ``direction``: each
        client's ``client_direction`` first, ``[K, ...]``). Under a step mask the batch is the stepping clients'
        batches concatenated (``step_mask.masked_batch``), and the losses are theirs, group after group (the
        directions ``[K, ...]``, zero for the clients that do not step)."""
        if not self._masked():
            if self.mask is not None:  # every client steps with one batch size: the concatenation is the stack
                x, y = x.unflatten(0, (len(self.runs), -1)), y.unflatten(0, (len(self.runs), -1))
            return self._mapped(self.params, self.client_tensors, self.facts, x, y, direction, eager=False)
        assert self.mask is not None
        groups, indices = self.mask.groups[self.step], self.mask.index[self.step]
        outs = []
        for index, (xg, yg) in zip(indices, split_groups(x, y, groups)):
            select = lambda tensors: {k: t.index_select(0, index) for k, t in tensors.items()}  # noqa: E731
            outs.append(self._mapped(select(self.params), select(self.client_tensors), select(self.facts), xg, yg,
                                     direction, eager=True))
        if not direction:
            return joined(outs)
        return (scattered(self.params, indices, [d for d, _, _ in outs]), *joined([out[1:] for out in outs]))

    def directions(self, x: Tensor, y: Tensor) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]:
        """Each client's ``client_direction`` on its batch of the stacked one: directions ``[K, ...]``, losses
        ``[K]``, parts."""
        out: tuple[dict[str, Tensor], Tensor, dict[str, Tensor]] = self.losses(x, y, direction=True)
        return out

    def clip_grad_norm_(self, max_norm: float) -> None:
        clip_grad_norm_([p.grad for p in self.params.values() if p.grad is not None], max_norm)

    @torch.no_grad()
    def finish(self, fold: Callable[[ClientRun, ClientResult], None]) -> None:
        """Restore the optimizer; for each client in turn load its weights into the backbone, end its run
        (with the stack's summed losses, which the driver added to the first run) and ``fold`` it."""
        self.optimizer.param_groups[0]["params"] = self._module_params
        self.optimizer.state.clear()
        self.pl_module.stack = None
        module_params = dict(self.pl_module.backbone.named_parameters())
        for i, run in enumerate(self.runs):
            for name, stacked in self.params.items():
                module_params[name].copy_(stacked[i])
            run.loss_sum = self.runs[0].loss_sum
            fold(run, run.end())
