"""A run's results: ``summary.json`` (``Summary``) and a line of ``metrics.jsonl``
(``MetricsRow``), as ``federation/simulator.py`` writes them.

The summary is assembled from several writers, each typed here with the key it writes:
``Simulator.summary_fields`` (every run), ``Simulator.finish`` (a finished run) or
``write_diverged`` (a run stopped by the divergence guard), the calibrator's
``after_training`` (``calibration/``), the Flower server's ``extra_summary``
(``flower/flower_simulator.py``) and the protection's ``Uplink.summary`` (``privacy/``: each stage's
``summary``, ``cohorts.whole_run_record``).
"""

from typing import Annotated, Literal, NotRequired, TypedDict


class RoundCalibration(TypedDict):
    """What a per-round calibrator did in a round (``last_round_info``; CReFF's)."""

    name: Annotated[str, "the calibrator (`creff`)"]
    released: Annotated[bool, "whether this round released class gradients (CReFF's "
                              "`release_schedule`); the keys below only where it did"]
    match_loss_before: NotRequired[Annotated[
        float | None, "gradient-matching loss of the federated features before this round's "
                      "steps (None: no class to match)"]]
    match_loss_after: NotRequired[Annotated[float | None, "the same loss after the steps"]]
    matched_classes: NotRequired[Annotated[int, "classes whose aggregated gradient was "
                                                "matched (held by some client)"]]
    seconds: NotRequired[Annotated[float, "wall time of the server's matching and re-training"]]


class MetricsRow(TypedDict):
    """One evaluated round: a line of `metrics.jsonl` (`Run.metrics`)."""

    round: Annotated[int, "the round, from 1"]
    train_loss: Annotated[float | None, "mean local training loss over the round's clients "
                                        "(None: no client reported one, as under DP-SGD)"]
    accuracy: Annotated[float, "test accuracy of the round's evaluated model, a fraction "
                               "(the calibrated one where a per-round calibrator ran)"]
    loss: Annotated[float, "mean test cross-entropy of that model"]
    per_class_accuracy: Annotated[list[float | None], "test accuracy per class, 6 digits "
                                                      "(None: the class has no test example)"]
    calibration: NotRequired[Annotated[RoundCalibration, "the per-round calibrator's work "
                                                         "this round (CReFF)"]]
    seconds: Annotated[float, "wall time of the round"]


class Rejected(TypedDict):
    """A client upload the server refused (malformed, non-finite, or a wrong ciphertext)."""

    round: Annotated[int, "the round of the release"]
    label: Annotated[str, "the release (`ccvr-stats`, `creff-grad`, `model-update`)"]
    client: Annotated[int, "the client whose upload was refused"]
    reason: Annotated[str, "why: a declared code of `privacy/reasons.py` (`malformed-upload`, "
                           "`cohort-incomplete`, ...), never the check's text"]


class Skipped(TypedDict):
    """A release that was not made (no valid upload, too few clients for a secure sum)."""

    round: Annotated[int, "the round of the release"]
    label: Annotated[str, "the release"]
    reason: Annotated[str, "why: a declared code of `privacy/reasons.py` "
                           "(`too-few-uploads`, `aggregate-exceeds-bound`, ...), never the "
                           "check's text"]
    uploads: NotRequired[Annotated[int, "uploads the server received or kept (public: it "
                                        "counts them)"]]
    min_clients: NotRequired[Annotated[int, "the public minimum of a secure sum "
                                            "(--secagg-min-clients)"]]


