"""One local step of many clients as one pure function: forward, loss, backward, clip and SGD.

``fedrcl seeds --together`` (``fedrcl.federated.together``) trains several federations' clients at once: the
weights of ``S`` seeds x ``C`` clients lie on one leading axis ``[S * C, ...]``. ``ClientStep`` maps the
algorithm's own one-client ``local_loss`` (written once, for one client) over that axis with two nested
``vmap``: the outer over seeds (what one seed's clients share: the weights the server sent them, which the
server's client term reads, ``client.global_state``), the inner over a seed's clients (each client's weights,
its ``client.tensors`` and its facts, as in ``fedrcl.federated.batched``, and its federation's values of the
method's ``SWEEPABLE`` loss weights, so that a sweep's settings of ``mu`` train on one axis). The gradient of the summed losses
gives each client its own (``torch.func.grad`` when compiled); each client's gradient is clipped to its own
norm; the update is ``torch.optim.SGD``'s (weight decay, momentum without dampening, each client at its own
lr), written out so that the whole step is one function of tensors: ``torch.compile(fullgraph=True)`` makes it
one graph, with nothing that waits for the device inside it.

A method whose step replaces one of its client's tensors (``client_direction``: FedSMOO's duals) gets each
client's replacement back from its slice, on the same axis, for the client's next step and its end.

Clients that differ in step count or batch sizes take ``masked``: the step of a round under a step mask
(``fedrcl.contract.step_mask``), where only some clients step, grouped by batch size; it runs eagerly (its
groups change shape from step to step), and a client that has finished keeps its weights and momenta exactly.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.func import functional_call, grad, vmap

from fedrcl.algorithms.fedavg import changes_step
from fedrcl.federated.batched import LocalLoss, clip_coefficients
from fedrcl.contract.step_mask import RoundMask, joined, keep, scattered, split_groups

if TYPE_CHECKING:
    import fedrcl.algorithms.fedavg

Tensors = dict[str, Tensor]
# The clients' ``client.tensors`` by name: each a tensor or a dict of tensors, ``[S * C, ...]``
ClientTensors = dict[str, Any]


def map_tensors(f: Callable[..., Tensor], tensors: ClientTensors, *others: ClientTensors) -> ClientTensors:
    """``f`` applied to every tensor of ``tensors`` (and the same tensor of each of ``others``)."""
    return {name: {k: f(t, *(o[name][k] for o in others)) for k, t in value.items()} if isinstance(value, dict)
            else f(value, *(o[name] for o in others)) for name, value in tensors.items()}


def sgd_update(params: Tensors, grads: Tensors, momenta: Tensors, lr: Tensor, momentum: float,
               weight_decay: float) -> tuple[Tensors, Tensors]:
    """``torch.optim.SGD``'s step (no dampening, no Nesterov) for stacked clients: ``lr[n]`` is client ``n``'s.

    ``d = g + weight_decay * p``; with momentum ``b = momentum * b + d`` (``b`` starts at zero, so the first
    step's ``b`` is ``d``, as SGD's first step clones it) and ``d = b``; ``p = p - lr * d``. Returns the new
    weights and momenta (the momenta unchanged without momentum). The weight decay and the update are one fused
    pass each over the weights, as in SGD's own (``add`` with ``alpha``, ``addcmul``)."""
    new_params, new_momenta = {}, dict(momenta)
    for name, p in params.items():
        d = grads[name] if weight_decay == 0 else torch.add(grads[name], p, alpha=weight_decay)
        if momentum != 0:
            d = new_momenta[name] = momentum * momenta[name] + d  # in the momenta's layout: no recompile
        new_params[name] = torch.addcmul(p, lr.view(-1, *([1] * (p.dim() - 1))).to(p.dtype), d, value=-1)
    return new_params, new_momenta


