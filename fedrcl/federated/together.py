"""Seeds together: one experiment's seeds as independent federations trained in one program.

``fedrcl seeds --seeds 0 1 2 --together FIT_ARGS`` builds each seed's run exactly as its ``fedrcl fit`` would
(``fedrcl.seeds.fit_args_for_seed``: its own split seed, client sampling, batches, global model, server
optimizer state, accuracy EMA, logger, checkpoints, run folder ``<name>/seed<k>``), and then trains them in
lockstep: in each round, every seed's server round begins and is configured (``ServerRound``), every seed's
clients start (``ClientRun``), and the local steps of all seeds' clients run as one step on a stacked client
axis, ``seeds x clients_per_round`` long: the stacked engine of batched clients (``fedrcl.federated.stacked``,
whose step is ``fedrcl.federated.client_step.ClientStep``: forward, the method's own one-client ``local_loss``,
backward, per-client clip and SGD in one function, compiled as one graph with ``trainer.compile_clients``). Then each seed's clients end and are folded in its own server round, its global
model is evaluated, its scalars logged and its checkpoints written as ``fedrcl fit`` writes them
(``fedrcl.federated.driven``). Seeds resumed at different rounds train side by side, each stopping at its own
last round (or ``trainer.max_time``); SIGTERM and Ctrl-C finish the round and checkpoint every seed.

Each seed's weights equal its own ``fedrcl fit`` within float rounding (``tests/test_together.py``), because
nothing crosses seeds: the mapped loss sees each slice's own weights, facts, ``client_tensors`` and its seed's
broadcast weights (``client.global_state``). One algorithm object's code serves every seed, so what a seed's
clients get from their seed beyond those (an attribute that the downlink or ``on_client_start`` sets: a global
teacher, a proximal anchor, class prototypes) must be the same in every seed. Before each round's first step,
each other seed's loss on its first batch is computed with its own algorithm object and with the first seed's;
if they differ, the seeds part: in the first round before anything is written (the seeds then train one after
another), later with every seed checkpointed after its last round, to go on alone (``--ckpt_path last``).
Clients that differ in step count or batch sizes (``data.local_iters_per_epoch: null`` with clients of different
sizes; each seed's split has its own) train stacked under a step mask (``fedrcl.contract.step_mask``): the round
has as many steps as its longest client, each client steps at its own lr (``client_lr`` of its own local epoch)
until it has finished and then keeps its weights and momenta (``ClientStep.masked``).
What cannot be stacked at all falls back before the first round, with a notice: a method that cannot train
batched (``batched.unbatchable``: per-client models, buffers, or a step of its own, ``batched.OWN_STEP``), several
devices.
"""
from __future__ import annotations

import copy
import itertools
import signal
import time
from collections.abc import Hashable, Iterator, Mapping
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.func import functional_call, vmap

from fedrcl.algorithms.fedavg import changes_step
from fedrcl.contract.exchange import check_method
from fedrcl.contract.plan import RoundPlan
from fedrcl.contract.weights import load_state_, snapshot
from fedrcl.federated.batched import LocalLoss, run_compile_options, unbatchable
from fedrcl.federated.checkpoint import NothingToResume, resume_path, run_checkpoints
from fedrcl.federated.client_step import ClientStep, map_state
from fedrcl.data.datamodule import EvalBatches
from fedrcl.federated.divergence import DivergenceError
from fedrcl.federated.driven import DrivenRun, not_run, open_run
from fedrcl.federated.run_folder import hold_run_folders
from fedrcl.federated.round import ClientResult, ClientRun, ServerRound
from fedrcl.federated.sampling import sample_clients
from fedrcl.federated.stacked import MIXED, StackedRound, stacked_step
from fedrcl.contract.step_mask import client_rows, masked_batch


class NotTogether(Exception):
    """The runs cannot train together (the reason). ``continued``: ``None`` when nothing was written (raised
    before the first round); else the keys of the runs that have rounds left, each checkpointed after its last
    round done, to go on alone with ``--ckpt_path last``."""

    def __init__(self, reason: str, continued: Optional[list[Hashable]] = None):
        super().__init__(reason)
        self.continued = continued


