"""Lockstep: the rounds of several runs' fits, each with its clients batched, trained as one stacked round.

``fedrcl seeds --together`` and ``fedrcl sweep --together`` run every run as its own ``fedrcl fit`` (Lightning's fit
loop, one thread each: ``fedrcl.federated.together``) with its clients batched (``StackedClients``). Here their
rounds meet. Once every run still fitting has laid its round's clients on its own stacked axis (``join``), the laid
rounds are joined on one axis, run after run (``StackedRound.from_laid``: ``runs x clients`` long), and each local
step is taken once for all of them (``JoinedRound.step``), by the first run that steps, once every run that steps
has handed in its batches; each run reads back its own clients' losses. A run whose clients take fewer steps than another's ends its clients after its
own last step (masked in the steps after it, ``fedrcl.contract.step_mask``) and takes back their weights, tensors
and losses (``JoinedRound.hand_back``); the joined round ends when every run has, and the next one joins once every
run still fitting has laid its next round. Runs resumed at different rounds join all the same.

Nothing else crosses runs: each run's fit evaluates, logs, checkpoints, keeps its time limit and calls its
callbacks. The runs' threads take turns (``running``): one runs at a time and hands over only where it waits for the
others, keeping what of its state is the process's and not its thread's (``ProcessState``: torch's default dtype,
which Lightning's ``64-true`` sets around each step; the global random generators), so that each run sees the
process as its own ``fedrcl fit`` would. At each round's end the runs meet once more (``round_end``, called by
``Preemption``) to take one decision on a stop signal, so that every run stops after the same round, checkpointed.

The joined step runs the first run's algorithm object for every client. Before a joined round's first step, each
other run's last client's loss on its first batch (and, for a method that changes the step, its direction) is
computed with its own object and with the first run's (``check_runs``); if they differ (its clients read something
of their own run: a global teacher, class prototypes), the runs part, said in one line: each trains its rounds on
its own stacked axis from then on, in its own fit.
"""
from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor
from torch.func import functional_call

from fedrcl.algorithms.fedavg import changes_step
from fedrcl.contract.step_mask import client_rows, masked_batch, split_groups
from fedrcl.federated.batched import LocalLoss
from fedrcl.federated.client_step import ClientStep, map_tensors
from fedrcl.federated.stacked import MIXED, StackedClients, StackedRound, stacked_step

Rows = list[Optional[tuple[Tensor, Tensor]]]


class NotTogether(Exception):
    """The runs cannot train their rounds together (the reason)."""


class LockstepAborted(RuntimeError):
    """Another run failed in the middle of a joined round: this one cannot go on (the other's error is told)."""


@dataclasses.dataclass
class ProcessState:
    """What of a run's state belongs to the process, not to its thread: torch's default dtype and the global
    random generators (torch's, numpy's, Python's); kept per run while the runs' threads take turns."""

    dtype: torch.dtype
    torch_rng: Tensor
    numpy_rng: Any
    python_rng: Any

    @classmethod
    def now(cls) -> ProcessState:
        return cls(torch.get_default_dtype(), torch.get_rng_state(), np.random.get_state(), random.getstate())

    def restore(self) -> None:
        torch.set_default_dtype(self.dtype)
        torch.set_rng_state(self.torch_rng)
        np.random.set_state(self.numpy_rng)
        random.setstate(self.python_rng)


