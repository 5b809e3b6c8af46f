"""The stacked engine: one round's clients of ``S >= 1`` federations trained on one stacked client axis.

Batched clients (``fedrcl fit --trainer.client_batching on``: ``S = 1``, this process's clients) and seeds together
(``fedrcl seeds --together``, ``fedrcl sweep --together``: ``S`` seeds or settings) are the same engine. A round's
clients are started (``ClientRun.start``: the broadcast weights, the extras, ``on_client_start``) and laid on one
axis ``[S * C, ...]``: their weights, SGD momenta, the tensors the method names in ``client_tensors``, their facts,
each federation's broadcast weights and values of the method's ``SWEEPABLE`` loss weights, the per-client state its
step reads or changes (``step_state``), and the client lr of every client at every step (``client_lr`` of its own
local epoch). Each stacked step is ``ClientStep``'s (the
method's one-client ``local_loss`` or ``client_direction`` mapped, per-client clip, SGD); clients that differ in
step count or batch sizes step under a step mask (``fedrcl.contract.step_mask``), a finished client keeping its
weights, momenta and step state exactly. ``finish`` hands each client's weights, step state and summed loss back to
its run, in order.

``StackedClients`` runs the engine inside ``fedrcl fit``'s Lightning loop: one stacked step per Lightning step
(each Lightning hook per step runs as for any step); Lightning's own optimizer step then has nothing to move, as
its parameter group holds one empty tensor while the round's clients are stacked.

What would silently differ from clients trained one after another is refused in the run's first stacked round,
in one line, before any step: an attribute that ``on_client_start`` sets differently per client without naming it
in ``client_tensors`` (every client would see the last client's), a loss that stores something on the algorithm,
and a loss that cannot run mapped (e.g. branching on a client fact).
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
from fedrcl.federated.client_step import ClientStep, State, StepInputs
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
        names, stateful = tuple(first.client_tensors), tuple(first.step_state)
        if laid is None:  # start every client and read what its start set
            tensors, states = self._start(names, stateful, check)
            self.client_tensors = {name: torch.stack(values) for name, values in tensors.items()}
            self.state: State = {name: {k: torch.stack([v[k] for v in each]) for k in each[0]}
                                 if isinstance(each[0], dict) else torch.stack(each) for name, each in states.items()}
        else:  # rounds whose clients were started and laid already, joined (``from_laid``)
            self.client_tensors = {name: torch.cat([r.client_tensors[name] for r in laid]) for name in names}
            self.state = {name: {k: torch.cat([r.state[name][k] for r in laid]) for k in value}
                          if isinstance(value, dict) else torch.cat([r.state[name] for r in laid])
                          for name, value in laid[0].state.items()}
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

    def _start(self, names: tuple[str, ...], stateful: tuple[str, ...], check: bool
               ) -> tuple[dict[str, list[Tensor]], dict[str, list[Any]]]:
        """Start every client in order and read, after each start, the tensors its method names per client
        (``client_tensors``) and its step state; in the run's first stacked round, refuse an attribute that a start
        sets differently per client without naming it."""
        tensors: dict[str, list[Tensor]] = {name: [] for name in names}
        states: dict[str, list[Any]] = {name: [] for name in stateful}
        for member, clients in zip(self.members, self.runs):
            views = []
            for client in clients:
                client.start()
                for name, values in tensors.items():
                    values.append(getattr(member.module, name))
                for name, each in states.items():
                    each.append(getattr(member.module, name))
                if check:
                    views.append(client_view(member.module, PER_CLIENT | set(names) | set(stateful)))
            if check:
                refuse_per_client_attributes(member.module, views)
        return tensors, states

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
        inputs = StepInputs(x, y, self.lr[t], self.client_tensors, self.facts, self.global_state, self.weights,
                            self.state)
        module = self.members[0].module
        before = dict(vars(module)) if self._check else None
        try:
            with torch.autocast(self.device.type, enabled=False):  # the forward's dtype is the engine's (``MIXED``)
                if full:
                    self.params, self.momenta, losses, parts, self.state = self.engine(self.params, self.momenta,
                                                                                       inputs)
                    positions: Optional[Tensor] = None
                else:
                    assert mask is not None
                    self.params, self.momenta, losses, parts, self.state, positions = self.engine.masked(
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
        """Federation ``s``'s clients, in order: each one's weights into its backbone and its step state onto its
        algorithm, its run ended with its own summed loss, and ``fold``-ed."""
        module = self.members[s].module
        own = dict(module.backbone.named_parameters())
        for i, client in enumerate(self.runs[s]):
            n = s * self.clients + i
            for name, stacked in self.params.items():
                own[name].copy_(stacked[n])
            for name, value in self.state.items():
                setattr(module, name, {k: t[n] for k, t in value.items()} if isinstance(value, dict) else value[n])
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