class SeedRun(DrivenRun):
    """One federation of the cohort (``DrivenRun``: where it stands, its round's end), built as its ``fedrcl
    fit`` (``cli``): ``key`` is its key in the cohort's runs, ``label`` what its lines begin with (``seed 1``;
    ``lr=0.03 seed 1`` in a sweep), ``seed`` its ``trainer.seed``."""

    def __init__(self, key: Hashable, cli: Any, label: str):
        super().__init__(cli.trainer, cli.model, cli.datamodule,
                         say=lambda line: print(f"{label}: {line}", flush=True), local_models=True)
        self.key, self.label, self.cli = key, label, cli
        self.seed = cli.trainer.federation.seed


def checkpointed_state(run: SeedRun) -> tuple[dict[str, Any], dict[str, Any]]:
    """What seed ``run``'s checkpoint holds besides its weights and its loop's counts, copied: the method's own
    entries (``on_save_checkpoint``) and the server optimizer's state."""
    extras: dict[str, Any] = {}
    run.module.on_save_checkpoint(extras)
    return copy.deepcopy(extras), copy.deepcopy(run.trainer.federation.server.state_dict())


def static_reason(run: SeedRun) -> Optional[str]:
    """Why a seed's run cannot train on the stacked step, from its configuration (``None``: it can)."""
    module, trainer = run.module, run.trainer
    if trainer.federation.batching.mode == "off":
        return "trainer.client_batching is off"
    reason = unbatchable(module, str(trainer.precision))
    if reason is None and trainer.world_size > 1:
        reason = "it runs on several devices or processes"
    return reason