class Lockstep:
    """Where the runs' rounds meet (see the module docstring).

    Args:
        labels: each run's label, by its index (``seed 1``; ``lr=0.03 seed 1`` in a sweep).
        stop: what records a stop signal (``fedrcl.federated.preemption.StopSignal``): read at each round's end.
        say: how the parting's line is told.
    """

    def __init__(self, labels: Sequence[str], stop: Any, say: Callable[[str], None]):
        self.labels, self.stop, self.say = list(labels), stop, say
        self.fitting = set(range(len(self.labels)))  # the runs whose fits have not ended
        self.parted: Optional[str] = None  # why the runs train alone
        self._cond = threading.Condition()
        self._laid: dict[int, StackedClients] = {}  # the next joined round's runs so far, by index
        self._round: Optional[JoinedRound] = None
        self._steps: dict[tuple[int, int, int], ClientStep] = {}  # the joined steps by shape (``stacked_step``)
        self._met: dict[int, Optional[int]] = {}  # the round's end: each run's own stop signal so far
        self._decisions: list[Optional[int]] = []  # each meeting's decision
        self._aborted: Optional[str] = None

    @contextmanager
    def running(self, index: int, state: ProcessState) -> Iterator[None]:
        """Run ``index``'s fit runs inside: it takes its turn (from ``state``, the process's state its build left)
        and leaves the lockstep at its end."""
        with self._cond:
            state.restore()
            try:
                yield
            finally:
                self.leave(index)

    # -- the round ---------------------------------------------------------------------------------------
    def join(self, index: int, stack: StackedClients) -> None:
        """Run ``index`` has laid its round's clients (``stack``): wait until every run still fitting has, then
        train them in one joined round (``stack.joined``), or alone (the runs parted, or no other run fits)."""
        with self._cond:
            self._wait(lambda: self._round is None)
            if self.parted is not None:
                return
            self._laid[index] = stack
            self._form()
            self._wait(lambda: index not in self._laid)

    def leave(self, index: int) -> None:
        """Run ``index``'s fit has ended (its last round, a stop, a failure): the others no longer wait for it.
        If it ended in the middle of a joined round, that round cannot go on: every run in it fails."""
        with self._cond:
            self.fitting.discard(index)
            if self._round is not None and index in self._round.indices and not self._round.handed_back(index):
                self._abort(f"{self.labels[index]} ended in the middle of a round trained together")
            self._form()
            self._decide()
            self._cond.notify_all()

    def round_end(self, index: int, signum: Optional[int]) -> Optional[int]:
        """Run ``index``'s round has ended (``signum``: the stop signal its own fit got, if any): wait until every
        run still fitting has ended its round; returns the stop signal all of them obey (``None``: go on)."""
        with self._cond:
            meeting = len(self._decisions)
            self._met[index] = signum
            self._decide()
            self._wait(lambda: len(self._decisions) > meeting)
            return self._decisions[meeting]

    # -- under the lock --------------------------------------------------------------------------------
    def _wait(self, ready: Callable[[], bool]) -> None:
        """Hand the turn over until ``ready()`` (the process's state kept meanwhile)."""
        if not ready():
            state = ProcessState.now()
            self._cond.wait_for(lambda: ready() or self._aborted is not None)
            state.restore()
        if not ready():
            raise LockstepAborted(self._aborted)

    def _abort(self, reason: str) -> None:
        if self._aborted is None:
            self._aborted = reason
        self._cond.notify_all()

    def _form(self) -> None:
        """Once every run still fitting has laid its round: join them (two or more, of one shape), else each
        trains alone."""
        if not self._laid or not self.fitting <= set(self._laid):
            return
        indices = sorted(self._laid)
        laid = [self._laid[i] for i in indices]
        if len(laid) > 1:
            reason = differing_shape(laid)
            if reason is None:
                self._round = JoinedRound(self, indices, laid)
            else:
                self._part(reason, laid)
        self._laid = {}
        self._cond.notify_all()

    def _decide(self) -> None:
        """Once every run still fitting has ended its round: one decision on a stop signal for all."""
        if not self._met or not self.fitting <= set(self._met):
            return
        own = [signum for signum in self._met.values() if signum]
        self._decisions.append(self.stop.signum or (own[0] if own else None))
        self._met = {}
        self._cond.notify_all()

    def _part(self, reason: str, laid: Sequence[StackedClients]) -> None:
        """The runs train alone from this round on (``reason``), said once."""
        self.parted, self._round = reason, None
        for stack in laid:
            stack.joined = None
        round_idx = laid[0].runs[0][0].client.round_idx
        self.say(f"from round {round_idx + 1}: {reason}")
        self._cond.notify_all()

    def _ended(self, round_: "JoinedRound") -> None:
        if self._round is round_:
            self._round = None
        self._cond.notify_all()


def differing_shape(laid: Sequence[StackedClients]) -> Optional[str]:
    """Why rounds laid by several runs cannot be one stacked round (``None``: they can): each run's round must have
    as many clients with as many local epochs, the same method and backbone, in the same precision."""
    def shape(stack: StackedClients) -> tuple[Any, ...]:
        member = stack.members[0]
        return (stack.clients, stack.runs[0][0].client.local_epochs, type(member.module),
                str(member.trainer.precision), tuple((k, p.shape, p.dtype) for k, p in stack.params.items()))

    if len({shape(stack) for stack in laid}) > 1:
        return "the runs' rounds differ in shape (clients per round, local epochs, model or precision)"
    return None


