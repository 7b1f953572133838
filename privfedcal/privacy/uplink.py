"""The uplink every calibration payload goes through: bound -> noise -> encrypt.

Client side, each stage is optional: ``bound`` clips per-sample rows before they are summed
(inside the payload task, through ``Bound.clip``), ``noise`` adds Gaussian noise calibrated
by the accountant, ``encrypt`` packs the payload into CKKS ciphertexts. Server side the
uplink adds what arrives and hands the calibrator the sum alone: calibrators cannot tell
which stages ran. In this simulator one object plays every role (clients, server, key
holder), but each role only touches what it would hold in a deployment: the server's
aggregator loads the public context alone, and the transcript records the server's view.

Guarantees are never weakened silently: a release that would exceed any participant's budget
stops the run (``PrivacyBudgetError``) before anything is released; a rejected upload is
dropped and the release goes on, the key holder topping the distributed noise up to the
planned variance; a release with fewer than two valid uploads, or an aggregate that fails
the key holder's magnitude check, is skipped (``ReleaseSkipped``). Noise comes from OS
entropy (privacy/noise.py), never from the public run seed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from privfedcal.errors import ReleaseSkipped, UploadRejected, UsageError
from privfedcal.federation.hooks import Bound, NoBound, Payload
from privfedcal.federation.transcript import Transcript
from privfedcal.privacy.noise import INSECURE_STATEMENT, noise_generator

log = logging.getLogger("privfedcal.uplink")

#: fewest valid uploads for which a securely aggregated release is made (one upload would
#: hand the "aggregate" of a single client to the server)
MIN_SECAGG_CLIENTS = 2


def validate_upload(payload: Payload, reference: Payload | None) -> None:
    """Reject malformed uploads: non-tensors, NaN/Inf, keys or shapes unlike the others."""
    for k, v in payload.items():
        if not isinstance(v, Tensor):
            raise UploadRejected(f"{k!r} is not a tensor")
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise UploadRejected(f"{k!r} contains NaN or Inf")
    if reference is not None:
        if set(payload) != set(reference):
            raise UploadRejected(f"keys {sorted(payload)} differ from {sorted(reference)}")
        for k, v in payload.items():
            if v.shape != reference[k].shape:
                raise UploadRejected(f"{k!r} has shape {tuple(v.shape)}, expected "
                                     f"{tuple(reference[k].shape)}")


def payload_bytes(payload: Payload) -> int:
    return int(sum(v.numel() * v.element_size() for v in payload.values()))


def symmetrise_outer(payload: Payload) -> Payload:
    """Keep the upper triangle of ``outer`` (noise included) and mirror it: post-processing
    of the noisy release, so the guarantee is unchanged and the matrix stays symmetric."""
    if "outer" not in payload:
        return payload
    o = payload["outer"]
    upper = torch.triu(o)
    return {**payload, "outer": upper + torch.triu(o, 1).transpose(-1, -2)}


@dataclass
class Uplink:
    """bound -> noise -> encrypt, each stage optional. With none, the server sees every
    client's payload in the clear (and the transcript records it)."""

    bound: Bound = field(default_factory=NoBound)
    dp: Any = None  # privacy.protection.DPStage
    secagg: Any = None  # privacy.protection.SecAggStage
    seed: int = 0
    seeded_noise: bool = False  # --insecure-seeded-noise: noise from the public seed
    updates: Any = None  # privacy.update_secagg.SecureUpdates under --secagg-updates
    hide_counts: bool = False
    hints: list[str] = field(default_factory=list)  # advice printed with the run's notes
    rejected: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)

    # ---- the pipeline ----------------------------------------------------------------------
    def aggregate(self, uploads: list[tuple[int, Payload]], *, round_: int, label: str,
                  transcript: Transcript) -> Payload:
        asked = [c for c, _ in uploads]
        valid = self._validate(uploads, round_, label)
        if self.dp is not None:
            self.dp.check(label, asked)  # stop before a release that would exceed the budget
        if self.secagg is not None:
            total = self._secure_sum(valid, round_, label, transcript)
        else:
            total = self._plain_sum(valid, round_, label, transcript)
        if self.dp is not None:
            self.dp.record(label, asked)
        return total

    def reject(self, round_: int, label: str, client: int, reason: str) -> None:
        log.warning("round %d %s: upload of client %d rejected: %s", round_, label, client,
                    reason)
        self.rejected.append({"round": round_, "label": label, "client": client,
                              "reason": reason})

    def skip(self, round_: int, label: str, reason: str) -> None:
        log.warning("round %d %s: release skipped: %s", round_, label, reason)
        self.skipped.append({"round": round_, "label": label, "reason": reason})
        raise ReleaseSkipped(f"round {round_} {label}: {reason}")

    def _validate(self, uploads, round_, label) -> list[tuple[int, Payload]]:
        valid: list[tuple[int, Payload]] = []
        for client, payload in uploads:
            try:
                validate_upload(payload, valid[0][1] if valid else None)
            except UploadRejected as exc:
                self.reject(round_, label, client, str(exc))
                continue
            valid.append((client, payload))
        if not valid:
            self.skip(round_, label, "no valid upload")
        return valid

    def noise_upload(self, payload: Payload, label: str, round_: int, client: int,
                     share: float) -> Payload:
        """A client's noise stage: a generator seeded from OS entropy (privacy/noise.py),
        ``share`` of the variance (distributed noise under secure aggregation)."""
        if self.dp is None:
            return payload
        g = noise_generator(self.seed, round_, client, 101, seeded=self.seeded_noise)
        return symmetrise_outer(self.dp.noise(payload, label, g, share))

    def _plain_sum(self, valid, round_, label, transcript) -> Payload:
        noisy = [(c, self.noise_upload(p, label, round_, c, share=1.0)) for c, p in valid]
        return self.sum_clear(noisy, round_=round_, label=label, transcript=transcript)

    def sum_clear(self, uploads: list[tuple[int, Payload]], *, round_: int, label: str,
                  transcript: Transcript) -> Payload:
        """Server side without encryption: validate, record and add what clients sent."""
        total: Payload | None = None
        reference: Payload | None = None
        for client, payload in uploads:
            try:
                validate_upload(payload, reference)
            except UploadRejected as exc:
                self.reject(round_, label, client, str(exc))
                continue
            reference = reference or payload
            transcript.record(round_=round_, label=label, view="plain-upload", client=client,
                              tensors=payload, bytes=payload_bytes(payload))
            if total is None:
                total = {k: v.detach().to(torch.float64).clone() for k, v in payload.items()}
            else:
                for k, v in payload.items():
                    total[k] += v.to(torch.float64)
        if total is None:
            self.skip(round_, label, "no valid upload")
        assert total is not None
        return total

    def client_share(self, label: str) -> float:
        """A client's share of the noise variance, from the run config alone."""
        return self.dp.share(label) if self.dp is not None else 1.0

    def key_holder_topup(self, total: Payload, label: str, round_: int, arrived: int) -> Payload:
        """The key holder's top-up after decryption: with distributed noise, the variance of
        the planned uploads that did not make it into the sum (rejected or missing), drawn
        from OS entropy, so the release always carries at least the planned noise."""
        if self.dp is None:
            return total
        share = self.dp.topup_share(label, arrived)
        if share <= 0:
            return total
        g = noise_generator(self.seed, round_, 10_000 + arrived, 102, seeded=self.seeded_noise)
        return symmetrise_outer(self.dp.noise(total, label, g, share=share))

    def _secure_sum(self, valid, round_, label, transcript) -> Payload:
        n = len(valid)
        if n < MIN_SECAGG_CLIENTS:
            self.skip(round_, label, f"{n} valid upload(s), secure aggregation needs "
                                      f">= {MIN_SECAGG_CLIENTS}")
        session = self.secagg.open(label, valid[0][1])
        share = self.client_share(label)
        for client, payload in valid:
            noisy = self.noise_upload(payload, label, round_, client, share=share)
            try:
                size = session.submit(noisy)
            except UploadRejected as exc:  # dropped; the release goes on, noise topped up
                self.reject(round_, label, client, str(exc))
                continue
            transcript.record(round_=round_, label=label, view="ciphertext", client=client,
                              bytes=size)
        if session.count < MIN_SECAGG_CLIENTS:
            self.skip(round_, label, f"only {session.count} upload(s) survived the server's "
                                      "checks")
        try:
            total = session.release()
        except UploadRejected as exc:
            self.skip(round_, label, f"aggregate failed the key holder's check: {exc}")
        total = self.key_holder_topup(total, label, round_, session.count)
        total = {k: v.to(torch.float64) for k, v in total.items()}
        transcript.record(round_=round_, label=label, view="aggregate", client=None,
                          tensors=total, clients=session.count)
        return total

    # ---- model updates --------------------------------------------------------------------
    def update_weights(self, sizes: list[float]) -> list[float]:
        """FedAvg weights of a round: client sizes n_k, except under --dp-train, where the
        sizes are private data: uniform (public) weights, so no size leaves a client."""
        if self.dp is not None and self.dp.covers_updates:
            return [1.0] * len(sizes)
        return list(sizes)

    def average_updates(self, sent: Payload, states: list[Payload], weights: list[float],
                        clients: list[int], *, round_: int, transcript: Transcript,
                        recipe: dict[str, Any]) -> Payload:
        """The round's weighted average of model updates, as the server obtains it: in the
        clear (each update recorded with its weight), or under --secagg-updates as a CKKS sum
        (ciphertext sizes and the aggregate recorded; an aggregate that fails the key
        holder's check leaves the global state as it was)."""
        from privfedcal.federation.local import weighted_average
        from privfedcal.federation.transcript import record_model_updates

        if self.updates is None:
            record_model_updates(transcript, round_, clients, states, weights, recipe)
            return weighted_average(states, weights)
        try:
            return self.updates.average(sent, states, weights, clients, round_=round_,
                                        transcript=transcript)
        except UploadRejected as exc:
            log.warning("round %d model-update: secure aggregate rejected: %s", round_, exc)
            self.skipped.append({"round": round_, "label": "model-update", "reason": str(exc)})
            return dict(sent)

    @staticmethod
    def recipe(cfg) -> dict[str, Any]:
        """The public local-training recipe the transcript records with each update."""
        return {"local_epochs": cfg.local_epochs, "batch_size": cfg.batch_size, "lr": cfg.lr}

    # ---- DP-SGD local training is a release too ---------------------------------------------
    def before_local_training(self, clients=None) -> None:
        if self.dp is not None and "dp-sgd" in self.dp.sigmas:
            self.dp.check("dp-sgd", clients)

    def after_local_training(self, clients=None) -> None:
        if self.dp is not None and "dp-sgd" in self.dp.sigmas:
            self.dp.record("dp-sgd", clients)

    # ---- resume -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"dp": self.dp.state_dict() if self.dp is not None else None,
                "rejected": self.rejected, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.dp is not None and state.get("dp") is not None:
            self.dp.load_state_dict(state["dp"])
        self.rejected = list(state.get("rejected", []))
        self.skipped = list(state.get("skipped", []))

    def summary(self) -> dict[str, Any]:
        if self.dp is None and self.secagg is None and self.updates is None:
            return {}
        out: dict[str, Any] = {}
        if self.dp is not None:
            out.update(self.dp.summary())
        if self.updates is not None:
            out["secagg_updates"] = self.updates.summary()
        if self.secagg is not None:
            out["secagg"] = self.secagg.summary()
            if self.dp is None:
                out["statement"] = ("no differential privacy: the server saw only the sum "
                                    "of the calibration uploads (CKKS secure aggregation); model "
                                    "updates " + ("only as their CKKS sum" if self.updates
                                                  is not None else "travel in the clear"))
        elif self.updates is not None and self.dp is None:
            out["statement"] = ("no differential privacy: the server saw the model updates "
                                "only as their CKKS sum; calibration uploads in the clear")
        out["hide_counts"] = self.hide_counts
        out["noise_source"] = "seeded (insecure)" if self.seeded_noise else "os-entropy"
        if self.seeded_noise:
            out["insecure"] = INSECURE_STATEMENT
            out["statement"] = INSECURE_STATEMENT + ". " + out.get("statement", "")
        return out


def build_uplink(cfg, exp) -> Uplink:
    """The uplink a configuration asks for (see privacy/protection.py)."""
    if not (cfg.dp_enabled or cfg.secagg or cfg.hide_counts or cfg.dp_train
            or cfg.secagg_updates):
        return Uplink(seed=cfg.seed)
    from privfedcal.privacy.protection import build_protected_uplink

    up = build_protected_uplink(cfg, exp)
    if cfg.secagg_updates:
        from privfedcal.privacy.update_secagg import SecureUpdates

        uniform = up.dp is not None and up.dp.covers_updates  # weights 1 under --dp-train
        n_total = float(sum(int(p.numel()) for p in exp.parts))
        up.updates = SecureUpdates(float(cfg.clients) if uniform else n_total, cfg.clients)
    return up


__all__ = ["Uplink", "build_uplink", "validate_upload", "UsageError"]