class Cohort:
    """The runs trained together (see the module docstring): a command's seeds, or a sweep's (setting, seed)
    runs.

    Args:
        runs: each run's ``fedrcl fit`` arguments by its key (``--ckpt_path`` among them resumes it: ``last``
            resumes each run that has a checkpoint and starts the others).
        stop: what records a stop signal (``fedrcl.federated.preemption.StopSignal``): read after each round.
        labels: what each run's lines begin with, by key; default ``seed <key>`` (``fedrcl seeds``' keys).
        prog: the command, for its lines (``fedrcl seeds``, ``fedrcl sweep``).
    """

    def __init__(self, runs: Mapping[Hashable, list[str]], stop: Any,
                 labels: Optional[Mapping[Hashable, str]] = None, prog: str = "fedrcl seeds"):
        self.stop, self.prog = stop, prog
        self.seeds: list[SeedRun] = []  # every run of the cohort (each a federation with its own seed)
        try:
            self._build(runs, labels or {key: f"seed {key}" for key in runs})
        except BaseException:
            self.abandon()
            raise
        self._steps: dict[tuple[int, int, int], ClientStep] = {}
        self._evaluate: Optional[SeedsEvaluation] = None
        self._checked = False  # the first round's checks passed and the run folders are written

    def abandon(self) -> None:
        """After a failure before any round was logged (``NotTogether`` among them): remove the run folders
        these starts made (``remove_failed_start``: never one that holds a checkpoint or existed before)."""
        from fedrcl.lightning_cli import remove_failed_start

        for run in self.seeds:
            remove_failed_start(run.cli)

    def _build(self, runs: Mapping[Hashable, list[str]], labels: Mapping[Hashable, str]) -> None:
        """Each run built as its ``fedrcl fit`` would, checked and opened (resumed); nothing written but the
        split file that setting up its data writes."""
        from fedrcl.cli import split_ckpt_path
        from fedrcl.lightning_cli import build_cli

        paths: list[Optional[str]] = []
        for key, args in runs.items():
            args, ckpt_path = split_ckpt_path(args)
            run = SeedRun(key, build_cli(args, run=False), labels[key])
            self.seeds.append(run)
            hold_run_folders(run.trainer)  # before setting up its data writes split.json there
            reason = static_reason(run)
            if reason is not None:
                raise NotTogether(f"{run.label}: {reason}")
            check_method(run.module, run.trainer.federation.server, training=True)
            paths.append(self._checkpoint(run, ckpt_path))
        shapes = {(r.trainer.federation.clients_per_round, r.trainer.federation.local_epochs,
                   r.cli.datamodule.local_iters_per_epoch, r.trainer.precision) for r in self.seeds}
        if len(shapes) > 1:
            raise NotTogether("the runs' rounds differ in shape (clients per round, local epochs, steps or "
                              "precision)")
        for run, path in zip(self.seeds, paths):
            run.next_round, run.steps = open_run(run.trainer, run.module, run.cli.datamodule, path)
        sizes = {r.cli.datamodule.batch_size for r in self.seeds}
        if len(sizes) > 1:
            raise NotTogether(f"the runs' batch sizes differ ({sorted(sizes)}: data.batch_size null with "
                              "--vary_split); set data.batch_size")

    def _checkpoint(self, run: SeedRun, ckpt_path: Optional[str]) -> Optional[str]:
        """The checkpoint ``run`` resumes from: ``last`` where its run folder has none starts it anew; where it
        has checkpoints but none usable, the command stops naming this run alone (the others can resume)."""
        if ckpt_path is None:
            return None
        where, found = run_checkpoints(run.trainer)
        if ckpt_path == "last" and not found:
            print(f"{self.prog}: {run.label}: no checkpoint in {where}; it starts at round 1", flush=True)
            return None
        try:
            return resume_path(run.trainer, run.module, run.cli.datamodule, ckpt_path)
        except NothingToResume as error:
            raise NothingToResume(
                f"{run.label}: --ckpt_path last: nothing to resume under {error.where} ({error.found} checkpoint "
                f"file(s), none usable: see the warnings above); to start {run.label} anew and resume the "
                f"others, move {error.where} away and run the same command again", error.where, error.found) from None

    # -- the run ----------------------------------------------------------------------------------------
    def fit(self) -> None:
        """Train every seed to its last round; the first round checks that the seeds can train together
        (``NotTogether``) before anything is written."""
        while True:
            active = [r for r in self.seeds if not r.done]
            if not active:
                break
            started = time.perf_counter()
            before = {run.key: checkpointed_state(run) for run in active}
            try:
                rounds, stacked = self._begin(active)
            except BaseException:
                if not self._checked:  # the first round: nothing but what the starts wrote is there
                    self.abandon()
                raise
            batches = stacked_batches(stacked)
            first = next(batches)
            try:  # the seeds' own losses equal the stacked step's, before the round's first step
                check_seeds(stacked, *first, MIXED.get(str(active[0].trainer.precision)))
            except NotTogether as reason:
                if not self._checked:  # before anything was written
                    self.abandon()
                    raise
                raise NotTogether(f"from round {rounds[0].round_idx + 1}: {reason}",
                                  self._part(active, rounds, before))
            if not self._checked:
                self._checked = True
                self._open()
            for run in active:
                run.begin_round()
            for x, y in itertools.chain([first], batches):  # the round's local steps of every client of every seed
                stacked.step(x, y)
            self._end_round(active, rounds, stacked, time.perf_counter() - started)
            if self.stop.signum is not None:
                break
        self._close()

    def _part(self, active: list[SeedRun], rounds: list[ServerRound],
              before: dict[Hashable, tuple[dict[str, Any], dict[str, Any]]]) -> list[Hashable]:
        """Before the round of ``rounds`` trained: every seed's global model put back (its clients had the
        broadcast weights) and what its checkpoint holds put back as it was before the round began (``before``:
        a server copy that changed state when the round began or was configured would otherwise be checkpointed
        a round ahead), its last round done checkpointed, its logs closed; returns the seeds with rounds left,
        to go on alone."""
        for run, server_round in zip(active, rounds):
            load_state_(run.module.backbone, server_round.global_state)
            extras, server_state = before[run.key]
            run.module.on_load_checkpoint(extras)
            run.trainer.federation.server.load_state_dict(server_state)
        for run in self.seeds:
            run.checkpoint_now()
            for logger in run.trainer.loggers:
                logger.finalize("success")
        return [run.key for run in self.seeds if not run.done]

    def _open(self) -> None:
        """Name what of the callbacks is not run, then open every seed's run (``DrivenRun.open``)."""
        ignored = not_run(self.seeds[0].trainer, local_models=True)
        if ignored:
            rank_zero_info(f"{self.prog} --together does not run these trainer.callbacks: {', '.join(ignored)}")
        for run in self.seeds:
            run.open()

    def _begin(self, active: list[SeedRun]) -> tuple[list[ServerRound], StackedRound]:
        """Every active seed's round begun and configured, and its clients started on the stacked axis."""
        rounds, runs = [], []
        for run in active:
            federation, dm, module = run.trainer.federation, run.cli.datamodule, run.module
            server_round = ServerRound(federation.server, module, run.next_round, snapshot(module.backbone),
                                       federation.ledger, privacy=federation.privacy)
            sampled = sample_clients(dm.num_clients, federation.clients_per_round, federation.seed, run.next_round)
            plan = RoundPlan.of_clients(run.next_round, tuple(sampled), dm.client_num_samples,
                                        dm.client_steps_per_epoch, federation.local_epochs, federation.seed)
            runs.append([ClientRun(module, c, down) for c, down in server_round.configure(plan, dm.client_data)])
            rounds.append(server_round)
        step = stacked_step(self._steps, active[0].module, len(active), len(runs[0]), active[0].trainer)
        return rounds, StackedRound(active, runs, step, check=not self._checked)

    def _end_round(self, active: list[SeedRun], rounds: list[ServerRound], stacked: StackedRound,
                   seconds: float) -> None:
        """Every seed's clients end and fold into its server round (a seed whose round diverged stops, named;
        the others go on); the new global models are evaluated together; each seed's scalars, line, checkpoint."""
        folded = []
        for s, (run, server_round) in enumerate(zip(active, rounds)):
            def fold(client: ClientRun, result: ClientResult, seed: SeedRun = run,
                     server_round: ServerRound = server_round) -> None:
                seed.client_ended(client.client, result.weights)  # the RoundCallbacks see its local model
                server_round.add(client.client.client_id, result)

            stacked.finish(s, fold)
            try:
                load_state_(run.module.backbone, server_round.finish())
            except DivergenceError as error:
                run.failed = f"{error}"
                print(f"{self.prog}: {run.label}: {error}", flush=True)
                continue
            folded.append(s)
        due = [s for s in folded if (active[s].next_round + 1) % active[s].trainer.check_val_every_n_epoch == 0]
        started = time.perf_counter()
        accuracies = dict(zip(due, self._evaluation(active[due[0]]).accuracies([active[s] for s in due]))) \
            if due else {}  # each seed's {"val/acc": ..., "test/acc": ...}
        evaluation = time.perf_counter() - started
        for s in due:  # the evaluation's time, shared by the seeds evaluated together
            active[s].trainer.federation.ledger.add("evaluation", evaluation)
        for s in folded:
            self._report(active[s], stacked, s, seconds, accuracies.get(s))

    def _report(self, run: SeedRun, stacked: StackedRound, s: int, seconds: float,
                accuracies: Optional[dict[str, float]]) -> None:
        """Seed ``s``'s round ends as ``fedrcl fit`` ends it (``DrivenRun.end_round``), with its clients' steps and
        summed losses."""
        clients = stacked.clients
        steps = sum(client.client.num_steps for client in stacked.runs[s])
        mine = slice(s * clients, (s + 1) * clients)
        sums = {"loss": stacked.loss_sums[mine].sum(),
                **{f"loss_{k}": v[mine].sum() for k, v in stacked.part_sums.items()}}
        run.end_round(steps, {f"train/{k}": float(v) / steps for k, v in sums.items()}, seconds, accuracies)

    def _evaluation(self, first: SeedRun) -> "SeedsEvaluation":
        if self._evaluate is None:
            self._evaluate = SeedsEvaluation(first, run_compile_options(first.trainer))
        return self._evaluate

    def _close(self) -> None:
        """Every seed's run ends (a stop signal: each checkpointed now): logs closed, summary told."""
        for run in self.seeds:
            run.close(stopping=self.stop.signum is not None)

    def stopped_where(self) -> str:
        """`` (seed 0 after round 3/10, ...)`` for the command's stop line."""
        return " (" + ", ".join(f"{r.label} after round {r.next_round}/{r.trainer.max_epochs}"
                                for r in self.seeds) + ")"


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