class Calibration(TypedDict):
    """What a post-hoc calibrator did after training (``PosthocCalibrator._install``):
    the keys common to every calibrator, then each one's own, marked with its name."""

    name: Annotated[str, "the calibrator (`ccvr`, `oracle`)"]
    accuracy_after: Annotated[float, "test accuracy with the re-trained head, a fraction"]
    seconds: Annotated[float, "wall time of the calibration (statistics, sampling, re-training)"]
    retrain_steps: Annotated[int, "optimisation steps of the head's re-training"]
    present_classes: NotRequired[Annotated[int, "ccvr: classes present in the summed "
                                                "statistics"]]
    virtual_features: NotRequired[Annotated[int, "ccvr: virtual features drawn from the class "
                                                 "Gaussians"]]
    virtual_mode: NotRequired[Annotated[str, "ccvr: how virtual features are spread over "
                                             "classes (`balanced`, ...)"]]
    tukey: NotRequired[Annotated[bool, "ccvr: whether features went through ReLU + Tukey's "
                                       "transform"]]
    per_class: NotRequired[Annotated[int | None, "oracle: real features kept per class "
                                                 "(None: all)"]]
    real_features: NotRequired[Annotated[int, "oracle: real training features the head was "
                                              "re-trained on"]]


class AccountedRelease(TypedDict):
    """One group of releases the accountant composed."""

    label: Annotated[str, "the release (`ccvr-stats`, `creff-grad`, `dp-sgd`)"]
    noise_multiplier: Annotated[float, "Gaussian noise std over the sensitivity"]
    sample_rate: Annotated[float, "sampling probability per step (1: every example)"]
    steps: Annotated[int, "releases (or DP-SGD steps) composed"]


class CKKSParams(TypedDict):
    """The CKKS parameters one release was encrypted under (``privacy/secagg.py``)."""

    poly_modulus_degree: Annotated[int, "ring degree N (N/2 slots per ciphertext)"]
    coeff_mod_bit_sizes: Annotated[list[int], "bit sizes of the modulus chain, the special "
                                              "prime last"]
    scale_bits: Annotated[int, "log2 of the encoding scale"]
    n_threads: Annotated[int, "TenSEAL threads"]
    max_abs_sum: Annotated[float, "the largest absolute value a sum may take (from the "
                                  "release's declared magnitude)"]
    max_clients: Annotated[int, "the most uploads in one sum"]


class SecAgg(TypedDict):
    """CKKS secure aggregation of the calibration uploads (``CKKSSettings.summary``)."""

    scheme: Annotated[str, "`CKKS (TenSEAL)`"]
    params: Annotated[dict[str, CKKSParams], "release label -> its CKKS parameters"]
    min_clients: Annotated[int, "fewest uploads in a sum (`secagg_min_clients`, plus one "
                                "when the key holder is a client)"]
    keys: Annotated[str, "how keys are made and held"]
    release_rounding: Annotated[str, "how decrypted sums are rounded before release"]
    cohorts: NotRequired[Annotated[list[list[int]], "the run's fixed cohorts: a sum holds "
                                                    "whole cohorts only"]]


class SecAggUpdates(SecAgg):
    """CKKS secure aggregation of the model updates (`secagg_updates=True`)."""

    model_updates: Annotated[str, "what the server sees of the updates"]
    rounds: Annotated[int, "rounds whose updates were summed under encryption"]
    mean_seconds_per_round: Annotated[float | None, "mean wall time of a round's secure sum "
                                                    "(None: no round)"]


class WholeRun(TypedDict):
    """What all the run's secure sums, taken together, isolate (``cohorts.whole_run_record``)."""

    secure_sums: Annotated[int, "secure sums the run made"]
    min_clients: Annotated[int, "the fewest clients any combination may isolate"]
    holds: Annotated[bool, "whether no combination isolates fewer than `min_clients`"]
    observer_knows: Annotated[list[int], "clients whose values the key holder knows as its own"]
    isolated: Annotated[list[int] | None, "a group a combination isolates (None: none)"]
    check: Annotated[str, "`exact`, or the conservative check on participation columns"]
    statement: Annotated[str, "the finding, in one sentence"]


