"""Secure aggregation on Flower: a round's sum through Flower's SecAgg+ protocol, so the server sees no node's update.

With the run config's ``secure-aggregation.enabled`` true (``SecureAggregation.from_run_config``), each round's
nodes run Flower's own client half, ``flwr.client.mod.secaggplus_mod`` (``secure_aggregation_mod`` hands it the
protocol's messages), and the server drives the protocol's four stages itself (``SecAggPlusRound``), with
Flower's primitives (Shamir shares, ECDH keys, the masks' generator, its quantisation):

1. *setup*: every node of the round gets the protocol's settings and answers with two public keys;
2. *share keys*: each node gets its neighbours' keys and answers with its secrets' shares, encrypted for them;
3. *collect masked vectors*: each node gets the shares meant for it and the round's ``train`` content; it
   trains its clients, and answers with its weighted mean update ``v`` and weight ``w`` as one masked integer
   vector (``[q(w), q(w v)]`` plus pairwise and private masks, modulo ``modulus-range``), nothing else of it;
4. *unmask*: the nodes still there send the shares that remove the masks (a node's private seed; a dropped
   node's key, for the pairwise masks its neighbours added): the server gets ``sum q(w v)`` and ``sum q(w)``,
   hence the weighted mean update, and nothing per node.

Why not ``flwr.server.workflow.SecAggPlusWorkflow`` itself: it drives a legacy ``Strategy`` (``configure_fit``,
``aggregate_fit`` with ``ClientProxy`` and ``FitRes``) through a ``LegacyContext``, while fedrcl's strategy is
Flower's Message-API ``Strategy`` with its own node map (``fedrcl.flower.nodes.Fleet``); and it shuffles the
neighbour ring with Python's global ``random``, and counts a node dropped before sharing keys among the dead,
whose key shares nobody holds. The client half is Flower's, unchanged, so the wire protocol is Flower's.

What the sum can carry decides what may use it (``refusal``): the weighted mean of the clients' weights, with
sample counts (fedrcl's FedAvg weighting) or uniform weights (DP-FedAvg). So any client method and server
optimizer whose server half needs only that mean: FedAvg, FedProx, FedRCL, MOON, FedSAM, ... with FedAvg,
FedAvgM, FedAdam, FedYogi, FedAdagrad, FedACG. A method that uploads or receives per-client values
(``receive_upload``: SCAFFOLD, FedDyn, FedNova, FedProc) is refused before training, named. DP-FedAvg combines
as distributed DP (``fedrcl.privacy.DPFedAvg``, fixed clipping): each client clips its update on its node and
adds ``N(0, (z C)^2 / m)``, so that the sum carries the central mechanism's noise; adaptive clipping is refused
(its unclipped count would need a second, noised secure sum).

Precision: each coordinate of ``w v`` (``w <= 1``: the weight over the round's largest) is clipped to
``[-clipping-range, clipping-range]`` and stochastically rounded to ``quantization-range`` levels; the mean's
error is at most ``error_bound`` per coordinate. A node whose update leaves the clipping range fails, named
(Flower would clip it silently).
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from fedrcl.flower.nodes import LOST, ClientFailure

PREFIX = "secure-aggregation."  # the Flower run config's keys of the switch
SAMPLE_STREAM = 54  # the neighbour ring's shuffle: apart from client sampling's and DP noise's streams


class SecureAggregationError(ValueError):
    """A ``secure-aggregation.*`` setting or a run it cannot serve; the message names the key or the method."""


class SecureAggregation:
    """Flower's SecAgg+ for every round of a run (see the module docstring); the run config's
    ``secure-aggregation.<key>`` with ``-`` for ``_`` (``secure-aggregation.num-shares = 3``), on with
    ``secure-aggregation.enabled = true``.

    Args:
        num_shares: shares each node's secrets are split into, one per neighbour (itself included): an integer
            >= 3, or a fraction in (0, 1] of the round's nodes (1.0: every node is every node's neighbour).
        reconstruction_threshold: shares that rebuild a secret: an integer >= 2 below ``num_shares``, or a
            fraction in (0, 1] of ``num_shares`` (at least 2). A round survives nodes dropping out as long as
            every node keeps this many neighbours; a server colluding with fewer nodes learns nothing per node.
        clipping_range: each coordinate of a node's weighted update is quantised within +-this (a coordinate
            outside fails the node, named: raise it).
        quantization_range: integer levels of the quantisation (Flower's default 2**22).
        modulus_range: the masks' modulus, a power of 2 above ``quantization_range`` times the round's nodes
            (Flower's default 2**32).
        timeout: seconds each of the protocol's four stages waits for the nodes; a node silent past it, or
            failing, is dropped from the round (0: the round's timeout, ``round-timeout``).
    """

    def __init__(self, num_shares: Union[int, float] = 1.0, reconstruction_threshold: Union[int, float] = 0.5,
                 clipping_range: float = 1.0, quantization_range: int = 2**22, modulus_range: int = 2**32,
                 timeout: float = 0.0):
        def bad(key: str, value: Any, allowed: str) -> SecureAggregationError:
            return SecureAggregationError(f"{PREFIX}{key.replace('_', '-')}={value!r}: {allowed}")

        if isinstance(num_shares, bool) or not isinstance(num_shares, (int, float)) or (
                isinstance(num_shares, int) and num_shares < 3) or (
                isinstance(num_shares, float) and not 0 < num_shares <= 1):
            raise bad("num_shares", num_shares, "an integer >= 3 or a fraction in (0, 1] of the round's nodes")
        t = reconstruction_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or (isinstance(t, int) and t < 2) or (
                isinstance(t, float) and not 0 < t <= 1):
            raise bad("reconstruction_threshold", t, "an integer >= 2 or a fraction in (0, 1] of num-shares")
        if isinstance(t, int) and isinstance(num_shares, int) and t >= num_shares:
            raise bad("reconstruction_threshold", t, f"must be below num-shares ({num_shares})")
        if not (isinstance(clipping_range, (int, float)) and clipping_range > 0) or isinstance(clipping_range, bool):
            raise bad("clipping_range", clipping_range, "a number > 0")
        if isinstance(quantization_range, bool) or not isinstance(quantization_range, int) or \
                not 2 <= quantization_range < 2**31:
            raise bad("quantization_range", quantization_range, "an integer in 2..2**31-1")
        if isinstance(modulus_range, bool) or not isinstance(modulus_range, int) or \
                modulus_range <= quantization_range or modulus_range & (modulus_range - 1) or modulus_range > 2**32:
            raise bad("modulus_range", modulus_range, "a power of 2 above quantization-range, at most 2**32")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise bad("timeout", timeout, "seconds >= 0 (0: the round's timeout)")
        self.num_shares, self.reconstruction_threshold = num_shares, reconstruction_threshold
        self.clipping_range, self.quantization_range = float(clipping_range), quantization_range
        self.modulus_range, self.timeout = modulus_range, timeout

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> Optional["SecureAggregation"]:
        """The run config's ``secure-aggregation.*`` settings (Flower takes a run config key only if the app's
        ``[tool.flwr.app.config]`` declares it: ``examples/flower_app/pyproject.toml`` declares them all, off);
        ``None`` (off) unless ``secure-aggregation.enabled`` is true."""
        given = {key[len(PREFIX):]: value for key, value in run_config.items() if key.startswith(PREFIX)}
        allowed = ("enabled", "num-shares", "reconstruction-threshold", "clipping-range", "quantization-range",
                   "modulus-range", "timeout")
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            raise SecureAggregationError(f"run config {PREFIX}{unknown[0]}: not a secure aggregation setting "
                                         f"(allowed: {', '.join(PREFIX + a for a in allowed)})")
        enabled = given.pop("enabled", False)
        if not isinstance(enabled, bool):
            raise SecureAggregationError(f"run config {PREFIX}enabled={enabled!r}: true or false")
        return cls(**{key.replace("-", "_"): value for key, value in given.items()}) if enabled else None

    def check_method(self, algorithm: Any, privacy: Any) -> None:
        """Refuse, before training, a method whose server half needs what a secure sum cannot give: per-client
        uploads (``receive_upload``: SCAFFOLD, FedDyn, FedNova, FedProc) or adaptive clipping's unclipped count."""
        from fedrcl.contract.exchange import ClientExchange, overrides  # torch: the server's side only

        name = type(algorithm).__name__
        for hook in ("extra_upload", "receive_upload"):
            if isinstance(algorithm, ClientExchange) and overrides(algorithm, ClientExchange, hook):
                raise SecureAggregationError(
                    f"model {name} gives its server half each client's own values ({hook}), which a secure sum "
                    f"cannot: secure aggregation ({PREFIX}*) serves methods whose server needs only the mean "
                    "weights (FedAvg, FedProx, FedRCL, MOON, ... with FedAvg, FedAvgM, FedAdam, FedYogi, FedACG)")
        if privacy is not None and getattr(privacy, "adaptive", False):
            raise SecureAggregationError(
                "trainer.privacy.init_args.adaptive true: adaptive clipping's noised unclipped count is not part "
                f"of the secure sum; with {PREFIX}* use a fixed clip_norm (distributed DP, clients add the noise)")

    def sizes(self, num_nodes: int) -> tuple[int, int]:
        """``(shares, threshold)`` for a round of ``num_nodes`` nodes (an integer setting as given; a fraction
        of the nodes, or of the shares, rounded, as Flower's workflow resolves them)."""
        return protocol_sizes(num_nodes, self.num_shares, self.reconstruction_threshold)

    def check_run(self, clients_per_round: int) -> None:
        """Refuse, before training, settings no round of ``clients_per_round`` clients can meet."""
        if clients_per_round < 2:
            raise SecureAggregationError(f"secure aggregation needs >= 2 clients per round (on 2 nodes or more), "
                                         f"got trainer.clients_per_round {clients_per_round}")
        shares, threshold = self.sizes(clients_per_round)
        if threshold > min(shares, clients_per_round):
            raise SecureAggregationError(
                f"{PREFIX}reconstruction-threshold={self.reconstruction_threshold!r}: {threshold} shares "
                f"needed, but a round has at most {min(shares, clients_per_round)} nodes to hold them")
        if clients_per_round * self.quantization_range >= self.modulus_range:
            raise SecureAggregationError(
                f"{PREFIX}modulus-range={self.modulus_range}: the sum of {clients_per_round} quantised vectors "
                f"would wrap around; it must exceed {clients_per_round} x quantization-range")


def protocol_sizes(num_nodes: int, num_shares: Union[int, float], threshold: Union[int, float]) -> tuple[int, int]:
    """The round's ``(shares, threshold)``: a fractional ``num_shares`` is that share of ``num_nodes``, made odd
    if below it, and all of them if that leaves 2 or fewer; a fractional ``threshold`` is that share of the
    shares, at least 2."""
    if isinstance(num_shares, float):
        shares = round(num_shares * num_nodes)
        if shares < num_nodes and shares % 2 == 0:
            shares += 1
        if shares <= 2:
            shares = num_nodes
    else:
        shares = num_shares
    needed = max(round(threshold * shares), 2) if isinstance(threshold, float) else threshold
    return shares, needed


def error_bound(num_vectors: int, clipping_range: float, quantization_range: int, weight_sum: float) -> float:
    """The largest error of a secure weighted mean per coordinate, from its quantisation.

    Each of the ``num_vectors`` nodes sends ``q(dq_i v_i)``, stochastically rounded to one level of
    ``2 c / Q`` (``c``: clipping range, ``Q``: quantisation range), and its weight ``dq_i`` rounded to a
    multiple of ``1 / Q`` (error ``<= 1 / (2 Q)``); the mean is ``(sum dq_i v_i + E) / D`` with ``D = sum dq_i``
    (``weight_sum``). Rounding: ``|E| < n 2c / Q``; the weights' error moves the mean by ``sum_i eps_i (v_i -
    mean) / D``, at most ``n (1 / 2Q) 2c / D``. Hence ``< 3 n c / (Q D)``."""
    return 3.0 * num_vectors * clipping_range / (quantization_range * weight_sum)


def secure_aggregation_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """A node's ClientApp mod: Flower's ``secaggplus_mod`` for the protocol's messages (those carrying its
    settings record), every other message straight to the ClientApp (plain rounds, ``query``)."""
    if message.metadata.message_type == MessageType.TRAIN and RECORD_KEY_CONFIGS in message.content.config_records:
        return secaggplus_mod(message, context, call_next)
    return call_next(message, context)


def round_weights(weights: Sequence[float]) -> tuple[list[float], float]:
    """The nodes' weights over the largest (``max_weight``: each at most 1 in the protocol), and that largest."""
    largest = max(weights)
    return [w / largest for w in weights], float(largest)


@dataclass
class SecureSum:
    """A round's outcome: the weighted mean update (float64 arrays, the vector's order), the weight sum ``D``
    and the number of vectors summed (for ``error_bound``), each surviving node's reply (what else it sent:
    losses, status), the nodes dropped and why, and the bytes each way."""

    mean: list[np.ndarray]
    weight_sum: float
    replies: dict[int, RecordDict]
    dropped: dict[int, str]
    bytes: dict[str, int] = field(default_factory=lambda: {"down": 0, "up": 0})


class ProtocolFailure(ClientFailure):
    """A SecAgg+ round that cannot finish (a node's error, too few nodes left); the round is not aggregated."""


def content_bytes(content: RecordDict) -> int:
    """Bytes of a message's records (arrays, metrics, configs), as Flower's ``count_bytes`` counts them: keys'
    and values' lengths, 8 a number (its ``ConfigRecord.count_bytes`` fails on an empty string or list)."""
    def size(value: Any) -> int:
        if isinstance(value, list):
            return sum(size(v) for v in value)
        return len(value) if isinstance(value, (str, bytes)) else 1 if isinstance(value, bool) else 8

    configs = sum(len(k) + size(v) for r in content.config_records.values() for k, v in r.items())
    return (configs + sum(r.count_bytes() for r in content.array_records.values())
            + sum(r.count_bytes() for r in content.metric_records.values()))


class SecAggPlusRound:
    """The server's half of one SecAgg+ round over ``grid`` (see the module docstring).

    Args:
        settings: the run's ``SecureAggregation``.
        grid: Flower's grid (messages pushed and pulled directly: a node lost or silent mid-protocol is a
            dropout, never sent the stage again; a node's error stops the round, named).
        timeout: seconds each stage waits for its replies.
        group_id: the messages' group (Flower's round).
        seed: (seed, round) seed the neighbour ring's shuffle.
    """

    def __init__(self, settings: SecureAggregation, grid: Any, timeout: float, group_id: str,
                 seed: Sequence[int]):
        self.settings, self.grid, self.timeout, self.group_id = settings, grid, timeout, group_id
        self.seed = list(seed)
        self.dropped: dict[int, str] = {}
        self.bytes = {"down": 0, "up": 0}

    def _stage(self, contents: Mapping[int, RecordDict]) -> dict[int, RecordDict]:
        """Send each node its content, wait up to the timeout; the replies of the nodes that answered (the
        others are dropped, with the reason)."""
        messages = [Message(content, dst_node_id=node, message_type=MessageType.TRAIN, group_id=self.group_id)
                    for node, content in contents.items()]
        self.bytes["down"] += sum(content_bytes(m.content) for m in messages)
        ids = dict(zip(self.grid.push_messages(messages), contents))
        replies: dict[int, RecordDict] = {}
        deadline = time.monotonic() + self.timeout
        while len(replies) + len([n for n in contents if n in self.dropped]) < len(contents):
            for reply in self.grid.pull_messages([i for i, n in ids.items() if n not in replies]):
                node = ids.get(reply.metadata.reply_to_message_id)
                if node is None or node in replies or node in self.dropped:
                    continue
                if reply.has_error() and reply.error.code not in LOST:  # the node's own error: named
                    raise ProtocolFailure(f"secure aggregation: node {node} failed: {reply.error.reason}. The "
                                          "round is not aggregated.")
                if reply.has_error():  # the node went away: a dropout, which the protocol survives
                    self.dropped[node] = str(reply.error.reason)
                else:
                    replies[node] = reply.content
                    self.bytes["up"] += content_bytes(reply.content)
            if time.monotonic() > deadline:
                for node in contents:
                    if node not in replies:
                        self.dropped.setdefault(node, f"no reply within {self.timeout:.0f} s")
                break
            time.sleep(0.05)
        return replies

    def _check(self, neighbours: Mapping[int, set[int]], active: set[int], threshold: int, stage: str) -> None:
        short = sorted(n for n in active if len(neighbours[n] & active) < threshold)
        if short:
            raise ProtocolFailure(f"secure aggregation ({stage}): nodes {short} kept fewer than {threshold} "
                                  f"neighbours (dropped: {self.dropped}); the round is not aggregated")

    def aggregate(self, contents: Mapping[int, RecordDict], weights: Mapping[int, float]) -> SecureSum:
        """Run the four stages for the nodes of ``contents`` (each node's ``train`` content); ``weights``:
        each node's aggregation weight (the largest is sent as ``max_weight``)."""
        nodes = sorted(contents)
        if len(nodes) < 2:
            raise ProtocolFailure(f"secure aggregation needs the round's clients on >= 2 nodes, got nodes {nodes}")
        s = self.settings
        shares, threshold = s.sizes(len(nodes))
        ring = list(nodes)
        random.Random(f"{self.seed}/{SAMPLE_STREAM}").shuffle(ring)
        half = shares // 2 if shares < len(ring) else len(ring)
        neighbours = {n: {ring[(i + o) % len(ring)] for o in range(-half, half + 1)} for i, n in enumerate(ring)}
        _, max_weight = round_weights([weights[n] for n in nodes])
        # 1. setup: the settings; each node answers with its two public keys
        setup: dict[str, Any] = dict({Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: len(nodes), Key.SHARE_NUMBER: shares,
                      Key.THRESHOLD: threshold, Key.CLIPPING_RANGE: s.clipping_range,
                      Key.TARGET_RANGE: s.quantization_range, Key.MOD_RANGE: s.modulus_range,
                      Key.MAX_WEIGHT: max_weight})  # a record per node: the mod takes the stage out of it
        answers = self._stage({n: RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(setup)}) for n in nodes})
        keys: dict[int, tuple[bytes, bytes]] = {n: (field_of(r, Key.PUBLIC_KEY_1), field_of(r, Key.PUBLIC_KEY_2))
                                                for n, r in answers.items()}
        active = set(keys)
        self._check(neighbours, active, threshold, "setup")
        # 2. share keys: each node gets its neighbours' keys, answers with its shares encrypted for each
        offers = {}
        for n in sorted(active):
            record = ConfigRecord({str(m): [*keys[m]] for m in neighbours[n] & active})
            record[Key.STAGE] = Stage.SHARE_KEYS
            offers[n] = RecordDict({RECORD_KEY_CONFIGS: record})
        shared = self._stage(offers)
        keyed = set(shared)  # these nodes' pairwise masks are in their neighbours' vectors from now on
        self._check(neighbours, keyed, threshold, "share keys")
        forward: dict[int, tuple[list[bytes], list[int]]] = {n: ([], []) for n in keyed}
        for src in sorted(keyed):
            texts = field_of(shared[src], Key.CIPHERTEXT_LIST)
            for dst, text in zip(field_of(shared[src], Key.DESTINATION_LIST), texts):
                if dst in forward:
                    forward[dst][0].append(text)
                    forward[dst][1].append(src)
        # 3. collect masked vectors: the round's train content and the shares for the node
        tasks = {}
        for n in sorted(keyed):
            content = RecordDict({**contents[n].array_records, **contents[n].config_records})
            content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord({
                Key.STAGE: Stage.COLLECT_MASKED_VECTORS, Key.CIPHERTEXT_LIST: forward[n][0],
                Key.SOURCE_LIST: forward[n][1]})
            tasks[n] = content
        masked = self._stage(tasks)
        summed = set(masked)
        self._check(neighbours, summed, threshold, "collect masked vectors")
        total: Optional[list[np.ndarray]] = None
        for n in sorted(summed):
            vector = [bytes_to_ndarray(b) for b in field_of(masked[n], Key.MASKED_PARAMETERS)]
            total = vector if total is None else [a + b for a, b in zip(total, vector)]
        assert total is not None
        # 4. unmask: shares of the survivors' private seeds and of the dropped nodes' first keys
        dead = keyed - summed
        asks = {n: RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({
            Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: sorted(neighbours[n] & summed),
            Key.DEAD_NODE_ID_LIST: sorted(neighbours[n] & dead)})}) for n in sorted(summed)}
        collected: dict[int, list[bytes]] = {n: [] for n in summed | dead}
        for reply in self._stage(asks).values():
            for owner, share in zip(field_of(reply, Key.NODE_ID_LIST), field_of(reply, Key.SHARE_LIST)):
                if owner in collected:
                    collected[owner].append(share)
        short = sorted(n for n, got in collected.items() if len(got) < threshold)
        if short:
            raise ProtocolFailure(f"secure aggregation (unmask): fewer than {threshold} shares of nodes {short} came "
                                  f"back (dropped: {self.dropped}); the round is not aggregated")
        shapes = [a.shape for a in total]
        modulus = s.modulus_range
        for n in sorted(summed):  # the node's private mask
            total = [a - b for a, b in zip(total, pseudo_rand_gen(combine_shares(collected[n]), modulus, shapes))]
        for n in sorted(dead):  # the pairwise masks its neighbours added with it: n > m added, n < m subtracted
            secret = bytes_to_private_key(combine_shares(collected[n]))
            for m in sorted(neighbours[n] & summed):
                mask = pseudo_rand_gen(generate_shared_key(secret, bytes_to_public_key(keys[m][0])), modulus, shapes)
                total = [a + b if n > m else a - b for a, b in zip(total, mask)]
        total = [a & (modulus - 1) for a in total]
        weight_sum = float(total[0][0]) / s.quantization_range
        values = dequantize(total[1:], s.clipping_range, s.quantization_range)
        offset = -(len(summed) - 1) * s.clipping_range  # each vector was shifted by +c before quantisation
        mean = [(v + offset) / weight_sum for v in values]
        return SecureSum(mean, weight_sum, {n: masked[n] for n in summed}, dict(self.dropped), dict(self.bytes))


def field_of(content: RecordDict, key: str) -> Any:
    """A value of a node's SecAgg+ reply (its ``secaggplus_configs`` record: keys, shares, masked vectors)."""
    return content.config_records[RECORD_KEY_CONFIGS][key]


def check_range(vector: Sequence[np.ndarray], names: Sequence[str], clipping_range: float) -> None:
    """Refuse a node's weighted update with a coordinate outside ``+-clipping_range`` (Flower's quantisation
    would clip it silently), naming the tensor."""
    for name, values in zip(names, vector):
        largest = float(np.max(np.abs(values))) if values.size else 0.0
        if not math.isfinite(largest) or largest > clipping_range:
            raise SecureAggregationError(
                f"the node's update of {name} reaches {largest:.4g}, outside {PREFIX}clipping-range "
                f"{clipping_range:g}: raise it (each coordinate of a node's weighted mean update is quantised "
                "within it)")
