"""Batched clients: a round's clients (of this process) trained at once, on a leading client axis.

All clients of a round start from the same broadcast weights. Stacked K times they form one set of
parameters ``[K, ...]``; ``torch.func.vmap`` over ``torch.func.functional_call`` runs the algorithm's own
one-client loss (``FedAvg.local_loss``, written once, for one client) for every client on its own batch with
its own slice of the weights. The sum of the K losses has, in each slice, exactly that client's gradient, so
Lightning's ordinary backward and the algorithm's ordinary SGD optimizer (elementwise: lr, weight decay,
momentum) update every client at once; only the gradient-norm clip is per client (``clip_grad_norm_``).
One Lightning step is one local step of every client; batches come stacked from
``FederatedDataModule.stacked_client_batches`` (each client's from its own (seed, round, client) stream).

Shared by all clients, unbatched: the round's frozen global teacher, the broadcast weights (FedProx, FedACG's
client term), round facts. Per client, stacked: tensors an algorithm names in ``client_tensors`` (set by its
``on_client_start``, e.g. FedLC's label counts). A round falls back to the sequential loop, with a one-line
notice, when its clients differ in step count or batch size, when the algorithm keeps per-client models
(``unbatchable_reason``, MOON) or when the backbone has buffers (BatchNorm statistics).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Optional, get_args

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.func import functional_call, vmap

from fedrcl.federated.plan import RoundPlan
from fedrcl.federated.round import ClientResult, ClientRun

if TYPE_CHECKING:
    import fedrcl.algorithms.fedavg

Mode = Literal["auto", "on", "off"]
# torch.compile backend of the batched step; tests set a cheap one ("aot_eager") to run it on the CPU.
COMPILE_BACKEND = "inductor"


class _LocalLoss(nn.Module):
    """``algorithm.local_loss`` as a module call, so that ``functional_call`` can swap the weights it sees."""

    def __init__(self, algorithm: fedrcl.algorithms.fedavg.FedAvg):
        super().__init__()
        self.algorithm = algorithm

    def forward(self, client_tensors: dict[str, Tensor], x: Tensor, y: Tensor
                ) -> tuple[Tensor, dict[str, Tensor]]:
        algorithm = self.algorithm
        # This client's tensors, and its slice of the weights for the server's client term, set for the call
        # and put back before returning: no vmapped tensor outlives it (torch.compile needs that too).
        bound = {**client_tensors, "_params": dict(algorithm.backbone.named_parameters())}
        saved = {name: getattr(algorithm, name) for name in bound}
        for name, value in bound.items():
            setattr(algorithm, name, value)
        try:
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
        self._module: Optional[_LocalLoss] = None
        self._losses: Optional[Callable[..., tuple[Tensor, dict[str, Tensor]]]] = None
        self._low: Optional[torch.dtype] = None
        self.compile_seconds: Optional[float] = None

    def applies(self, pl_module: Any, plan: RoundPlan, datamodule: Any, device: torch.device) -> bool:
        """Whether the round of ``plan`` trains batched (a fallback is announced once per reason)."""
        if self.mode == "off" or (self.mode == "auto" and device.type != "cuda"):
            return False
        reason = getattr(pl_module, "unbatchable_reason", None)
        if reason is None and any(True for _ in pl_module.backbone.buffers()):
            reason = "the backbone has buffers (e.g. BatchNorm statistics)"
        if reason is None and len(set(plan.steps)) > 1:
            reason = "this round's clients take different numbers of steps"
        if reason is None and datamodule.local_iters_per_epoch is None and len(set(plan.num_samples)) > 1:
            reason = "this round's clients end on batches of different sizes (local_iters_per_epoch null)"
        if reason is None:
            return True
        if reason not in self._noticed:
            self._noticed.add(reason)
            rank_zero_info(f"trainer.client_batching: clients trained one after another: {reason}")
        return False

    def losses(self, pl_module: fedrcl.algorithms.fedavg.FedAvg, params: dict[str, Tensor],
               client_tensors: dict[str, Tensor], x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Every client's ``local_loss`` on its batch (``x[k]``, ``y[k]``) with its weight slices (``[k]``).

        Under Lightning's mixed precision (``bf16-mixed``, ``16-mixed``) the weights and images enter the
        mapped call in the autocast dtype: autocast does not reach inside ``vmap`` (torch 2.14, CPU checked),
        so the batched forward runs wholly in that dtype (normalisations included, which autocast keeps in
        float32); weights, gradients and optimizer stay in float32, and the losses upcast as before.
        """
        device_type = x.device.type
        low = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        if self._module is None or self._module.algorithm is not pl_module or self._low != low:
            self._module, self._low = _LocalLoss(pl_module), low
            module = self._module

            def one_client(p: dict[str, Tensor], c: dict[str, Tensor], xb: Tensor, yb: Tensor
                           ) -> tuple[Tensor, dict[str, Tensor]]:
                if low is not None:
                    p, xb = {name: w.to(low) for name, w in p.items()}, xb.to(low)
                return functional_call(module, p, (c, xb, yb))

            self._losses = vmap(one_client, randomness="error")
            if self.compile:
                cuda = x.device.type == "cuda"
                graphs = cuda and COMPILE_BACKEND == "inductor"
                self._losses = torch.compile(self._losses, backend=COMPILE_BACKEND,
                                             mode="reduce-overhead" if graphs else None)
        prefixed = {f"algorithm.backbone.{name}": p for name, p in params.items()}
        first = self.compile and self.compile_seconds is None
        start = time.perf_counter()
        assert self._losses is not None  # built above
        out = self._losses(prefixed, client_tensors, x, y)
        if first:  # the first call compiles (a one-off host sync to time it)
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            self.compile_seconds = time.perf_counter() - start
            rank_zero_info(f"trainer.compile_clients: the first batched step (compiling) took "
                           f"{self.compile_seconds:.1f} s")
        return out


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
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads])  # [P, K]
    coef = (max_norm / (torch.linalg.vector_norm(norms, dim=0) + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))).to(g.dtype))