class FromTranscript(TypedDict):
    """Each client's epsilon recomputed from the server's record and the public plan alone
    (``privacy/transcript_epsilon.py``), beside the run's claim: every release the server
    holds charged, one received again with the same value once."""

    epsilon: Annotated[float, "the worst-off client's epsilon of the releases the server holds"]
    per_client: Annotated[dict[str, float], "client (as a string) -> its recomputed epsilon"]
    releases: Annotated[int, "client releases charged (one per client in each distinct "
                             "value it entered)"]
    repeated: Annotated[int, "releases received again with a value already held (a redone "
                             "round re-sending its journaled release): worth nothing new"]
    epsilon_claimed: Annotated[float, "the run's reported epsilon (`epsilon_spent`); at "
                                      "least `epsilon`"]


class AdaptiveClip(TypedDict):
    """The update clip moved each round towards a quantile of the update norms
    (`dp_adaptive_clip=True`), from a noised count of updates below it."""

    quantile: Annotated[float, "the target quantile (`dp_clip_quantile`)"]
    lr: Annotated[float, "learning rate of the clip's geometric update"]
    initial_clip: Annotated[float, "the clip of the first round"]
    count_noise_std: Annotated[float, "std of the noise on the count below the clip"]
    update_noise_multiplier: Annotated[float, "noise multiplier of the updates, with the "
                                              "count's share of the budget taken off"]


class UserDP(TypedDict):
    """User-level DP-FedAvg of the model updates (`dp_updates=True`; ``privacy/user_dp.py``):
    each client's update clipped, Gaussian noise on the sum."""

    epsilon_spent: Annotated[float, "user-level epsilon spent by the worst-off client"]
    delta: Annotated[float, "its delta"]
    noise_multiplier: Annotated[float, "noise std over the update clip"]
    update_clip: Annotated[float, "the L2 bound of a client's update (the last round's, "
                                  "with an adaptive clip)"]
    noise_std_of_sum: Annotated[float, "std of the noise on the sum of the updates"]
    denominator: Annotated[float, "the fixed public denominator of the average"]
    sample_rate: Annotated[float, "sampling rate the accountant charged (1: no amplification)"]
    noise: Annotated[Literal["central", "distributed"], "who adds the noise: the server to "
                                                        "the sum, or the clients in shares"]
    adaptive_clip: NotRequired[Annotated[AdaptiveClip | None, "the adaptive clip (None: "
                                                              "a fixed clip)"]]
    assumptions: Annotated[list[str], "what the guarantee assumes"]
    statement: Annotated[str, "the guarantee in words"]


class Privacy(TypedDict):
    """The run's protection (``Uplink.summary``): the DP keys where DP is on (`dp_eps`),
    `secagg` / `secagg_updates` where sums are encrypted, and what every protected run
    states. Absent from the summary for a run without protection."""

    epsilon_spent: NotRequired[Annotated[float, "DP: epsilon spent by the worst-off client"]]
    epsilon_target: NotRequired[Annotated[float, "DP: the budget (`dp_eps`)"]]
    delta: NotRequired[Annotated[float, "DP: delta (`dp_delta`)"]]
    accountant: NotRequired[Annotated[str, "DP: the accountant (`rdp`, `prv`, ...)"]]
    covers: NotRequired[Annotated[str, "DP: what the guarantee covers (calibration uploads, "
                                       "model updates under DP-SGD)"]]
    noise_multipliers: NotRequired[Annotated[dict[str, float], "DP: release label -> noise "
                                                               "multiplier"]]
    sample_rates: NotRequired[Annotated[dict[str, float], "DP: release label -> sampling "
                                                          "rate"]]
    feature_clip: NotRequired[Annotated[float, "DP: the feature clip bound R (`dp_clip`)"]]
    grad_clip: NotRequired[Annotated[float, "DP: the gradient clip bound (`dp_grad_clip`)"]]
    distributed_noise: NotRequired[Annotated[bool, "DP: each client adds a share of the "
                                                   "noise (under secure aggregation)"]]
    releases: NotRequired[Annotated[list[AccountedRelease], "DP: what the accountant "
                                                            "composed"]]
    per_client_epsilon: NotRequired[Annotated[dict[str, float], "DP: client (as a string) -> "
                                                                "its epsilon spent; listed up "
                                                                "to 1,000 clients"]]
    epsilon_clients: NotRequired[Annotated[dict[str, int], "DP: epsilon spent (as a string) "
                                                           "-> how many clients spent it, "
                                                           "largest first"]]
    client_release_limits: NotRequired[Annotated[dict[str, int], "DP: release label -> "
                                                 "releases a client's ledger allows"]]
    assumptions: NotRequired[Annotated[list[str], "DP: what the guarantee assumes"]]
    secagg: NotRequired[Annotated[SecAgg, "secure aggregation of the calibration uploads"]]
    secagg_updates: NotRequired[Annotated[SecAggUpdates, "secure aggregation of the model "
                                                         "updates"]]
    user_dp: NotRequired[Annotated[UserDP, "user-level DP of the model updates "
                                           "(`dp_updates=True`)"]]
    statement: NotRequired[Annotated[str, "the guarantee (or its absence) in words"]]
    hide_counts: Annotated[bool, "whether ciphertexts are padded so that their size hides "
                                 "the counts (`hide_counts`)"]
    noise_source: Annotated[str, "`os-entropy`, or `seeded (insecure)`"]
    insecure: NotRequired[Annotated[str, "the warning of a run with seeded DP noise"]]
    whole_run: NotRequired[Annotated[WholeRun, "the whole run's secure sums together "
                                               "(with `secagg` or `secagg_updates`)"]]
    from_transcript: NotRequired[Annotated[FromTranscript, "DP: the epsilon recomputed from "
                                                           "the transcript, beside the claim"]]