class JoinedRound:
    """One round of several runs on one stacked axis (see the module docstring): ``indices`` are the runs' indices,
    ``laid`` their rounds, each laid on its own axis."""

    def __init__(self, lockstep: Lockstep, indices: list[int], laid: list[StackedClients]):
        self.lockstep, self.indices, self.laid = lockstep, indices, laid
        first = laid[0].members[0]
        step = stacked_step(lockstep._steps, first.module, len(laid), laid[0].clients, first.trainer)
        self.round = StackedRound.from_laid(laid, step, check=laid[0]._check)
        self.low = MIXED.get(str(first.trainer.precision))
        self._inputs: dict[int, tuple[Tensor, Tensor]] = {}  # this step's batches so far, by position
        self._taken: dict[int, tuple[Tensor, dict[str, Tensor]]] = {}  # each position's losses of its last step
        self._back: set[int] = set()  # the positions that took back their clients
        for stack in laid:
            stack.joined = self

    def handed_back(self, index: int) -> bool:
        return self.indices.index(index) in self._back

    def step(self, stack: StackedClients, x: Tensor, y: Tensor) -> Optional[tuple[Tensor, dict[str, Tensor]]]:
        """Run ``stack``'s step with its batches ``x``, ``y`` (laid out as its own stacked step takes them): the
        joined step once every run that steps here has handed in its batches, taken by the first of them (the
        same thread step after step: a compiled step's CUDA graphs are its thread's). Returns its clients' losses
        and loss parts, or ``None`` when the runs parted before this round's first step (it then steps alone)."""
        lockstep, position, t = self.lockstep, self.laid.index(stack), stack.t
        with lockstep._cond:
            self._inputs[position] = (x, y)
            due = [p for p, laid in enumerate(self.laid) if laid.num_steps > t]
            if position == due[0]:
                lockstep._wait(lambda: len(self._inputs) == len(due))
                try:
                    self._take(t, due)
                except NotTogether as reason:
                    lockstep._part(str(reason), self.laid)
                except BaseException as error:
                    lockstep._abort(f"{lockstep.labels[self.indices[position]]}: {error}")
                    raise
                lockstep._cond.notify_all()
            else:
                lockstep._cond.notify_all()  # the run that takes the step may be waiting for these batches
                lockstep._wait(lambda: position in self._taken or stack.joined is None)
            if stack.joined is None:
                return None
            taken = self._taken.pop(position)
        stack.t, stack.stepped = t + 1, stack.clients if stack.mask is None else stack.mask.count[t]
        return taken

    def _take(self, t: int, due: list[int]) -> None:
        """The joined step ``t`` (the first: after ``check_runs``); each stepping run's losses kept for it."""
        x, y = self._batch(t)
        self._inputs = {}
        if t == 0:
            check_runs(self.round, [self.lockstep.labels[i] for i in self.indices], x, y, self.low)
        losses, parts = self.round.step(x, y)
        for position in due:
            self._taken[position] = self._own(position, t, losses, parts)

    def _batch(self, t: int) -> tuple[Tensor, Tensor]:
        """Step ``t``'s batches of every run's clients laid out as the joined step takes them."""
        mask = self.round.mask
        if mask is None:  # every run's clients step alike: each run's ``[clients, B, ...]``, run after run
            inputs = [self._inputs[p] for p in range(len(self.laid))]
            return torch.cat([x for x, _ in inputs]), torch.cat([y for _, y in inputs])
        rows: Rows = []
        for position, stack in enumerate(self.laid):
            rows += own_rows(stack, t, self._inputs.get(position))
        return masked_batch(rows, mask.groups[t])

    def _own(self, position: int, t: int, losses: Tensor, parts: dict[str, Tensor]
             ) -> tuple[Tensor, dict[str, Tensor]]:
        """Run ``position``'s clients' losses and loss parts of step ``t``, copied (a CUDA graph's replay for the
        next step overwrites the step's outputs)."""
        clients, mask = self.round.clients, self.round.mask
        if mask is None or mask.full(t):
            mine = slice(position * clients, (position + 1) * clients)
            return losses[mine].clone(), {k: v[mine].clone() for k, v in parts.items()}
        order = [k for group in mask.groups[t] for k in group.positions]
        rows = torch.tensor([i for i, k in enumerate(order) if k // clients == position], device=losses.device)
        return losses.index_select(0, rows), {k: v.index_select(0, rows) for k, v in parts.items()}

    def hand_back(self, stack: StackedClients) -> None:
        """``stack``'s clients have taken their last step: their weights, tensors and summed losses back onto
        its own axis (``StackedClients.finish_round`` then ends them); the joined round ends with the last run's
        hand-back."""
        lockstep, position = self.lockstep, self.laid.index(stack)
        clients = self.round.clients
        mine = slice(position * clients, (position + 1) * clients)
        with lockstep._cond:
            stack.params = {name: value[mine].clone() for name, value in self.round.params.items()}
            stack.tensors = map_tensors(lambda value: value[mine].clone(), self.round.tensors)
            stack.loss_sums = self.round.loss_sums[mine].clone()
            stack.part_sums = {name: value[mine].clone() for name, value in self.round.part_sums.items()}
            self._back.add(position)
            if len(self._back) == len(self.laid):
                lockstep._ended(self)


def own_rows(stack: StackedRound, t: int, batches: Optional[tuple[Tensor, Tensor]]) -> Rows:
    """Each of ``stack``'s clients' batch of its step ``t`` (``None`` for a client that does not step, or every
    client once its round has no step ``t``), cut from the batches of its own stacked step."""
    if batches is None:
        return [None] * stack.clients
    x, y = batches
    mask = stack.mask
    if mask is None or mask.full(t):
        if mask is not None:  # under a mask a full step's batches come concatenated
            x, y = x.unflatten(0, (stack.clients, -1)), y.unflatten(0, (stack.clients, -1))
        return [(x[k], y[k]) for k in range(stack.clients)]
    rows: Rows = [None] * stack.clients
    for group, (xg, yg) in zip(mask.groups[t], split_groups(x, y, mask.groups[t])):
        for i, k in enumerate(group.positions):
            rows[k] = (xg[i], yg[i])
    return rows


def _differing_loss(a: tuple[Tensor, dict[str, Tensor]], b: tuple[Tensor, dict[str, Tensor]]
                    ) -> Optional[tuple[str, str, str]]:
    """Where two ``local_loss`` results (loss and parts) differ beyond kernel rounding: the name (``loss``,
    ``loss part 'ntd'``) and both values; ``None`` if they agree."""
    if a[1].keys() != b[1].keys():
        return "set of loss parts", ", ".join(a[1]), ", ".join(b[1])
    for name, x, y in [*((f"loss part {k!r}", a[1][k], b[1][k]) for k in a[1]), ("loss", a[0], b[0])]:
        if x.shape != y.shape or not torch.allclose(x, y, rtol=1e-6, atol=1e-7):
            return name, f"{float(x.float().mean()):.6g}", f"{float(y.float().mean()):.6g}"
    return None


def _differing_direction(a: dict[str, Tensor], b: dict[str, Tensor]) -> Optional[tuple[str, str, str]]:
    """Where two ``client_direction`` results differ beyond kernel rounding: ``step direction`` and both values'
    norms; ``None`` if they agree."""
    if all(torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7) for k in a):
        return None
    norm = lambda d: float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float())  # noqa: E731
                                                                  for t in d.values()])))
    return "step direction", f"norm {norm(a):.6g}", f"norm {norm(b):.6g}"