class StackedClients:
    """One round's clients as one set of stacked weights, plugged into the algorithm's optimizer.

    Created at the round's first step: starts every client's run (``ClientRun.start``: the broadcast weights,
    the extras, ``on_client_start``; the tensors the algorithm names in ``client_tensors`` are stacked),
    stacks the broadcast weights and points the optimizer's parameter group at them (its state cleared: every
    client's optimizer starts fresh), and hands itself to the algorithm (``algorithm.stack``). ``finish`` puts
    the module's parameters back and, for each client in turn, loads its weights into the backbone and ends
    its run, in client order as the sequential loop does.
    """

    def __init__(self, trainer: Any, pl_module: Any, runs: list[ClientRun], batching: ClientBatching):
        self.pl_module, self.batching, self.runs = pl_module, batching, runs
        per_client: dict[str, list[Tensor]] = {name: [] for name in getattr(pl_module, "client_tensors", ())}
        for run in runs:
            run.start()
            for name, values in per_client.items():
                values.append(getattr(pl_module, name))
        self.client_tensors = {name: torch.stack(values) for name, values in per_client.items()}
        sent = runs[0].downlink.sent
        self.params = {name: stack_clients(sent[name].detach(), len(runs)).requires_grad_()
                       for name, _ in pl_module.backbone.named_parameters()}
        (self.optimizer,) = trainer.optimizers
        (group,) = self.optimizer.param_groups
        self._module_params, group["params"] = group["params"], list(self.params.values())
        self.optimizer.state.clear()
        pl_module.stack = self

    def __len__(self) -> int:
        return len(self.runs)

    def losses(self, x: Tensor, y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-client losses ``[K]`` and loss parts (each ``[K]``) of one stacked batch."""
        return self.batching.losses(self.pl_module, self.params, self.client_tensors, x, y)

    def clip_grad_norm_(self, max_norm: float) -> None:
        clip_grad_norm_([p.grad for p in self.params.values() if p.grad is not None], max_norm)

    @torch.no_grad()
    def finish(self, loss_sum: Optional[Tensor], fold: Callable[[ClientRun, ClientResult], None]) -> None:
        """Restore the optimizer; for each client in turn load its weights into the backbone, end its run
        (``loss_sum``: the stack's summed losses, checked with each client) and ``fold`` it."""
        self.optimizer.param_groups[0]["params"] = self._module_params
        self.optimizer.state.clear()
        self.pl_module.stack = None
        module_params = dict(self.pl_module.backbone.named_parameters())
        for i, run in enumerate(self.runs):
            for name, stacked in self.params.items():
                module_params[name].copy_(stacked[i])
            fold(run, run.end(loss_sum))
