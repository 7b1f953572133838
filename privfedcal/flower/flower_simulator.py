"""The server side under Flower: the simulator's round loop with Flower as the transport.

``FlowerSimulator`` *is* the in-process ``Simulator`` (same client sampling, sample-weighted
average, ``Algorithm.server_update``, calibrator hooks, evaluation, transcript, run folder);
it only replaces the two places where the simulator touches client data:

* local training (``FlowerTrainer``): a ``train`` message to the SuperNodes of the selected
  clients; each node trains with the simulator's ``train_client`` on its own partition;
* ``ServerContext.collect``: a ``query.payload`` message carrying the task description
  (``flower/tasks.py``) and the model state; the stages of the uplink the protection plan builds
  are split across the wire (``flower/stage_messages.py``): their client halves (bound, noise,
  encryption under a key holder node's public key) run on the nodes, and the server runs the
  same ``Uplink.open`` / ``Uplink.server_side`` as the simulator.

The per-client state of a method (MOON's previous model) never leaves its node. The oracle
calibrator reads pooled raw training features and has no federated form: refused here.

The server's experiment (``experiment.build_server_experiment``) holds the
model, the public test set and public sizes, never training samples or the partition (its
``parts`` are None): each client's sample count, the weight of its update, is what the node
reports (``query.hello``, checked again with every update), and a node is checked to run
the run's data settings by a digest of them (``partition_settings_digest``), not by
redrawing its partition.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from privfedcal.errors import UsageError
from privfedcal.federation.aggregate import RunningAverage
from privfedcal.federation.hooks import Calibrator, Payload, PayloadTask, State
from privfedcal.federation.local import LocalResult
from privfedcal.federation.setup import Experiment, partition_settings_digest
from privfedcal.federation.simulator import Simulator
from privfedcal.federation.workers import TrainJob
from privfedcal.flower.link import FlowerRoundError, GridLink
from privfedcal.flower.records import (
    as_float,
    as_int,
    record_at,
    record_to_state,
    state_to_record,
)
from privfedcal.flower.stage_messages import SECAGG, RemoteKeys, received_upload, sealing_record
from privfedcal.flower.tasks import task_to_records
from privfedcal.privacy.bound import NoBound
from privfedcal.privacy.cohorts import secure_minimum
from privfedcal.privacy.secagg_stage import EncryptStage
from privfedcal.privacy.transcript import record_model_updates, sent_tensors
from privfedcal.privacy.update_stage import UpdateRound
from privfedcal.settings.messages import SettingError

log = logging.getLogger("privfedcal.flower")


class FlowerTrainer:
    """The simulator's trainer interface, with SuperNodes doing the local training."""

    def __init__(self, link: GridLink, exp: Experiment, sizes: dict[int, int],
                 need: int | None = None) -> None:
        self.link, self.exp, self.sizes = link, exp, sizes
        self.need = need          # fewest replies a round goes on with (None: all)
        self.arrived: list[int] = []  # the clients of the last ``train`` whose update came

    def train(self, global_state: State, jobs: list[TrainJob], round_: int,
              consume: Callable[[State], None] | None = None) -> list[LocalResult]:
        """``Trainer.train`` on the SuperNodes, one train message per client: the results
        of the clients whose nodes replied, in job order (their clients in ``arrived``);
        lost ones are in ``link.dropped``."""
        content = RecordDict({"global": state_to_record(global_state),
                              "config": ConfigRecord({"round": round_})})
        replies = self.link.exchange(content, [j.client for j in jobs], "train", str(round_),
                                     need=self.need)
        self.arrived = [j.client for j in jobs if j.client in replies]
        out: list[LocalResult] = []
        for job in jobs:
            if job.client not in replies:
                continue
            reply = replies[job.client].content
            metrics = record_at(reply, "metrics", MetricRecord)
            n = as_int(metrics["num-examples"])
            if n != self.sizes[job.client]:
                raise FlowerRoundError(
                    f"client {job.client} trained on {n} samples where it reported "
                    f"{self.sizes[job.client]}: the node changed its data during the run")
            state = record_to_state(record_at(reply, "local", ArrayRecord), self.exp.device)
            loss = metrics.get("train-loss")  # absent under DP-SGD
            if consume is not None:
                consume(state)
                state = {}
            out.append(LocalResult(state, None, None if loss is None else as_float(loss)))
        return out

    def close(self) -> None:
        pass

    def terminate(self) -> None:
        """``Simulator.close(abort=True)``: nothing runs here to stop (the nodes train)."""