def check_runs(stacked: StackedRound, labels: list[str], x: Tensor, y: Tensor, low: Optional[torch.dtype]) -> None:
    """Before a joined round's first step (``x``, ``y``: its batches): the joined step runs every run's clients
    with the first run's algorithm object; each other run's last client's loss on its first batch (and, for a
    method that changes the step, its step direction, from its own tensors) must be the same computed by its
    own object (which holds what its clients received: a global teacher, a proximal anchor, its round), else
    ``NotTogether``."""
    members, clients = stacked.members, stacked.clients
    own_loss = members[0].module
    own_step = changes_step(own_loss)
    for s, member in enumerate(members[1:], start=1):
        n = (s + 1) * clients - 1
        params = {f"algorithm.backbone.{k}": p[n] for k, p in stacked.params.items()}
        xn, yn = (x[n], y[n]) if stacked.mask is None else client_rows(x, y, stacked.mask.groups[0], n)
        if low is not None:
            params, xn = {k: p.to(low) for k, p in params.items()}, xn.to(low)
        weights = {k: w[n] if low is None else w[n].to(low) for k, w in stacked.weights.items()}
        inputs = (map_tensors(lambda t: t[n], stacked.tensors), weights, {k: f[n] for k, f in stacked.facts.items()},
                  xn, yn,
                  {k: g[s] for k, g in stacked.global_state.items()})
        with torch.no_grad():
            mine = functional_call(LocalLoss(member.module), params, inputs)
            first = functional_call(LocalLoss(own_loss), params, inputs)
            differing = _differing_loss(mine, first)
            if differing is None and own_step:
                mine = functional_call(LocalLoss(member.module), params, inputs, {"direction": True})
                first = functional_call(LocalLoss(own_loss), params, inputs, {"direction": True})
                differing = _differing_direction(mine[0], first[0])
        if differing is not None:
            name, own, theirs = differing
            raise NotTogether(
                f"model {type(member.module).__name__}: {labels[s]}'s clients compute another {name} with their "
                f"own algorithm ({own}) than with {labels[0]}'s ({theirs}): they read something "
                "of their run (e.g. its global model as a teacher) that one stacked step cannot give each run")


class Seat:
    """Run ``index``'s place in ``lockstep``: what its fit's ``Federation`` (``Federation.lockstep``) and
    ``Preemption`` call."""

    def __init__(self, lockstep: Lockstep, index: int):
        self.lockstep, self.index = lockstep, index

    def join(self, stack: StackedClients) -> None:
        self.lockstep.join(self.index, stack)

    def round_end(self, signum: Optional[int]) -> Optional[int]:
        return self.lockstep.round_end(self.index, signum)