class Diverged(TypedDict):
    """Where the divergence guard stopped the run (``errors.Diverged.record``)."""

    round: Annotated[int, "the round reached"]
    client: Annotated[int | None, "the client where the non-finite numbers appeared "
                                  "(None: unknown or the server)"]
    what: Annotated[str, "what was not finite"]
    hint: Annotated[str, "what to change"]


class Evaluation(TypedDict):
    """An evaluation's round and accuracy."""

    round: Annotated[int, "the round"]
    accuracy: Annotated[float, "test accuracy then, a fraction"]


class FlowerHolds(TypedDict):
    """Flower's hold messages (`flower.hold`): how many and how long they lasted."""

    sent: Annotated[int, "holds sent"]
    missed: Annotated[int, "holds without a reply"]
    median_seconds: Annotated[float, "median hold duration"]
    max_seconds: Annotated[float, "longest hold"]


class Dropped(TypedDict):
    """A client whose node was lost in a Flower exchange that went on without it."""

    group: Annotated[str, "the exchange (its round, or label and round)"]
    message: Annotated[str, "the message type (`train`, `query.payload`, ...)"]
    client: Annotated[int, "the client"]
    node: Annotated[int, "its SuperNode's id"]
    reason: Annotated[str, "an error code, or why no reply came"]


class FeatureClipSearch(TypedDict):
    """The Flower plugin's private choice of the feature clip (`dp-clip = "auto"`)."""

    clip: Annotated[float, "the clip chosen"]
    median_estimate: Annotated[float, "the first stage's estimate of the median norm"]
    quantile: Annotated[float, "the norm quantile the clip estimates"]
    epsilon: Annotated[float, "the search's epsilon"]
    delta: Annotated[float, "the search's delta"]
    noise_multiplier: Annotated[float, "its one release's noise multiplier"]
    composition: Annotated[str, "how it composes with the calibration release"]
    run_epsilon: NotRequired[Annotated[float, "the whole run's epsilon"]]
    run_delta: NotRequired[Annotated[float, "the whole run's delta"]]


class PluginRun(TypedDict):
    """What the Flower plugin (`privfedcal.flower.plugin.calibrate`) calibrated."""

    model: Annotated[str, "the user's model class"]
    head: Annotated[str, "its head's module name"]
    nodes: Annotated[int, "the nodes that took part"]
    examples: Annotated[int, "the public example count N the plan used"]
    feature_clip: NotRequired[Annotated[FeatureClipSearch, "with dp-clip auto: the search"]]