class FlowerSimulator(Simulator):
    """``Simulator`` whose clients are SuperNodes reached through a Flower ``Grid``."""

    plays_clients = False  # the nodes run the client halves and keep their own records

    def __init__(self, exp: Experiment, run_dir: Path, link: GridLink, *,
                 calibrator: Calibrator | None = None, uplink: Any = None, key_holder: int = 0,
                 run_record: dict[str, Any] | None = None) -> None:
        privacy = exp.privacy  # the protections and the public protocol
        if privacy.calibrator.startswith("oracle"):
            raise UsageError("the oracle calibrator reads the pooled raw training data; it has "
                             "no federated form and cannot run under Flower")
        if privacy.secagg_updates:
            raise SettingError("{secagg_updates} runs in the simulator only: under Flower the "
                             "updates would reach the server in the clear before encryption")
        if privacy.dp_updates and privacy.dp_adaptive_clip:
            raise SettingError("{dp_adaptive_clip} runs in the simulator only: under Flower "
                             "each node clips its own update, so the server never sees "
                             "whether a norm was within the clip; give {dp_update_clip}")
        if privacy.dp_updates and link is not None and link.options.min_replies:
            raise SettingError("flower.min-replies does not combine with {dp_updates}: every "
                             "node of a round must reply, so that each clipped update is "
                             "recorded as its client's; leave flower.min-replies unset")
        if not 0 <= key_holder < privacy.clients:
            raise UsageError(f"flower.key-holder={key_holder} is not a client "
                             f"(0..{privacy.clients - 1})")
        if privacy.secagg and privacy.secagg_key_holder != key_holder:
            raise UsageError(f"the run config names client {privacy.secagg_key_holder} as the key "
                             f"holder, flower.key-holder {key_holder}")
        super().__init__(exp, run_dir, calibrator=calibrator, uplink=uplink,
                         run_record=run_record)
        self.link = link
        self.key_holder = key_holder
        self.sizes: dict[int, int] = {}  # each client's sample count, as its node reports it
        wire = self.uplink.wire
        if isinstance(wire, EncryptStage):  # the key holder is a node, reached by messages
            wire.keys = RemoteKeys(link, key_holder)

    def _trainer(self) -> FlowerTrainer:
        return FlowerTrainer(self.link, self.exp, self.sizes, self._need())

    def _need(self, secure: bool = False) -> int | None:
        """Fewest replies an exchange goes on with: ``flower.min-replies`` (None: all), and
        for a secure sum never fewer than the protection plan's --secagg-min-clients."""
        need = self.link.options.min_replies or None
        if need is not None and secure:  # the key holder's own upload does not count
            need = max(need, secure_minimum(self.exp.privacy))
        return need

    def receive_updates(self, trainer: Any, jobs: list[TrainJob], selected: list[int],
                        weights: list[float], round_: int) -> tuple[list, State, int, list]:
        """``Simulator.receive_updates`` for the clients whose nodes replied (a stage that
        takes the round, DP-FedAvg, has every node of the round reply: ``__init__``)."""
        self._arrived = selected
        return super().receive_updates(trainer, jobs, selected, weights, round_)

    def receive_in_clear(self, rnd: UpdateRound) -> tuple[list, State, int, list]:
        """The updates the nodes sent (their client halves ran on the nodes): a lost
        client's update is missing, so the average is re-weighted over the others (their
        reported sizes, or uniform under --dp-train) and the loss is noted."""
        results = rnd.trainer.train(rnd.global_state, rnd.jobs, rnd.round_)
        arrived, selected, round_, weights = (list(rnd.trainer.arrived), rnd.selected,
                                              rnd.round_, rnd.weights)
        self._arrived = arrived
        if arrived != selected:
            lost = [c for c in selected if c not in arrived]
            self.notes.append(f"round {round_}: client(s) {lost} lost (no update; "
                              f"averaged {len(arrived)} of {len(selected)} clients)")
            log.warning("round %d: client(s) %s lost, going on with %d of %d", round_, lost,
                        len(arrived), len(selected))
            weights = self.uplink.update_weights(self.client_sizes(arrived))
        running = RunningAverage(weights)
        for client, r, w in zip(arrived, results, weights, strict=True):
            record_model_updates(rnd.transcript, round_, [client], [r.state], [w], rnd.recipe)
            running.add(r.state)
        return results, running.result(), running.bytes, results

    def replied(self, selected: list[int]) -> list[int]:
        return list(getattr(self, "_arrived", selected))

    def extra_summary(self) -> dict[str, Any]:
        # which clients were lost, when and why: the server saw who did not reply
        extra: dict[str, Any] = {"dropped_clients": list(self.link.dropped)}
        if self.link.holds:  # flower.hold: how many, and how long they lasted
            seconds = [h["seconds"] for h in self.link.holds]
            extra["flower_holds"] = {"sent": len(seconds), "missed": self.link.missed_holds,
                                     "median_seconds": statistics.median(seconds),
                                     "max_seconds": max(seconds)}
        return extra

    def client_index(self, client: int) -> None:
        return None  # the node holds its partition

    def client_sizes(self, selected: list[int]) -> list[float]:
        """The sample counts the nodes report (``query.hello``, asked once; 0 under
        --dp-train, where sizes are private and weights uniform), after checking every node
        runs this run's data settings."""
        if not self.sizes:
            want = partition_settings_digest(self.exp.data_options)
            for client, reply in sorted(self.link.discover().items()):
                if str(reply.content["meta"].get("settings", "")) != want:
                    raise FlowerRoundError(
                        f"client {client} runs another dataset/partition config than this "
                        "run's (its digest of the data settings differs)")
                self.sizes[client] = as_int(
                    record_at(reply.content, "metrics", MetricRecord)["num-examples"])
        return [float(self.sizes[c]) for c in selected]

    def collect(self, task: PayloadTask, clients: list[int], state: State, label: str,
                round_: int) -> Payload:
        """``Simulator.collect`` with the uplink's stages split across the wire
        (flower/stage_messages.py): the server opens the release and runs the server side; the
        nodes run the client halves; the key holder decrypts the sum."""
        up = self.uplink
        # the server knows the model it asked clients to use (as Simulator.collect records)
        self.transcript.record(round_=round_, label=label, view="model-state", client=None,
                               tensors=sent_tensors(state, task))
        example = self._example_payload(task, state) if up.wire.hides_uploads else {}
        rel = up.release(label, round_, clients, clients, example, self.transcript)
        up.open(rel)  # the budget check; under --secagg a fresh key from the key holder
        records = {SECAGG: sealing_record(rel.state["sealing"])} if "sealing" in rel.state \
            else {}
        config = ConfigRecord({"round": round_, "label": label})
        content = RecordDict({"state": state_to_record(state), "config": config,
                              **task_to_records(task), **records})
        # a lost client is a planned upload missing from the sum: the noise is topped up
        # for it as for a rejected one, and its budget is charged all the same (close).
        # Under encryption its whole cohort leaves the sum (privacy/secagg_stage.py), as
        # does the cohort of a client lost before it was asked (in training)
        replies = self.link.exchange(content, clients, "query.payload", f"{label}-{round_}",
                                     need=self._need(secure=up.wire.hides_uploads))
        lost = [c for c in clients if c not in replies]
        if lost:
            self.notes.append(f"round {round_} {label}: client(s) {lost} lost (no upload; "
                              f"{len(replies)} of {len(clients)} replied)")
        # the simulator's order of clients: the same float sums
        uploads = [(c, received_upload(replies[c].content, self.exp.device)) for c in clients
                   if c in replies]
        total = up.server_side(uploads, rel)
        return {k: v.to(self.exp.device) for k, v in total.items()}

    def _example_payload(self, task: PayloadTask, state: State) -> Payload:
        """Keys and shapes of every upload (tasks give the same whatever the data): the
        task on zero samples, which is all the server needs to lay out ciphertexts."""
        model = self.exp.model
        model.load_state_dict(state)
        model.eval()
        x, y = self.exp.data.x_test[:0], self.exp.data.y_test[:0]
        return task.compute(model, x, y, NoBound())

    def centralized_features(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError("centralized features (oracle) are not available under Flower")