class SeedsEvaluation:
    """Every seed's global model evaluated on the test set at once: per test batch, one forward of the first
    seed's backbone mapped over the seeds' stacked weights (``vmap``), in the run's precision (under mixed
    precision the forward runs in its low dtype, as the stacked step's), compiled with
    ``trainer.compile_clients``. Top-1 accuracy as ``validation_step`` counts it (``argmax``, micro), read back
    once per evaluation."""

    def __init__(self, first: SeedRun, compile: Optional[dict[str, Any]]):
        self.backbone = first.module.backbone
        self.low = MIXED.get(str(first.trainer.precision))
        self.convert = first.trainer.precision_plugin.convert_input
        forward: Any = vmap(self._logits, in_dims=(0, None))
        self.forward = torch.compile(forward, fullgraph=True, **compile) if compile is not None else forward

    def _logits(self, params: dict[str, Tensor], x: Tensor) -> Tensor:
        if self.low is not None:
            params, x = {k: p.to(self.low) for k, p in params.items()}, x.to(self.low)
        logits: Tensor = functional_call(self.backbone, params, (x,)).logits
        return logits

    def accuracies(self, runs: list[SeedRun]) -> list[dict[str, float]]:
        """Each run's global model's accuracy on each of its evaluation sets (``val/acc``, and with a validation
        split ``test/acc``: ``FederatedDataModule.evaluation_sets``). The seeds share the test set; runs whose
        validation sets differ (``--vary_split``) are evaluated group by group."""
        found: list[dict[str, float]] = [{} for _ in runs]
        groups: list[list[int]] = []
        for i, run in enumerate(runs):
            same = [g for g in groups if same_evaluation_sets(runs[g[0]].cli.datamodule, run.cli.datamodule)]
            if same:
                same[0].append(i)
            else:
                groups.append([i])
        for group in groups:
            members = [runs[i] for i in group]
            for prefix, batches in members[0].cli.datamodule.evaluation_sets().items():
                for i, acc in zip(group, self._accuracy(members, batches)):
                    found[i][f"{prefix}/acc"] = acc
        return found

    @torch.no_grad()
    def _accuracy(self, runs: list[SeedRun], batches: EvalBatches) -> list[float]:
        states = [dict(r.module.backbone.named_parameters()) for r in runs]
        params = {name: torch.stack([state[name] for state in states]) for name in states[0]}
        correct: Optional[Tensor] = None
        self.backbone.eval()
        for x, y in batches:
            x, y = self.convert((x, y))
            hits = (self.forward(params, x).argmax(-1) == y).sum(-1)
            correct = hits if correct is None else correct + hits
        self.backbone.train()
        assert correct is not None  # an evaluation set has samples
        return (correct.double() / batches.num_samples).tolist()


