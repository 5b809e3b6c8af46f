"""The tutorial's own methods, written outside the fedrcl package (``docs/tutorial.md``).

    PYTHONPATH=docs/tutorial fedrcl fit --config configs/quickstart.yaml --model my_method.MyMethod

- ``MyMethod``: FedProx's proximal term on the classifier only, ``CE + mu/2 ||w_head - w_head_global||^2``.
- ``MyStatefulMethod``: also pulls each client's classifier towards the one it trained last time it took
  part (per-client state, ``PersistentClientState``).
- ``MyMethodWithCounts``: also uploads the client's label counts (counted in the byte ledger), which its
  server half adds up.
- ``MySharpMethod``: FedAvg with a sharpness-aware step (SAM), written with ``client_direction``.
- ``ServerLR``: a server learning rate, ``w <- w + eta * delta`` (a server optimizer of one's own).
- ``MyLeakyMethod``: a mistake that ``fedrcl check`` finds: one client hands a number to the next.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fedrcl.algorithms import FedAvg
from fedrcl.algorithms.client_memory import PersistentClientState
from fedrcl.contract.context import ClientContext
from fedrcl.losses.proximal import squared_distance
from fedrcl.models.output import ModelOutput
from fedrcl.server.base import ServerOptimizer, State, round_update


class MyMethod(FedAvg):
    """Cross-entropy plus a proximal term towards the round's global weights, on the classifier only.

    Args:
        mu: weight of the proximal term (mu/2 * squared distance); must be >= 0.
        head: prefix of the parameter names the term covers (the backbones' classifier is ``fc``).
    """

    def __init__(self, mu: float = 0.01, head: str = "fc.", **kwargs: Any):
        super().__init__(**kwargs)
        if mu < 0:
            raise ValueError(f"model.mu must be >= 0, got {mu}")
        self.head_names = [name for name, _ in self.backbone.named_parameters() if name.startswith(head)]
        if not self.head_names:
            raise ValueError(f"model.head: no parameter of the backbone starts with {head!r}")
        self.mu = mu

    def head_parameters(self) -> list[Tensor]:
        """The classifier's parameters (inside a batched round: the mapped client's slice)."""
        params = dict(self.backbone.named_parameters())
        return [params[name] for name in self.head_names]

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        assert self.client is not None, "a client's run (on_client_start sets self.client)"
        ce = F.cross_entropy(out.logits, y)
        broadcast = [self.client.global_state[name] for name in self.head_names]  # the round's classifier
        prox = squared_distance(self.head_parameters(), broadcast)
        return ce + self.mu / 2 * prox, {"ce": ce, "prox": prox}


class MyStatefulMethod(PersistentClientState, MyMethod):
    """``MyMethod`` plus ``nu/2 ||w_head - w_head_previous||^2``, towards the classifier this client trained
    when it last took part (at its first participation: the broadcast classifier).

    The previous classifier is per-client state, kept by ``PersistentClientState`` (as SCAFFOLD's control
    variates): one safetensors file per client, the files' manifest in the checkpoint.

    Args:
        nu: weight of the term towards the client's previous classifier; must be >= 0.
    """

    def __init__(self, nu: float = 0.01, **kwargs: Any):
        super().__init__(**kwargs)
        if nu < 0:
            raise ValueError(f"model.nu must be >= 0, got {nu}")
        self.nu = nu

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)  # keeps the client's context as self.client, resets the optimizer
        head = self.load_client_state(client.client_id)  # None at the client's first participation
        if head is None:
            head = {name: client.global_state[name] for name in self.head_names}
        # The client's own input to its steps: batched clients each get their own slice of it.
        client.tensors["previous_head"] = torch.cat([head[name].flatten() for name in self.head_names]).detach()

    def on_client_end(self, client: ClientContext) -> None:
        super().on_client_end(client)
        self.save_client_state(client, dict(zip(self.head_names, self.head_parameters())))

    def client_loss(self, x: Tensor, y: Tensor, out: ModelOutput) -> tuple[Tensor, dict[str, Tensor]]:
        loss, parts = super().client_loss(x, y, out)
        assert self.client is not None, "a client's run"
        head = torch.cat([p.flatten() for p in self.head_parameters()])
        own = (head - self.client.tensors["previous_head"]).pow(2).sum()
        return loss + self.nu / 2 * own, {**parts, "own": own}


class MyMethodWithCounts(MyMethod):
    """``MyMethod`` whose clients also send their label counts (one int64 per class) with their weights; the
    server half adds them up: ``labels_trained[c]`` is how many samples of class ``c`` the sampled clients
    held, summed over the rounds so far."""

    labels_trained: Optional[Tensor] = None

    def extra_upload(self, client: ClientContext) -> dict[str, Tensor]:
        """On the client, after its last step: what it sends besides its weights."""
        assert client.data is not None, "the round hands a training client its own data"
        return {"class_counts": torch.bincount(client.data.labels, minlength=client.data.num_classes)}

    def receive_upload(self, client: ClientContext, upload: Mapping[str, Tensor]) -> None:
        """On the server, in the round's sampled order: the receiving end of ``extra_upload``."""
        counts = upload["class_counts"]
        self.labels_trained = counts if self.labels_trained is None else self.labels_trained + counts


class MySharpMethod(FedAvg):
    """FedAvg stepping along the gradient at the sharpness-aware point ``w + rho g / ||g||`` (SAM, Foret et
    al., ICLR 2021; in FL, FedSAM): the step changes, the loss does not. ``g`` is the loss's gradient at ``w``;
    the engine clips the returned direction, adds weight decay and steps by the client lr."""

    def __init__(self, rho: float = 0.05, **kwargs: Any):
        super().__init__(**kwargs)
        self.rho = rho

    def client_direction(self, params: dict[str, Tensor], x: Tensor, y: Tensor
                         ) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]:
        g, loss, parts = self.loss_gradient(params, x, y)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in g.values()]))
        ascent = {name: p + self.rho * g[name] / (norm + 1e-12) for name, p in params.items()}
        sharp, _, _ = self.loss_gradient(ascent, x, y)
        return sharp, loss, parts


class MyLeakyMethod(MyMethod):
    """A mistake to learn from: ``MyMethod`` whose ``mu`` grows with the classifier norm of the client that
    trained before it in the round, handed over through the algorithm object. Clients one after another in one
    process see it; batched clients (all started before any ends), other processes and Flower's nodes do not,
    and no real federation could: ``fedrcl check`` says it differs."""

    carried = 0.0  # the last client's classifier norm

    def on_client_start(self, client: ClientContext) -> None:
        super().on_client_start(client)
        self.mu = 0.01 * (1 + self.carried)

    def on_client_end(self, client: ClientContext) -> None:
        super().on_client_end(client)
        self.carried = float(torch.cat([p.detach().flatten() for p in self.head_parameters()]).norm())


class ServerLR(ServerOptimizer):
    """A server learning rate: ``w <- w + eta * delta``, with ``delta`` the clients' mean minus what was sent.

    ``eta = 1`` is FedAvg; the server keeps no memory, so it needs no ``state_dict``.

    Args:
        eta: server learning rate; must be > 0.
    """

    def __init__(self, eta: float = 1.0):
        if not eta > 0:
            raise ValueError(f"trainer.server.init_args.eta must be > 0, got {eta}")
        self.eta = eta

    def step(self, global_state: State, sent: Mapping[str, Tensor], client_mean: Mapping[str, Tensor]) -> State:
        delta = round_update(sent, client_mean)  # floating-point entries only
        return {k: v + self.eta * delta[k] if k in delta else v for k, v in global_state.items()}
