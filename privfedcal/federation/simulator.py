"""The federated round loop (docs/architecture.md, "A round's data path").

Methods and calibrators are objects with hooks; the loop never branches on their names.
Each round: sample clients -> local training (in-process or workers) -> sample-weighted
average -> the method's server rule -> the calibrator's round hook -> evaluation ->
checkpoint. After the last round the calibrator's post-hoc hook runs (CCVR, oracle).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from privfedcal.errors import Diverged, ReleaseSkipped
from privfedcal.federation import divergence
from privfedcal.federation.aggregate import RunningAverage
from privfedcal.federation.checkpoint import load_checkpoint, save_checkpoint, snapshot
from privfedcal.federation.hooks import Calibrator, FeatureTransform, Payload, PayloadTask, State
from privfedcal.federation.journaled_training import JournaledTrainer
from privfedcal.federation.local import (
    clone_state,
    evaluate,
)
from privfedcal.federation.runfolder import transcript_dir, write_run_files, write_summary
from privfedcal.federation.runlog import RunLogger
from privfedcal.federation.setup import Experiment
from privfedcal.federation.vectorised import VectorisedTrainer
from privfedcal.federation.workers import (
    InProcessTrainer,
    Trainer,
    TrainJob,
    WorkerPoolTrainer,
    default_threads,
)
from privfedcal.privacy.cohorts import (
    cohort_plan,
    observers_own,
    secure_rounds,
    select_clients,
    whole_run_record,
)
from privfedcal.privacy.release_journal import JOURNAL_DIR, ReleaseJournal, charge_of
from privfedcal.privacy.releases import DPSGD_RELEASE
from privfedcal.privacy.removals import wait_for_removals
from privfedcal.privacy.stages import NoiseStage
from privfedcal.privacy.transcript import (
    Transcript,
    record_model_updates,
    record_round,
    secure_participants,
    sent_tensors,
)
from privfedcal.privacy.transcript_epsilon import PublicPlan, file_loader, transcript_epsilons
from privfedcal.privacy.update_stage import UpdateRound
from privfedcal.seeding import make_generator

log = logging.getLogger("privfedcal.simulator")

@dataclass
class RoundContext:
    """The ``ServerContext`` a calibrator sees (federation/hooks.py)."""

    sim: Simulator
    round: int
    global_state: State
    sent_state: State
    selected: list[int]
    generator: torch.Generator
    model: Any = field(init=False)
    num_classes: int = field(init=False)
    num_clients: int = field(init=False)
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        self.model = self.sim.exp.model
        self.num_classes = self.sim.exp.data.num_classes
        self.num_clients = self.sim.exp.loop.data.clients
        self.device = self.sim.exp.device

    def collect(self, task: PayloadTask, clients: list[int], state: State, label: str) -> Payload:
        return self.sim.collect(task, clients, state, label, self.round)

    def centralized_features(self, state: State, per_class: int | None) -> tuple[Tensor, Tensor]:
        return self.sim.centralized_features(state, per_class, self.generator)

    def evaluate(self, state: State, transform: FeatureTransform | None = None) -> dict[str, Any]:
        return self.sim.evaluate(state, transform)


class Simulator:
    """Runs one experiment into a run folder; resumable from its last checkpoint.

    ``plays_clients``: this process runs the clients' halves of every release (and the key
    holder's), so it keeps their release journal; a subclass whose nodes run them (Flower)
    sets it False.

    It reads the experiment's narrow options (``exp.loop``: rounds, evaluation, the public
    seed; ``exp.engine``; ``exp.spec``; ``exp.privacy``), never the whole settings; it writes
    their record (``exp.record``) into the run folder (``runfolder.write_run_files``).
    ``privfedcal.experiment.build_simulator`` builds one from a ``RunConfig``."""

    plays_clients = True

    def __init__(self, exp: Experiment, run_dir: Path, *, calibrator: Calibrator | None = None,
                 uplink: Any = None, run_record: dict[str, Any] | None = None) -> None:
        from privfedcal.privacy.uplink import Uplink

        self.run_dir = Path(run_dir)
        self.exp = exp
        self.loop = exp.loop
        write_run_files(self.run_dir, self.exp, **(run_record or {}))
        self.calibrator = calibrator or Calibrator()
        self.uplink = uplink or Uplink()
        self.threads = exp.engine.threads or default_threads(exp.engine.workers, exp.model_name)
        self.global_state: State = clone_state(self.exp.model)
        self.server_state: State | None = None
        self.client_states: dict[int, State] = {}
        self.history: list[dict[str, Any]] = []
        self.notes: list[str] = list(self.exp.warnings)
        self._last_eval: tuple | None = None
        self.update_bytes = 0
        self.start_round = 1
        self.elapsed = 0.0
        self.transcript = Transcript(transcript_dir(self.run_dir) if self.loop.output.transcript
                                     else None)
        # every party's DP releases, journaled before they leave (privacy/release_journal.py):
        # a round redone after a stop re-sends them instead of drawing fresh noise
        self.journal = ReleaseJournal(self.run_dir / JOURNAL_DIR)
        self.journal.before_put = self.wait_for_checkpoint
        if self.plays_clients:
            self.uplink.attach_journal(self.journal)
        self._trainer_obj: Any = None
        self._round_calibrator: dict[str, Any] | None = None  # as the last checkpoint saved it
        self._post_training: dict[str, Any] | None = None  # a release made before a resume
        self.log = RunLogger(self.run_dir, self.exp)  # metrics.csv, clients.jsonl, TensorBoard

    @property
    def lr(self) -> float | None:
        """The local learning rate, which the divergence guard's advice names (None: a
        server that trains no client, the Flower plugin's)."""
        return self.exp.spec.training.lr if self.exp.spec is not None else None

    @property
    def parts(self) -> list[Tensor]:
        """Every client's training indices (held where the simulator plays the clients)."""
        if self.exp.parts is None:
            raise RuntimeError("this server holds no partition: the clients' nodes hold it")
        return self.exp.parts

    # ---- services for calibrators ----------------------------------------------------------
    def client_data(self, client: int) -> tuple[Tensor, Tensor]:
        idx = self.parts[client]
        return self.exp.data.x_train[idx], self.exp.data.y_train[idx]

    def collect(self, task: PayloadTask, clients: list[int], state: State, label: str,
                round_: int) -> Payload:
        model = self.exp.model
        model.load_state_dict(state)
        model.eval()
        # the server knows the model it asked clients to use: the attacks need it
        self.transcript.record(round_=round_, label=label, view="model-state", client=None,
                               tensors=sent_tensors(state, task))
        privacy = self.exp.privacy
        if secure_rounds(privacy):  # cohort by cohort: the encrypting wire holds one at a time
            cohort_of = {c: i for i, g in enumerate(cohort_plan(privacy).cohorts) for c in g}
            clients = sorted(clients, key=lambda c: cohort_of.get(c, -1))
        trainer = self._trainer_obj
        uploads: Iterable[tuple[int, Payload]]
        if isinstance(trainer, WorkerPoolTrainer) and len(clients) > 1:
            computed = trainer.collect(task, [self.parts[c] for c in clients], state,
                                       self.uplink.bound)
            uploads = [(c, {k: v.to(self.exp.device) for k, v in up.items()})
                       for c, up in zip(clients, computed, strict=True)]
        else:  # computed as the uplink reaches each client: one payload held at a time
            uploads = ((c, task.compute(model, *self.client_data(c), self.uplink.bound))
                       for c in clients)
        payload = self.uplink.aggregate(uploads, round_=round_, label=label,
                                        transcript=self.transcript, asked=list(clients))
        divergence.check_payload(payload, round_, label)
        return payload

    @torch.no_grad()
    def centralized_features(self, state: State, per_class: int | None,
                             generator: torch.Generator) -> tuple[Tensor, Tensor]:
        model, data = self.exp.model, self.exp.data
        held = torch.cat(self.parts)  # long-tail partitions drop samples: use held ones
        y = data.y_train[held]
        if per_class is not None:
            perm = torch.randperm(held.numel(), generator=generator).to(held.device)
            held, y = held[perm], y[perm]
            keep = torch.zeros_like(y, dtype=torch.bool)
            for c in range(data.num_classes):
                keep |= (y == c) & (torch.cumsum((y == c).long(), 0) <= per_class)
            held, y = held[keep], y[keep]
        model.load_state_dict(state)
        model.eval()
        z = torch.cat([model.features(data.x_train[held[i:i + 2048]])
                       for i in range(0, held.numel(), 2048)])
        return z.float(), y

    def evaluate(self, state: State, transform: FeatureTransform | None = None) -> dict[str, Any]:
        # The last evaluation is kept (with references, so ids cannot be reused): the final
        # round, a post-hoc calibrator's "before" and the summary often ask for the same one.
        key = (id(state), id(transform))
        if self._last_eval is not None and self._last_eval[0] == key:
            return self._last_eval[2]
        d = self.exp.data
        result = evaluate(self.exp.model, state, d.x_test, d.y_test, d.num_classes, transform)
        self._last_eval = (key, (state, transform), result)
        return result

    # ---- the loop ------------------------------------------------------------------------
    def select_clients(self, round_: int) -> list[int]:
        return select_clients(self.exp.privacy, round_)

    def client_index(self, client: int) -> Tensor | None:
        """The client's training indices (the simulator plays the clients; under Flower the
        node holds them and this is None)."""
        return self.parts[client]

    def client_sizes(self, selected: list[int]) -> list[float]:
        """Each selected client's sample count, as its update's weight states it (under
        Flower: what the node reported)."""
        return [float(self.parts[c].numel()) for c in selected]

    def replied(self, selected: list[int]) -> list[int]:
        """The selected clients whose update the last ``receive_updates`` averaged: all of
        them here (under Flower, those whose nodes replied)."""
        return selected

    def extra_summary(self) -> dict[str, Any]:
        """Entries a subclass adds to summary.json (Flower: the clients lost on the way)."""
        return {}

    def trainer(self) -> Trainer:
        """The trainer of this run (the worker pool with ``--workers N``), started on first
        use and kept until ``close``: calibration payloads run on the same pool."""
        if self._trainer_obj is None:
            self._trainer_obj = self._trainer()
        return self._trainer_obj

    def close(self, *, abort: bool = False) -> None:
        """Release the trainer; ``abort`` (an error or Ctrl-C) stops its workers at once."""
        if self._trainer_obj is not None:
            trainer, self._trainer_obj = self._trainer_obj, None
            trainer.terminate() if abort else trainer.close()
        try:  # the transcript's pending files, then its writer thread
            self.transcript.close()
        except Exception as exc:
            if not abort:
                raise
            log.warning("transcript not fully written: %s", exc)
        try:  # the replaced checkpoint's folder and the pruned journal, removed on a thread
            wait_for_removals()
        except OSError as exc:
            if not abort:
                raise
            log.warning("the replaced checkpoint was not removed: %s", exc)

    def _trainer(self) -> Trainer:
        """The run's trainer; a subclass returns another (``FlowerSimulator``: the nodes)."""
        exp, engine = self.exp, self.exp.engine
        if engine.workers > 1:
            return WorkerPoolTrainer(exp.builder, exp.data.x_train, exp.data.y_train, exp.spec,
                                     engine.workers, self.threads, exp.device,
                                     engine.deterministic)
        if engine.client_batch > 1:
            return VectorisedTrainer(exp.model, exp.algo, exp.data.x_train, exp.data.y_train,
                                     exp.spec, engine.client_batch)
        return InProcessTrainer(exp.model, exp.algo, exp.data.x_train, exp.data.y_train,
                                exp.spec)

    def receive_updates(self, trainer: Trainer, jobs: list[TrainJob], selected: list[int],
                        weights: list[float], round_: int) -> tuple[list, State, int, list]:
        """Train the round's clients and obtain the weighted average as the server does,
        through the uplink's update stages (privacy/update_stage.py; in the clear without
        one: ``receive_in_clear``). Returns (results, average, update bytes, results for
        the divergence check)."""
        return self.uplink.receive_updates(UpdateRound(
            self.journaled(trainer), jobs, self.global_state, selected, weights, round_,
            self.transcript, self.uplink.recipe(self.exp.spec), self.receive_in_clear))

    def receive_in_clear(self, rnd: UpdateRound) -> tuple[list, State, int, list]:
        """Updates in the clear: each sent through the update stages' client halves,
        recorded and averaged as it arrives (job order), so no list of every client's state
        is held."""
        running = RunningAverage(rnd.weights)

        def consume(state: State) -> None:
            i = running.count
            sent = self.uplink.update_client(state, rnd.at(rnd.selected[i]))
            # the trainer drops a state it hands to consume: unless a stage replaced it, the
            # record keeps it as is, without a copy
            record_model_updates(rnd.transcript, rnd.round_, [rnd.selected[i]], [sent],
                                 [rnd.weights[i]], rnd.recipe, copy=sent is not state)
            running.add(sent)

        results = rnd.trainer.train(rnd.global_state, rnd.jobs, rnd.round_, consume=consume)
        checked = [r._replace(state=running.nonfinite_marker(i)) for i, r in enumerate(results)]
        return results, running.result(), running.bytes, checked

    def journaled(self, trainer: Trainer) -> Trainer:
        """``trainer`` with its clients' DP-SGD updates journaled and re-sent in a redone
        round (federation/journaled_training.py), under --dp-train where this process plays
        the clients; else ``trainer`` itself."""
        noise = self.uplink.find(NoiseStage)
        if (noise is None or not noise.dp.covers_updates or self.uplink.journal is None
                or not self.plays_clients):
            return trainer
        return JournaledTrainer(trainer, self.journal, DPSGD_RELEASE,
                                charge_of(noise.dp, DPSGD_RELEASE))

    def run(self, progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Train the remaining rounds and finish; on divergence write a summary marked
        ``"diverged"`` (metrics so far and the last finite checkpoint stay) and re-raise."""
        try:
            return self._run(progress)
        except Diverged as exc:
            # a round's checkpoint is written after its checks passed: the last one kept
            exc.checkpoint_round = self.history[-1]["round"] if self.history else 0
            self.write_diverged(exc)
            raise

    def _run(self, progress: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
        torch.set_num_threads(self.threads)
        if self.start_round == 1 and self.transcript.entries:  # stopped before round 1's
            self.transcript.resume_after(0)  # checkpoint: the server's record stays
        trainer = self.trainer()
        try:
            for round_ in range(self.start_round, self.loop.training.rounds + 1):
                t0 = time.perf_counter()
                selected, results, averaged = self.train_round(trainer, round_)
                sent = self.apply_round(averaged, selected, results, round_)
                self.calibrate_round(round_, sent, selected)
                record = self.round_record(round_, results)
                self.keep_round(record, selected, results, time.perf_counter() - t0)
                if progress:
                    progress(record)
            result = self.finish()
        except BaseException:
            self.close(abort=True)
            raise
        self.close()
        return result

    def train_round(self, trainer: Trainer, round_: int) -> tuple[list[int], list, State]:
        """A round's clients drawn, trained and their updates averaged (through the
        uplink), each checked: (the clients that replied, their results, the average)."""
        selected = self.select_clients(round_)
        jobs = [TrainJob(c, self.client_index(c), self.client_states.get(c)) for c in selected]
        self.uplink.before_local_training(selected)  # DP-SGD: stop before exceeding the budget
        record_round(self.transcript, round_, self.global_state, selected)
        weights = self.uplink.update_weights(self.client_sizes(selected))
        results, averaged, sent_bytes, checked = self.receive_updates(
            trainer, jobs, selected, weights, round_)
        self.transcript.seal()  # the round's record written while the round goes on
        # every selected client is charged (DP-SGD), whether its update arrived or not
        self.uplink.after_local_training(selected)
        selected = self.replied(selected)  # under Flower, lost clients leave the round
        self.update_bytes += sent_bytes
        divergence.check_local(checked, selected, averaged, round_, self.lr,
                               secure=self.uplink.hides_updates)
        return selected, results, averaged

    def apply_round(self, averaged: State, selected: list[int], results: list,
                    round_: int) -> State:
        """The method's server rule applied to the average (parts it never aggregates kept),
        the new global state checked, the clients' own states kept; returns the global state
        the round sent."""
        exp = self.exp
        averaged = {k: v.to(exp.device) for k, v in averaged.items()}
        sent = self.global_state
        for k in averaged:  # parts a method never aggregates (frozen heads)
            if k.startswith(exp.algo.frozen_prefixes):
                averaged[k] = sent[k]
        self.global_state, self.server_state = exp.algo.server_update(
            sent, averaged, self.server_state)
        divergence.check_state(self.global_state, round_, "the aggregated model",
                               divergence.lr_hint(self.lr))
        for c, r in zip(selected, results, strict=True):
            if r.client_state is not None:
                self.client_states[c] = {k: v.to(exp.device) for k, v in r.client_state.items()}
        return sent

    def calibrate_round(self, round_: int, sent: State, selected: list[int]) -> None:
        """The calibrator's per-round step (CReFF); a skipped release goes to the notes."""
        ctx = RoundContext(self, round_, self.global_state, sent, selected,
                           make_generator(self.loop.training.seed, round_, 0, 4))
        try:
            self.calibrator.after_round(ctx)
        except ReleaseSkipped as exc:  # nothing released: the calibrator keeps its state
            self.notes.append(str(exc))

    def round_record(self, round_: int, results: list) -> dict[str, Any]:
        """The round's metrics: mean training loss, the evaluation on eval rounds, the
        calibrator's round information."""
        loop = self.loop
        losses = [r.loss for r in results if r.loss is not None]
        train_loss = float(np.mean(losses)) if losses else None  # None: DP-SGD
        record: dict[str, Any] = {"round": round_, "train_loss": train_loss}
        if round_ % loop.training.eval_every == 0 or round_ == loop.training.rounds:
            ev = self.evaluate(self.checked_eval_state(round_),
                               self.calibrator.feature_transform())
            divergence.check_evaluation(ev, round_, self.lr)
            record.update(accuracy=ev["accuracy"], loss=ev["loss"],
                          per_class_accuracy=ev["per_class_accuracy"])
        info = getattr(self.calibrator, "last_round_info", None)
        if info:
            record["calibration"] = info
        return record

    def keep_round(self, record: dict[str, Any], selected: list[int], results: list,
                   seconds: float) -> None:
        """The round's record timed, logged and written, and its checkpoint saved."""
        round_ = record["round"]
        self.elapsed += seconds
        record["seconds"] = round(seconds, 4)
        self.history.append(record)
        self.log.round(record, selected, [r.loss for r in results])
        if "accuracy" in record:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        self.save(round_)

    def finish(self) -> dict[str, Any]:
        loop = self.loop
        t0 = time.perf_counter()
        final_round = loop.training.rounds
        extra = self.post_training(final_round)
        final_state = self.checked_eval_state(final_round)
        ev = self.evaluate(final_state, self.calibrator.feature_transform())
        divergence.check_evaluation(ev, final_round, self.lr)
        self.elapsed += time.perf_counter() - t0
        save_checkpoint(self.run_dir / "final", {"model": final_state})
        summary = self.summary_fields(
            accuracy=ev["accuracy"], loss=ev["loss"],
            per_class_accuracy=ev["per_class_accuracy"],
            rejected_uploads=list(self.uplink.rejected),
            skipped_releases=list(self.uplink.skipped), **extra, **self.extra_summary())
        privacy = self.uplink.summary()
        if "secagg" in privacy or "secagg_updates" in privacy:
            privacy["whole_run"] = self.whole_run_check()
        recomputed = self.transcript_epsilon()
        if recomputed is not None:
            privacy["from_transcript"] = recomputed
        if privacy:
            summary["privacy"] = privacy
            if "statement" in privacy:
                self.notes.append(privacy["statement"])
        elif loop.calibrator != "none":
            self.notes.append("calibration uploads were sent in the clear (no --dp-eps, no "
                              "--secagg): the server saw every client's payload")
        summary["notes"] = self.notes + list(self.uplink.hints)
        self.transcript.flush()
        write_summary(self.run_dir, summary)
        return summary

    def post_training(self, final_round: int) -> dict[str, Any]:
        """The calibrator's post-training step (CCVR's release, the oracle), then the
        checkpoint again: the release's charges and records are on file before anything
        else can fail, and a run interrupted after it resumes with its result instead of
        releasing twice. Returns the step's summary fields."""
        if self._post_training is not None:  # made before an interruption: not again
            self.calibrator.load_state_dict(self._post_training["calibrator"])
            return dict(self._post_training["extra"])
        ctx = RoundContext(self, final_round, self.global_state, self.global_state,
                           list(range(self.loop.data.clients)),
                           make_generator(self.loop.training.seed, final_round, 0, 5))
        try:
            extra = self.calibrator.after_training(ctx)
        except ReleaseSkipped as exc:
            self.notes.append(f"calibration skipped: {exc}")
            extra = {}
        if self._round_calibrator is not None:  # a run that keeps checkpoints
            self.save(final_round, calibrator_state=self._round_calibrator,
                      post_training={"calibrator": self.calibrator.state_dict(),
                                     "extra": extra})
        return extra

    def whole_run_check(self) -> dict[str, Any]:
        """What all the run's secure sums together isolate, from the contributors recorded
        release by release (``cohorts.whole_run_record``); a run whose record breaks the
        guarantee says so in its notes."""
        rows = secure_participants(self.transcript.entries)
        record = whole_run_record(rows, self.loop.data.clients, self.exp.privacy.secagg_min_clients,
                                  known=observers_own(self.exp.privacy))
        if not record["holds"]:
            log.warning("whole run: %s", record["statement"])
            self.notes.append(f"WARNING: {record['statement']}")
        return record

    def transcript_epsilon(self) -> dict[str, Any] | None:
        """Each client's epsilon recomputed from the server's record and the public plan
        alone (privacy/transcript_epsilon.py), for the summary beside the claim; None
        without DP. A claim below it is logged and noted."""
        dp = self.uplink.accounting
        if dp is None:
            return None
        self.transcript.flush()  # its files are read back to tell repeated values apart
        out = transcript_epsilons(self.transcript.entries, PublicPlan.of(dp),
                                  file_loader(self.transcript.directory))
        out["epsilon_claimed"] = dp.epsilon()
        if out["epsilon"] > out["epsilon_claimed"] + 1e-9:
            log.warning("the transcript holds releases worth epsilon %.4f, over the %.4f "
                        "reported", out["epsilon"], out["epsilon_claimed"])
            self.notes.append(f"WARNING: the server holds releases worth epsilon "
                              f"{out['epsilon']:.3f}, over the {out['epsilon_claimed']:.3f} "
                              "reported")
        return out

    # ---- divergence ---------------------------------------------------------------------------
    def checked_eval_state(self, round_: int) -> State:
        """The state evaluated this round, checked finite: the global model, or the one the
        calibrator re-trained (CReFF's, CCVR's or the oracle's head)."""
        divergence.check_state(self.global_state, round_, "the global model",
                               divergence.lr_hint(self.lr))
        state = self.calibrator.eval_state(self.global_state)
        if state is not self.global_state:
            divergence.check_state(state, round_, f"{self.loop.calibrator} calibration: the "
                                   "re-trained classifier", "the calibrator's re-training "
                                   "diverged: lower its learning rate or steps (docs/usage.md)")
        return state

    def write_diverged(self, exc: Diverged) -> None:
        """summary.json of a run stopped by the divergence guard: no accuracy of the NaN
        model, only the last finite evaluation (also in metrics.jsonl)."""
        last = next((h for h in reversed(self.history) if "accuracy" in h), None)
        summary = self.summary_fields(
            diverged=exc.record(), accuracy=None,
            rejected_uploads=list(self.uplink.rejected),
            skipped_releases=list(self.uplink.skipped),
            last_finite_evaluation=({"round": last["round"], "accuracy": last["accuracy"]}
                                    if last else None),
            checkpoint_round=self.history[-1]["round"] if self.history else 0,
            notes=self.notes + [str(exc)])
        self.transcript.flush()
        write_summary(self.run_dir, summary)

    def summary_fields(self, **fields: Any) -> dict[str, Any]:
        """``summary.json``'s fields of every run, finished or diverged, then ``fields``:
        what ran (method, data, model, rounds), its wall time and the bytes uploaded."""
        loop = self.loop
        return {
            "method": loop.method, "local_method": loop.local_method,
            "calibrator": loop.calibrator, "dataset": loop.data.dataset,
            "model": self.exp.model_name,
            "rounds": loop.training.rounds, "wall_seconds": round(self.elapsed, 3),
            "uploaded_bytes": self.transcript.uploaded_bytes(),
            "calibration_upload_bytes": self.transcript.uploaded_bytes(),
            "model_update_bytes": self.update_bytes, **fields}

    # ---- checkpoint / resume ------------------------------------------------------------------
    def save(self, round_: int, calibrator_state: dict[str, Any] | None = None,
             post_training: dict[str, Any] | None = None) -> None:
        """The checkpoint of ``round_``, handed to the transcript's writer thread: written
        there after the round's record (files and index), then the journal's releases of
        the rounds it holds pruned, while the next round trains. What it writes is a
        ``snapshot`` taken here; a new release first waits for it (``journal.before_put``),
        and so do ``close`` and everything that reads the run folder after the run. After
        the post-training release: the last round's ``calibrator_state`` (an extended run
        trains on without the calibrated head) and the release's result, ``post_training``
        (the calibrator's state and summary fields)."""
        if calibrator_state is None:
            calibrator_state = self._round_calibrator = self.calibrator.state_dict()
        payload = {
            "round": round_,
            "elapsed": self.elapsed,
            "global": snapshot(self.global_state),
            "server": snapshot(self.server_state),
            # each round's client states are new tensors (the trainer's), replaced, never
            # changed in place: no copy of every client's model
            "clients": snapshot({str(c): s for c, s in self.client_states.items()},
                                clone=False),
            "calibrator": calibrator_state,
            "uplink": self.uplink.state_dict(),
            "history": self.history,
            "notes": self.notes,
            "update_bytes": self.update_bytes,
            "transcript": self.transcript.state_dict(),  # entries kept in memory only
            "post_training": post_training,
        }
        for key in ("calibrator", "uplink", "history", "notes", "transcript", "post_training"):
            payload[key] = snapshot(payload[key])
        self.transcript.hand_over(functools.partial(
            write_checkpoint, self.run_dir / "checkpoint", payload, self.journal))

    def wait_for_checkpoint(self) -> None:
        """Block until the checkpoint handed over is in place; raise what its write (or a
        transcript file before it) met."""
        self.transcript.wait_for_jobs()

    def restore(self) -> None:
        ck = load_checkpoint(self.run_dir / "checkpoint", self.exp.device)
        self.start_round = int(ck["round"]) + 1
        self.elapsed = float(ck["elapsed"])
        self.global_state = ck["global"]
        self.server_state = ck["server"]
        self.client_states = {int(c): s for c, s in ck["clients"].items()}
        self.calibrator.load_state_dict(ck["calibrator"])
        self._round_calibrator = ck["calibrator"]
        if int(ck["round"]) >= self.loop.training.rounds:  # not extended: the release stands
            self._post_training = ck.get("post_training")
        self.uplink.load_state_dict(ck.get("uplink") or {})
        self.history = ck["history"]
        self.notes = list(ck.get("notes", []))
        self.update_bytes = int(ck.get("update_bytes", 0))
        self.transcript.load_state_dict(ck.get("transcript") or {})
        # what the server received of the rounds redone stays on its record; the redo
        # re-sends the journaled releases of those rounds, so it holds each once (the
        # journal is not pruned here: a post-training release carries the checkpoint's
        # round, and is redone from it when the stop came before its own checkpoint)
        self.transcript.resume_after(int(ck["round"]))
        metrics = self.run_dir / "metrics.jsonl"
        metrics.write_text("".join(json.dumps(h) + "\n" for h in self.history if "accuracy" in h))
        self.log.restore(self.history)


def write_checkpoint(directory: Path, payload: dict[str, Any], journal: ReleaseJournal) -> None:
    """On the transcript's writer thread, after the round's record: the checkpoint swapped
    in, then the journal's releases of the rounds it holds pruned (never redone); a stop
    before the swap resumes from the previous checkpoint with them still journaled."""
    save_checkpoint(directory, payload, background=True)
    journal.prune_through(payload["round"], background=True)
