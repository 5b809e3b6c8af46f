"""The stacked engine: one round's clients of ``S >= 1`` federations trained on one stacked client axis.

Batched clients (``fedrcl fit --trainer.client_batching on``: ``S = 1``, this process's clients) and seeds together
(``fedrcl seeds --together``, ``fedrcl sweep --together``: ``S`` seeds or settings) are the same engine. A round's
clients are started (``ClientRun.start``: the broadcast weights, the extras, ``on_client_start``) and laid on one
axis ``[S * C, ...]``: their weights, SGD momenta, what each start put in its ``client.tensors``, their facts, each
federation's broadcast weights and values of the method's ``SWEEPABLE`` loss weights, and the client lr of every
client at every step (``client_lr`` of its own local epoch). Each stacked step is ``ClientStep``'s (the method's
one-client ``local_loss`` or ``client_direction`` mapped, per-client clip, SGD; what a step replaced in a client's
tensors kept for its next); clients that differ in step count or batch sizes step under a step mask
(``fedrcl.contract.step_mask``), a finished client keeping its weights, momenta and tensors exactly. ``finish``
hands each client's weights, tensors and summed loss back to its run, in order.

``StackedClients`` runs the engine inside ``fedrcl fit``'s Lightning loop: one stacked step per Lightning step
(each Lightning hook per step runs as for any step); Lightning's own optimizer step then has nothing to move, as
its parameter group holds one empty tensor while the round's clients are stacked.

What would silently differ from clients trained one after another is refused in the run's first stacked round,
in one line, before any step: an attribute that ``on_client_start`` sets differently per client instead of putting
it in ``client.tensors`` (every client would see the last client's), clients whose tensors differ in names or
shapes, a loss that stores something on the algorithm or replaces a client tensor, and a loss that cannot run mapped
(e.g. branching on a client fact).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from fedrcl.contract.step_mask import RoundMask, client_epochs, uniform
from fedrcl.data.datamodule import datamodule_of
from fedrcl.federated.batched import CLIENT_FACTS, PER_CLIENT, client_view, refuse_per_client_attributes, \
    refuse_stored_attributes, run_compile_options, stack_clients
from fedrcl.federated.client_step import ClientStep, ClientTensors, StepInputs, map_tensors
from fedrcl.federated.round import ClientResult, ClientRun

# The dtype the stacked forward runs in under Lightning's mixed precision (autocast does not reach inside vmap;
# 16-mixed trains one client after another: ``batched.UNSCALED``)
MIXED = {"bf16-mixed": torch.bfloat16}


def stacked_step(cache: dict[tuple[int, int, int], ClientStep], algorithm: Any, seeds: int, clients: int,
                 trainer: Any) -> ClientStep:
    """The stacked step of ``seeds`` x ``clients`` clients of ``algorithm`` in ``trainer``'s precision, compiled
    with its ``trainer.compile_clients``, built once per shape into ``cache``."""
    key = (seeds, clients, id(algorithm))
    if key not in cache:
        cache[key] = ClientStep(algorithm, seeds, clients, MIXED.get(str(trainer.precision)),
                                run_compile_options(trainer))
    return cache[key]


def stacked_tensors(model: str, each: list[dict[str, Any]], join: Callable[[list[Tensor]], Tensor]) -> ClientTensors:
    """The clients' ``client.tensors`` (``each``, one dict per client or per laid round) on one axis by ``join``
    (``torch.stack`` or ``torch.cat``); names, kinds (a tensor or a dict of tensors) or shapes that differ between
    clients are refused in one line: one stacked axis gives every client the same."""
    first = each[0]

    def refuse(why: str) -> ValueError:
        return ValueError(f"model {model}: the clients' client.tensors differ ({why}); batched clients stack them, "
                          "so every client's start puts the same names and shapes there, or set unbatchable_reason")

    if any(t.keys() != first.keys() for t in each):
        raise refuse(f"names {sorted(first)} against {sorted(next(t for t in each if t.keys() != first.keys()))}")
    out: ClientTensors = {}
    for name, value in first.items():
        values = [t[name] for t in each]
        try:
            if isinstance(value, dict):
                if any(not isinstance(v, dict) or v.keys() != value.keys() for v in values):
                    raise refuse(f"{name!r} is not the same dict of tensors for every client")
                out[name] = {k: join([v[k] for v in values]) for k in value}
            else:
                out[name] = join(values)
        except (TypeError, RuntimeError) as error:
            raise refuse(f"{name!r}: {str(error).splitlines()[0]}") from error
    return out


class Member(NamedTuple):
    """One federation of a stacked round, as the engine reads it: its trainer, client algorithm and data module."""

    trainer: Any
    module: Any
    datamodule: Any


class StackedRound:
    """One round's clients of ``members`` on one stacked axis (see the module docstring).

    Args:
        members: the federations (``trainer``, ``module``, ``datamodule`` each); the first's algorithm object runs
            every slice's loss (seeds together check that this gives each seed its own: ``check_seeds``).
        runs: each federation's configured clients, in its plan's order (as many per federation).
        step: the stacked step for ``len(members)`` x ``len(runs[0])`` clients.
        check: the run's first stacked round: refuse what would differ from clients one after another.
    """

    def __init__(self, members: Sequence[Any], runs: list[list[ClientRun]], step: ClientStep, check: bool,
                 laid: Optional[Sequence[StackedRound]] = None):
        self.members, self.runs, self.engine, self._check = list(members), runs, step, check
        self.clients = len(runs[0])
        first = self.members[0].module
        if laid is None:  # start every client and stack what its start put in its tensors
            self.tensors: ClientTensors = stacked_tensors(type(first).__name__, self._start(check), torch.stack)
        else:  # rounds whose clients were started and laid already, joined (``from_laid``)
            self.tensors = stacked_tensors(type(first).__name__, [r.tensors for r in laid], torch.cat)
        sent = [clients[0].downlink.sent for clients in runs]
        self.device = next(iter(sent[0].values())).device
        self.params = {name: torch.cat([stack_clients(s[name].detach(), self.clients) for s in sent])
                       for name, _ in first.backbone.named_parameters()}
        self.global_state = {name: torch.stack([s[name] for s in sent]) for name in sent[0]}
        self.momenta = {name: torch.zeros_like(p) for name, p in self.params.items()} if first.momentum else {}
        # Each federation's own value of every loss weight its method declares sweepable (a sweep's mu = 0.01 and
        # 0.1 on one axis), in the weights' dtype: set per slice in the step, never the first federation's.
        dtype = next(iter(self.params.values())).dtype
        self.weights = {name: torch.tensor([float(getattr(m.module, name)) for m in self.members
                                            for _ in range(self.clients)], dtype=dtype, device=self.device)
                        for name in type(first).SWEEPABLE}
        every = [(member, client) for member, clients in zip(self.members, runs) for client in clients]
        self.facts = {name: torch.tensor([getattr(c.client, name) for _, c in every], device=self.device)
                      for name in CLIENT_FACTS}
        sizes = [m.datamodule.client_batch_sizes(c.client.client_id, c.client.local_epochs) for m, c in every]
        self.mask = None if uniform(sizes) else RoundMask(sizes, self.device)
        self.num_steps = max(len(size) for size in sizes)  # the round's stacked steps (its longest client's)
        self.steps_per_epoch = [m.datamodule.client_steps_per_epoch(c.client.client_id) for m, c in every]
        self.seed_of = torch.tensor([s for s in range(len(runs)) for _ in range(self.clients)], device=self.device)
        # Every client's lr at every stacked step: its own local epoch's (cast to the weights' dtype as SGD casts lr)
        epochs = client_epochs(self.steps_per_epoch, every[0][1].client.local_epochs)
        self.lr = torch.tensor([[float(m.module.client_lr(c.client.round_idx, at.get(k, 0)))
                                 for k, (m, c) in enumerate(every)] for at in epochs],
                               dtype=torch.float64, device=self.device)
        # Sums of the steps' outputs, never the outputs themselves: under CUDA graphs a replay overwrites them
        self.loss_sums = torch.zeros(len(every), dtype=dtype, device=self.device)
        self.part_sums: dict[str, Tensor] = {}
        self.t = 0  # the next stacked step
        self.stepped = 0  # how many clients took the last step

    @classmethod
    def from_laid(cls, laid: Sequence[StackedRound], step: ClientStep, check: bool) -> StackedRound:
        """Several federations' rounds, each laid on its own axis (its clients started), as one round on one axis,
        federation after federation: the stacked engine of seeds together (``fedrcl.federated.lockstep``)."""
        return cls([r.members[0] for r in laid], [r.runs[0] for r in laid], step, check, laid)

    def _start(self, check: bool) -> list[dict[str, Any]]:
        """Start every client in order and return each one's ``client.tensors``; in the run's first stacked round,
        refuse an attribute that a start sets differently per client."""
        tensors = []
        for member, clients in zip(self.members, self.runs):
            views = []
            for client in clients:
                client.start()
                tensors.append(client.client.tensors)
                if check:
                    views.append(client_view(member.module, PER_CLIENT))
            if check:
                refuse_per_client_attributes(member.module, views)
        return tensors

    def step(self, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Stacked step ``t``: every client's batch ``x[n]``, ``y[n]`` (under a step mask, the stepping clients'
        batches concatenated group after group, ``step_mask.masked_batch``). Returns the losses and loss parts of
        the clients that stepped."""
        t, mask, n = self.t, self.mask, len(self.loss_sums)
        full = mask is None or mask.full(t)
        if mask is not None and full:  # every client steps with one batch size: the concatenation is the stack
            x, y = x.unflatten(0, (n, -1)), y.unflatten(0, (n, -1))
        if full and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # a new step: the last one's outputs are its inputs
        inputs = StepInputs(x, y, self.lr[t], self.tensors, self.facts, self.global_state, self.weights)
        module = self.members[0].module
        before = dict(vars(module)) if self._check else None
        try:
            with torch.autocast(self.device.type, enabled=False):  # the forward's dtype is the engine's (``MIXED``)
                if full:
                    self.params, self.momenta, losses, parts, self.tensors = self.engine(self.params, self.momenta,
                                                                                         inputs)
                    positions: Optional[Tensor] = None
                else:
                    assert mask is not None
                    self.params, self.momenta, losses, parts, self.tensors, positions = self.engine.masked(
                        self.params, self.momenta, inputs, mask, t, self.seed_of)
        except RuntimeError as error:
            if before is None or "vmap" not in str(error):
                raise
            raise ValueError(
                f"model {type(module).__name__}: client_loss cannot run batched ({str(error).splitlines()[0]}); "
                "batched clients see self.client's client_id, num_samples and num_steps as 0-dim tensors: use them "
                "in tensor arithmetic, or set unbatchable_reason, or trainer.client_batching off") from error
        if before is not None:  # the first step: a loss that stored something is refused
            refuse_stored_attributes(module, before)
            self._check = False
        self.loss_sums = self._add(self.loss_sums, losses, positions)
        for name, value in parts.items():
            self.part_sums[name] = self._add(self.part_sums.get(name, torch.zeros_like(self.loss_sums)), value,
                                             positions)
        self.t, self.stepped = t + 1, n if mask is None else mask.count[t]
        return losses, parts

    @staticmethod
    def _add(total: Tensor, values: Tensor, positions: Optional[Tensor]) -> Tensor:
        values = values.to(total.dtype)
        return total + values if positions is None else total.index_add(0, positions, values)

    @torch.no_grad()
    def finish(self, s: int, fold: Callable[[ClientRun, ClientResult], None]) -> None:
        """Federation ``s``'s clients, in order: each one's weights into its backbone and its slice of the tensors
        into its ``client.tensors`` (as its last step left them), its run ended with its own summed loss, and
        ``fold``-ed."""
        module = self.members[s].module
        own = dict(module.backbone.named_parameters())
        for i, client in enumerate(self.runs[s]):
            n = s * self.clients + i
            for name, stacked in self.params.items():
                own[name].copy_(stacked[n])
            client.client.tensors.update(map_tensors(lambda t: t[n], self.tensors))
            client.loss_sum = self.loss_sums[n]
            fold(client, client.end())