def clipped(grads: Tensors, max_norm: float) -> Tensors:
    """Each client's gradient (slice ``n`` of every tensor) scaled to 2-norm at most ``max_norm``, with
    ``torch.nn.utils.clip_grad_norm_``'s coefficient ``min(1, max_norm / (norm + 1e-6))``."""
    coef = clip_coefficients(list(grads.values()), max_norm)
    return {name: g * coef.view(-1, *([1] * (g.dim() - 1))).to(g.dtype) for name, g in grads.items()}


def leaf_gradients(total: Tensor, leaves: Tensors) -> Tensors:
    """The gradient of ``total`` for each of ``leaves``, by backward into their ``.grad``: in each leaf's own
    layout (``torch.autograd.grad`` gives a mapped linear layer's weight gradient transposed, and the clip and the
    update then took about 1.47 s per profiled round on the CPU against 0.53 s, ``bench/profile_round.py
    --batching on``)."""
    total.backward()
    missing = [name for name, leaf in leaves.items() if leaf.grad is None]
    if missing:
        raise RuntimeError(f"the clients' loss does not depend on {', '.join(missing)}")
    return {name: leaf.grad for name, leaf in leaves.items() if leaf.grad is not None}


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One step's tensors: ``x``, ``y`` ``[S * C, B, ...]``; ``lr`` ``[S * C]`` (each client's federation's
    schedule); ``tensors`` (each client's ``client.tensors``) and ``facts`` ``[S * C, ...]``; ``global_state``
    ``[S, ...]`` (each federation's broadcast weights); ``weights`` ``[S * C]`` by name: each client's
    federation's value of each of the method's ``SWEEPABLE`` loss weights, set on the algorithm for its slice's
    loss."""

    x: Tensor
    y: Tensor
    lr: Tensor
    tensors: ClientTensors
    facts: Tensors
    global_state: Tensors
    weights: Tensors = dataclasses.field(default_factory=dict)


class ClientStep:
    """The local step of ``seeds`` x ``clients`` clients of ``algorithm``'s method (see the module docstring).

    Args:
        algorithm: one of the federations' client algorithms: its ``local_loss`` is the code mapped; what a
            loss reads of it per seed or per client is replaced in each slice (``self.client``, with its
            ``tensors``, and the weights).
        seeds, clients: the shape of the client axis.
        low: the dtype the mapped forward runs in under mixed precision (as batched clients), or ``None``.
        compile: ``None``, or the ``torch.compile`` keyword arguments (``fullgraph=True`` is always set).
    """

    def __init__(self, algorithm: fedrcl.algorithms.fedavg.FedAvg, seeds: int, clients: int,
                 low: Optional[torch.dtype] = None, compile: Optional[dict[str, Any]] = None):
        self.algorithm, self.seeds, self.clients, self.low = algorithm, seeds, clients, low
        self.momentum, self.weight_decay = float(algorithm.momentum), float(algorithm.weight_decay)
        self.max_norm = algorithm.grad_clip_norm
        self._module = LocalLoss(algorithm)
        self.compiled = compile is not None
        self.compile_seconds: Optional[float] = None
        step: Callable[..., Any] = self._step
        # static shapes: a later shape (another batch size, another run in the process) compiles its own graph
        # instead of a dynamic one, which vmap over convolutions cannot trace
        self.step = torch.compile(step, fullgraph=True, dynamic=False, **compile) if compile is not None else step

    def __call__(self, params: Tensors, momenta: Tensors, inputs: StepInputs
                 ) -> tuple[Tensors, Tensors, Tensor, Tensors, ClientTensors]:
        """New weights and momenta, each client's loss ``[S * C]`` and loss parts (each ``[S * C]``), and the
        clients' tensors as the step left them. The first
        compiled call compiles: its seconds are kept (``compile_seconds``) and told, a one-off host sync."""
        first = self.compiled and self.compile_seconds is None
        start = time.perf_counter()
        out = self.step(params, momenta, inputs)
        if first:
            if inputs.x.device.type == "cuda":
                torch.cuda.synchronize(inputs.x.device)
            self.compile_seconds = time.perf_counter() - start
            rank_zero_info(f"trainer.compile_clients: the first stacked step (compiling) took "
                           f"{self.compile_seconds:.1f} s")
        return cast(tuple[Tensors, Tensors, Tensor, Tensors, ClientTensors], out)

    def _one_client(self, direction: bool) -> Callable[..., Any]:
        """One client's ``local_loss`` (or ``client_direction``) at its weights, tensors, loss weights, facts, batch
        and its federation's broadcast weights: the function the engines map."""
        module, low = self._module, self.low

        def one_client(p: Tensors, tensors: ClientTensors, weights: Tensors, facts: Tensors, xb: Tensor, yb: Tensor,
                       sent: Tensors) -> Any:
            dtypes = {name.removeprefix("algorithm.backbone."): w.dtype for name, w in p.items()}
            if low is not None:
                p, xb = {name: w.to(low) for name, w in p.items()}, xb.to(low)
                weights = {name: w.to(low) for name, w in weights.items()}
            if not direction:
                return functional_call(module, p, (tensors, weights, facts, xb, yb, sent))
            d, loss, parts, new = functional_call(module, p, (tensors, weights, facts, xb, yb, sent),
                                                  {"direction": True})
            return ({name: g.to(dtypes[name]) for name, g in d.items()}, loss, parts,
                    map_tensors(lambda t, old: t.to(old.dtype), new, {name: tensors[name] for name in new}))

        return one_client

    def _mapped(self, params: Tensors, inputs: StepInputs, direction: bool = False) -> Any:
        """Every client's ``local_loss`` (losses ``[S, C]``, parts), or with ``direction`` its ``client_direction``
        (directions ``[S, C, ...]`` in the weights' dtype, by the backbone's names; losses; parts; the clients'
        tensors its step replaced)."""
        s, c = self.seeds, self.clients
        one_client = self._one_client(direction)

        def per_seed(*args: Any) -> Any:
            return vmap(one_client, in_dims=(0, 0, 0, 0, 0, 0, None))(*args)

        split = lambda t: t.unflatten(0, (s, c))  # noqa: E731  [S * C, ...] -> [S, C, ...]
        prefixed = {f"algorithm.backbone.{name}": split(p) for name, p in params.items()}
        return vmap(per_seed, randomness="error")(
            prefixed, map_tensors(split, inputs.tensors), {k: split(t) for k, t in inputs.weights.items()},
            {k: split(t) for k, t in inputs.facts.items()}, split(inputs.x), split(inputs.y), inputs.global_state)

    def _losses(self, params: Tensors, inputs: StepInputs) -> tuple[Tensor, tuple[Tensor, Tensors]]:
        losses, parts = self._mapped(params, inputs)
        losses, parts = losses.flatten(), {k: v.flatten() for k, v in parts.items()}
        return losses.sum(), (losses.detach(), {k: v.detach() for k, v in parts.items()})

    def _gradients(self, params: Tensors, inputs: StepInputs) -> tuple[Tensors, tuple[Tensor, Tensors], ClientTensors]:
        """Each client's step direction, the losses and the clients' tensors. A method with its own
        ``client_direction``: that, mapped (the tensors as it left them; otherwise unchanged).
        Otherwise the gradient of the summed losses: ``torch.func.grad`` where the step is compiled (one graph;
        autograd would break it), autograd's backward in eager mode, which is about 1.2x faster there on the CPU
        (``ResNet18`` width 8, 5 clients x 50 images: 0.34 s against 0.41 s), into the weights' own layout
        (``leaf_gradients``)."""
        if changes_step(self.algorithm):
            d, losses, parts, new = self._mapped(params, inputs, direction=True)
            flat = lambda t: t.flatten(0, 1)  # noqa: E731  [S, C, ...] -> [S * C, ...]
            return ({k.removeprefix("algorithm.backbone."): flat(g) for k, g in d.items()},
                    (losses.flatten(), {k: v.flatten() for k, v in parts.items()}),
                    {**inputs.tensors, **map_tensors(flat, new)})
        if self.compiled:
            out: tuple[Tensors, tuple[Tensor, Tensors]] = grad(self._losses, has_aux=True)(params, inputs)
            return (*out, inputs.tensors)
        with torch.enable_grad():
            leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
            total, aux = self._losses(leaves, inputs)
        return leaf_gradients(total, leaves), aux, inputs.tensors

    def _step(self, params: Tensors, momenta: Tensors, inputs: StepInputs
              ) -> tuple[Tensors, Tensors, Tensor, Tensors, ClientTensors]:
        grads, (losses, parts), tensors = self._gradients(params, inputs)
        if self.max_norm is not None:
            grads = clipped(grads, self.max_norm)
        new_params, new_momenta = sgd_update(params, grads, momenta, inputs.lr, self.momentum, self.weight_decay)
        return new_params, new_momenta, losses, parts, tensors

    def masked(self, params: Tensors, momenta: Tensors, inputs: StepInputs, mask: RoundMask, step: int,
               seed_of: Tensor) -> tuple[Tensors, Tensors, Tensor, Tensors, ClientTensors, Tensor]:
        """Stacked step ``step`` of a round under a step mask (``fedrcl.contract.step_mask``), eager: ``inputs.x``
        and ``inputs.y`` are the stepping clients' batches concatenated group after group; each group's clients are
        mapped (one ``vmap`` over the group, each with its federation's broadcast weights: ``seed_of[n]``, the
        federation of client ``n``); the gradient reaches the stepping clients' slices alone; clip and SGD as
        ``_step``; the clients that do not step keep their weights, momenta and tensors exactly. Returns the new
        weights and momenta, the stepping clients' losses and parts (group after group), the clients' tensors and
        the stepping clients' positions."""
        groups, indices = mask.groups[step], mask.index[step]
        chunks = split_groups(inputs.x, inputs.y, groups)
        own_step = changes_step(self.algorithm)
        mapped = vmap(self._one_client(own_step), randomness="error")

        def outputs(weights: Tensors) -> list[Any]:
            outs = []
            for index, (xg, yg) in zip(indices, chunks):
                select = lambda tensors: {k: t.index_select(0, index) for k, t in tensors.items()}  # noqa: E731
                sent = {k: g.index_select(0, seed_of.index_select(0, index)) for k, g in inputs.global_state.items()}
                prefixed = {f"algorithm.backbone.{k}": w for k, w in select(weights).items()}
                outs.append(mapped(prefixed, map_tensors(lambda t: t.index_select(0, index), inputs.tensors),
                                   select(inputs.weights), select(inputs.facts), xg, yg, sent))
            return outs

        tensors = inputs.tensors
        if own_step:
            outs = outputs(params)
            grads = scattered(params, indices, [{k.removeprefix("algorithm.backbone."): g for k, g in d.items()}
                                                for d, _, _, _ in outs])
            for index, (_, _, _, new) in zip(indices, outs):  # what the stepping clients replaced, the others' kept
                mine = {name: tensors[name] for name in new}
                tensors = {**tensors, **map_tensors(lambda old, t: old.index_copy(0, index, t), mine, new)}
            outs = [out[1:3] for out in outs]
        else:
            with torch.enable_grad():
                leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
                outs = outputs(leaves)
                total = torch.stack([losses.sum() for losses, _ in outs]).sum()
            grads = leaf_gradients(total, leaves)
            outs = [(losses.detach(), {k: v.detach() for k, v in parts.items()}) for losses, parts in outs]
        if self.max_norm is not None:
            grads = clipped(grads, self.max_norm)
        new_params, new_momenta = sgd_update(params, grads, momenta, inputs.lr, self.momentum, self.weight_decay)
        stepping = mask.stepping[step]
        new_params = {name: keep(p, params[name], stepping) for name, p in new_params.items()}
        new_momenta = {name: keep(b, momenta[name], stepping) for name, b in new_momenta.items()}
        losses, parts = joined(outs)
        return new_params, new_momenta, losses, parts, tensors, torch.cat(indices)