class Summary(TypedDict):
    """`summary.json` (`Run.summary`): what the run was, how it ended and what it spent.

    A finished run has `loss` and `per_class_accuracy`; a run stopped by the divergence
    guard has `diverged`, `last_finite_evaluation` and `checkpoint_round` instead, and
    `accuracy` None. Both list `rejected_uploads` and `skipped_releases`."""

    method: Annotated[str, "the federated method (`fedavg`, `ccvr`, `creff`, ...)"]
    local_method: Annotated[str, "the clients' local objective"]
    calibrator: Annotated[str, "the calibrator (`none`, `ccvr`, `creff`, `oracle`)"]
    dataset: Annotated[str, "the dataset"]
    model: Annotated[str, "the model"]
    rounds: Annotated[int, "rounds configured"]
    wall_seconds: Annotated[float, "training and calibration wall time (resumed runs: summed)"]
    uploaded_bytes: Annotated[int, "bytes of calibration uploads the server received"]
    calibration_upload_bytes: Annotated[int, "the same count as `uploaded_bytes`"]
    model_update_bytes: Annotated[int, "bytes of the model updates the clients sent, "
                                          "counted as plain tensors"]
    accuracy: Annotated[float | None, "test accuracy of the final (calibrated) model, a "
                                      "fraction (None: the run diverged)"]
    loss: NotRequired[Annotated[float, "its mean test cross-entropy"]]
    per_class_accuracy: NotRequired[Annotated[list[float | None], "its test accuracy per class "
                                              "(None: no test example)"]]
    rejected_uploads: NotRequired[Annotated[list[Rejected], "uploads the server refused"]]
    skipped_releases: NotRequired[Annotated[list[Skipped], "releases not made"]]
    accuracy_before_calibration: NotRequired[Annotated[float, "post-hoc calibrators: test "
                                                       "accuracy of the global model before"]]
    per_class_accuracy_before_calibration: NotRequired[Annotated[
        list[float | None] | None, "post-hoc calibrators: its per-class accuracy"]]
    calibration: NotRequired[Annotated[Calibration, "post-hoc calibrators: what the "
                                                    "calibration did"]]
    creff_dsa: NotRequired[Annotated[str, "creff: the augmentation the client gradients ran "
                                          "under"]]
    creff_client_draws: NotRequired[Annotated[int | None, "creff: per-class cap of each "
                                                          "client's draws (None: no cap)"]]
    creff_release_rounds: NotRequired[Annotated[list[int] | None, "creff: rounds that "
                                                "released class gradients (None: every one)"]]
    dropped_clients: NotRequired[Annotated[list[Dropped], "Flower: clients whose nodes were "
                                                          "lost on the way"]]
    plugin: NotRequired[Annotated[PluginRun, "the Flower plugin's run: model, head, nodes"]]
    flower_holds: NotRequired[Annotated[FlowerHolds, "Flower: hold messages (`flower.hold`)"]]
    privacy: NotRequired[Annotated[Privacy, "the run's protection (absent: none)"]]
    diverged: NotRequired[Annotated[Diverged, "diverged runs: where the guard stopped them"]]
    last_finite_evaluation: NotRequired[Annotated[Evaluation | None, "diverged runs: the last "
                                                  "finite evaluation (None: none)"]]
    checkpoint_round: NotRequired[Annotated[int, "diverged runs: the round of the checkpoint "
                                                 "kept (0: none)"]]
    notes: Annotated[list[str], "what the run printed at its end (warnings, the guarantee)"]


__all__ = ["AccountedRelease", "AdaptiveClip", "CKKSParams", "Calibration", "Diverged", "Dropped",
           "Evaluation", "FeatureClipSearch", "FlowerHolds", "MetricsRow", "PluginRun",
           "Privacy", "Rejected", "RoundCalibration", "SecAgg", "SecAggUpdates", "Skipped",
           "Summary", "UserDP", "WholeRun"]