def same_evaluation_sets(a: Any, b: Any) -> bool:
    """Whether two runs' data modules evaluate on the same samples (the test set always; the validation set
    when both have one with the same indices)."""
    if (a.val_indices is None) != (b.val_indices is None):
        return False
    return a.val_indices is None or torch.equal(a.val_indices, b.val_indices)


def stacked_batches(stacked: StackedRound) -> Iterator[tuple[Tensor, Tensor]]:
    """Each step's batches of every client, seed after seed ``[seeds * clients, B, ...]``: each seed's from its own
    (seed, round, client) streams, converted to its run's precision; under a step mask, the stepping clients'
    batches concatenated in the mask's groups."""
    members, runs = stacked.members, stacked.runs
    convert = members[0].trainer.precision_plugin.convert_input
    if stacked.mask is not None:
        own = [run.datamodule.client_batches(c.client.client_id, c.client.round_idx, c.client.local_epochs,
                                             c.client.seed) for run, clients in zip(members, runs) for c in clients]
        for groups, each in zip(stacked.mask.groups, itertools.zip_longest(*own), strict=True):
            yield convert(masked_batch(each, groups))
        return
    streams = []
    for run, clients in zip(members, runs):
        client = clients[0].client
        streams.append(run.datamodule.stacked_client_batches(
            tuple(c.client.client_id for c in clients), client.round_idx, run.trainer.federation.local_epochs,
            client.seed))
    for parts in zip(*streams):
        yield convert((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))