class StackedClients(StackedRound):
    """Batched clients in ``fedrcl fit``'s round (``S = 1``: this process's clients), created at the round's first
    Lightning step and handed to the algorithm (``algorithm.stack``): its ``training_step`` takes each stacked
    step (``step``) and returns ``lightning_loss``, whose backward and optimizer step move nothing, so that every
    Lightning hook per step, precision plugin and process launch runs the step as any other. ``finish`` gives the
    optimizer its parameters back."""

    def __init__(self, trainer: Any, pl_module: Any, runs: list[ClientRun], step: ClientStep, check: bool):
        super().__init__([Member(trainer, pl_module, datamodule_of(trainer))], [runs], step, check)
        dtype = next(iter(self.params.values())).dtype
        self._empty = torch.zeros(0, dtype=dtype, device=self.device, requires_grad=True)
        (self.optimizer,) = trainer.optimizers
        (group,) = self.optimizer.param_groups
        self._module_params, group["params"] = group["params"], [self._empty]
        self.optimizer.state.clear()
        pl_module.stack = self
        self.joined: Optional[Any] = None  # the round of several runs it trains in (``lockstep.JoinedRound``)

    def step(self, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """A stacked step of this run's clients: in a joined round, taken with every other run's
        (``lockstep.JoinedRound.step``); alone if the runs parted before the round's first step."""
        if self.joined is not None:
            taken = self.joined.step(self, x, y)
            if taken is not None:
                return taken
            self.joined = None
        return super().step(x, y)

    def lightning_loss(self) -> Tensor:
        """What Lightning's step backpropagates: a zero of the optimizer's one empty tensor (the engine has stepped)."""
        return self._empty.sum()

    def finish_round(self, fold: Callable[[ClientRun, ClientResult], None]) -> None:
        """Give the optimizer its parameters back (state cleared); end and ``fold`` every client in order (in a
        joined round, with its clients' weights, step state and losses taken back from it first)."""
        if self.joined is not None:
            self.joined.hand_back(self)
        self.optimizer.param_groups[0]["params"] = self._module_params
        self.optimizer.state.clear()
        self.members[0].module.stack = None
        self.finish(0, fold)