def check_seeds(stacked: StackedRound, x: Tensor, y: Tensor, low: Optional[torch.dtype]) -> None:
    """Before the first step: the stacked step runs every seed's clients with the first seed's algorithm object;
    each other seed's last started client's loss on its first batch (and, for a method that changes the step, its
    step direction, from its own step state) must be the same computed by its own object (which holds what its
    clients received: a global teacher, a proximal anchor, its round), else ``NotTogether``."""
    members, clients = stacked.members, stacked.clients
    own_loss = members[0].module
    own_step = changes_step(own_loss)
    for s, run in enumerate(members[1:], start=1):
        n = (s + 1) * clients - 1
        params = {f"algorithm.backbone.{k}": p[n] for k, p in stacked.params.items()}
        xn, yn = (x[n], y[n]) if stacked.mask is None else client_rows(x, y, stacked.mask.groups[0], n)
        if low is not None:
            params, xn = {k: p.to(low) for k, p in params.items()}, xn.to(low)
        weights = {k: w[n] if low is None else w[n].to(low) for k, w in stacked.weights.items()}
        inputs = ({**{k: t[n] for k, t in stacked.client_tensors.items()}, **weights},
                  {k: f[n] for k, f in stacked.facts.items()}, xn, yn, {k: g[s] for k, g in stacked.global_state.items()})
        with torch.no_grad():
            mine = functional_call(LocalLoss(run.module), params, inputs)
            first = functional_call(LocalLoss(own_loss), params, inputs)
            differing = _differing_loss(mine, first)
            if differing is None and own_step:
                state = {"direction": True, "state": map_state(lambda t: t[n], stacked.state)}
                mine = functional_call(LocalLoss(run.module), params, inputs, state)
                first = functional_call(LocalLoss(own_loss), params, inputs, state)
                differing = _differing_direction(mine[0], first[0])
        if differing is not None:
            name, own, theirs = differing
            raise NotTogether(
                f"model {type(run.module).__name__}: {run.label}'s clients compute another {name} with their "
                f"own algorithm ({own}) than with {members[0].label}'s ({theirs}): they read something "
                "of their seed (e.g. its global model as a teacher) that one stacked step cannot give each seed")


def train_together(runs: Mapping[Hashable, list[str]], stop: Any, labels: Optional[Mapping[Hashable, str]] = None,
                   prog: str = "fedrcl seeds") -> Cohort:
    """Build and train the runs together (``Cohort``'s arguments; ``NotTogether``: they cannot, and nothing was
    written)."""
    cohort = Cohort(runs, stop, labels, prog)
    cohort.fit()
    if stop.signum is not None:
        raise StoppedTogether(cohort, stop.signum)
    return cohort


class StoppedTogether(Exception):
    """A stop signal ended the seeds after a round, every seed checkpointed."""

    def __init__(self, cohort: Cohort, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.cohort, self.signum = cohort, signum
